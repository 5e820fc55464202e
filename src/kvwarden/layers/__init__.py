"""kvwarden.layers"""
