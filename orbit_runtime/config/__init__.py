"""Job configuration models (pydantic, no torch import). The CRD schema is generated from these."""

from orbit_runtime.config.adapter import AdapterSpec

__all__ = ["AdapterSpec"]
