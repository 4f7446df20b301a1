"""Environments for multi-turn episodes: the interface the learner drives (base), tool calls in
the Hermes/Qwen format (tool_calls), tools from Python callables and the environment that runs
them (tools, calculator), the token ids of environment turns (chat_tokens), environments
written for `verifiers` (verifiers_adapter), and loading the one a job names (loading). The
episodes themselves are run by `trainer/episodes.py`."""
