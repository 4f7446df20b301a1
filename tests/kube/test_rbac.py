"""RBAC equals use: the API calls the operator made in its tests (tests/kube/test_operator.py and
the end-to-end tests in tests/e2e, which run it with its own token so the emulator records its
calls apart from kubectl's and the test node's) against the chart's rendered roles."""

from __future__ import annotations

import pytest

from tests.kube.test_operator import OPERATOR_API_CALLS
from tests.unit.test_chart import by_kind, render


def granted(objects: list[dict]) -> set[tuple[str, str, str, str]]:
    """(verb, group, resource, subresource) every rule of the rendered ClusterRoles and Roles allows."""
    out = set()
    for role in by_kind(objects, "ClusterRole") + by_kind(objects, "Role"):
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    name, _, sub = resource.partition("/")
                    out |= {(verb, group, name, sub) for verb in rule["verbs"]}
    return out


@pytest.mark.parametrize("values", [None, {"watchNamespaces": ["default", "team-a"]}], ids=["cluster-wide", "namespaced"])
def test_the_chart_grants_exactly_the_calls_the_operator_makes(values):
    assert OPERATOR_API_CALLS, "no operator API calls recorded: run this file together with tests/kube/test_operator.py"
    allowed = granted(render(values))
    assert not OPERATOR_API_CALLS - allowed, f"used but not granted: {sorted(OPERATOR_API_CALLS - allowed)}"
    assert not allowed - OPERATOR_API_CALLS, f"granted but never used: {sorted(allowed - OPERATOR_API_CALLS)}"
