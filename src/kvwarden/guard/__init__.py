"""kvwarden.guard"""
