"""Adapter hot-sync: atomic publish of adapter versions and canary-verified loading into vLLM."""
