"""The reference policy: log-probs of the INT4 base with no adapter (for the KL penalty)."""
