"""Job configuration models (pydantic, no torch import). The CRD schema is generated from these."""

from orbit_runtime.config.adapter import AdapterSpec
from orbit_runtime.config.loading import load_job_spec, parse_job_spec
from orbit_runtime.config.spec import JobSpec

__all__ = ["AdapterSpec", "JobSpec", "load_job_spec", "parse_job_spec"]
