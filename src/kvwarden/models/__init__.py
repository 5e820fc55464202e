"""kvwarden.models"""
