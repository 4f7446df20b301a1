"""'module:callable' paths in a job spec (tools, environments) resolved to the callable, errors naming the field."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from orbit_runtime.errors import OrbitError


def load_callable(path: str, field: str) -> Callable:
    """'module:callable' -> the callable; OrbitError naming FIELD."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise OrbitError(f"{field} {path!r}: expected 'module:callable'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise OrbitError(f"{field} {path!r}: cannot import {module_name} ({exc})") from None
    target = getattr(module, attr, None)
    if not callable(target):
        raise OrbitError(f"{field} {path!r}: {module_name} has no callable {attr!r}")
    return target
