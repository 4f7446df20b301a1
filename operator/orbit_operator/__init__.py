"""Orbit's Kubernetes operator (kopf). Import package `orbit_operator`; never name a module `operator`."""
