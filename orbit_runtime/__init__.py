"""Orbit runtime: RL post-training on a frozen INT4 base shared by vLLM and the learner."""

__version__ = "0.1.0"
