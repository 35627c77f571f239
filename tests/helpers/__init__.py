"""Shared test helpers (tiny models and their configs); test modules import from here, never from each other."""
