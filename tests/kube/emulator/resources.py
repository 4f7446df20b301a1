"""Paths the emulator and its tests share: the repository, the Orbit CRD, the RLTrainingJob resource key."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

REPO_ROOT = Path(__file__).resolve().parents[3]
ORBIT_CRD = REPO_ROOT / "charts" / "orbit" / "crds" / "rltrainingjob.yaml"
RLJOBS = "orbit.dev/v1alpha1/rltrainingjobs"  # a resource key for KubeEmulator.path()

_T = TypeVar("_T")
KUEUE_WORKLOAD_CRD = Path(__file__).with_name("kueue_workloads_crd.yaml")  # Kueue's Workload kind (no Kueue controller runs)
