"""Reward functions: built-ins and user plugins by dotted path, with per-sample failure isolation."""
