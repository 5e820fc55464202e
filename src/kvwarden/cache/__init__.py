"""kvwarden.cache"""
