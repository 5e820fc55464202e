"""kvwarden.bench"""
