"""Pure helpers for API-server semantics: timestamps, Status errors, merge patches, label/field
selectors, kubectl's jsonpath and ages."""

from __future__ import annotations

import copy
import datetime
import re
from collections.abc import Callable, Mapping
from typing import Any

import kmock

from .resources import _T  # noqa: F401

# --- small pure helpers ----------------------------------------------------------------------------------------


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _error(code: int, reason: str, message: str, **details: Any) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=code, reason=reason, message=message, details=details or {"causes": []})


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7396 JSON merge patch: dicts merge recursively, ``null`` deletes, anything else replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge_patch(result.get(key), value)
    return result


_SELECTOR_TERM = re.compile(
    r"^\s*(?P<neg>!)?\s*(?P<key>[A-Za-z0-9_./-]+)\s*"
    r"(?:(?P<op>==|=|!=)\s*(?P<value>[A-Za-z0-9_./-]*)|\s+(?P<setop>in|notin)\s*\((?P<values>[^)]*)\))?\s*$"
)


def _parse_selector(selector: str | None) -> list[Callable[[Callable[[str], str | None]], bool]]:
    """Parse a label/field selector into predicates over a getter (key -> value or None); ValueError if bad."""
    terms: list[Callable[[Callable[[str], str | None]], bool]] = []
    for raw in re.split(r",(?![^()]*\))", selector or ""):
        if not raw.strip():
            continue
        m = _SELECTOR_TERM.match(raw)
        if m is None or (m["neg"] and (m["op"] or m["setop"])):
            raise ValueError(f"unable to parse requirement: {raw!r}")
        key, op, value = m["key"], m["op"] or m["setop"], m["value"]
        values = {v.strip() for v in (m["values"] or "").split(",")}
        if op in ("=", "=="):
            terms.append(lambda get, k=key, v=value: get(k) == v)
        elif op == "!=":
            terms.append(lambda get, k=key, v=value: get(k) != v)
        elif op == "in":
            terms.append(lambda get, k=key, vs=values: get(k) in vs)
        elif op == "notin":
            terms.append(lambda get, k=key, vs=values: get(k) not in vs)
        elif m["neg"]:
            terms.append(lambda get, k=key: get(k) is None)
        else:
            terms.append(lambda get, k=key: get(k) is not None)
    return terms


def _field(obj: Mapping[str, Any], dotted: str) -> str | None:
    value: Any = obj
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return None if value is None else str(value)


def _jsonpath(obj: Any, path: str) -> Any:
    """The simple JSONPaths of printer columns: ``.a.b``, ``.a[0].b``."""
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        if part.startswith("["):
            index = int(part[1:-1])
            obj = obj[index] if isinstance(obj, list) and len(obj) > index else None
        else:
            obj = obj.get(part) if isinstance(obj, Mapping) else None
    return obj


def _age(timestamp: str) -> str:
    then = datetime.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    seconds = max(0, int((datetime.datetime.now(datetime.UTC) - then).total_seconds()))
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 3 * 3600:
        return f"{seconds // 60}m"
    if seconds < 48 * 3600:
        return f"{seconds // 3600}h"
    return f"{seconds // 86400}d"
