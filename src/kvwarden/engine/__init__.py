"""kvwarden.engine"""
