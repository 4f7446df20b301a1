"""The learner's RL loop (`orbit train`): rollout, rewards, reference, GRPO update, verified sync."""
