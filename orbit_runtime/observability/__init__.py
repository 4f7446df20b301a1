"""Prometheus metrics of every role, and the HTTP endpoint that serves them."""
