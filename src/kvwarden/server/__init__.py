"""kvwarden.server"""
