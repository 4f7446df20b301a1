"""RL algorithms as pure tensor functions (no I/O, no model): advantages, losses, corrections."""
