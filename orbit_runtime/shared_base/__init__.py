"""One copy of the frozen base in memory, shared by the rollout engine and the learner
(`placement: colocated`): a sealed memory file (`arena`), handed between processes over a
Unix socket (`transport`), filled from vLLM's own weight tensors (`vllm_weights`)."""
