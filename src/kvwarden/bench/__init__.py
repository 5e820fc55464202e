"""Measurement code shared by the tests and the ``bench/`` scripts."""
