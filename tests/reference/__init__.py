"""Naive reference models and test helpers (importable as ``reference`` via tests/conftest.py)."""
