"""Job configuration models (pydantic, no torch import). The CRD schema is generated from these."""

from orbit_runtime.config.adapter import AdapterSpec
from orbit_runtime.config.spec import JobSpec, load_job_spec, parse_job_spec

__all__ = ["AdapterSpec", "JobSpec", "load_job_spec", "parse_job_spec"]
