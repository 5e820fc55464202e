"""kvwarden.probe"""
