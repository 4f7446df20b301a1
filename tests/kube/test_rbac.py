"""RBAC equals use: the API calls the operator made in its tests (tests/kube/test_operator.py, and
the end-to-end tests in tests/e2e when they run first) against the chart's rendered roles, for
each mode. The operator runs with its own token, so the emulator records its calls apart from
kubectl's and the test node's, with their scope (a namespace in the URL or not).

It needs those tests' recordings: run this file together with tests/kube/test_operator.py
(`pytest tests/kube` does; alone it fails saying so)."""

from __future__ import annotations

import pytest

from tests.kube.test_operator import OPERATOR_API_CALLS
from tests.unit.test_chart import by_kind, render

MODES = {"cluster-wide": None, "namespaced": {"watchNamespaces": ["default"]}}


def rules(objects: list[dict], kind: str) -> set[tuple[str, str, str, str]]:
    """(verb, group, resource, subresource) every rule of the rendered KIND objects allows."""
    out = set()
    for role in by_kind(objects, kind):
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], rule  # no wildcards
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    name, _, sub = resource.partition("/")
                    out |= {(verb, group, name, sub) for verb in rule["verbs"]}
    return out


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_chart_grants_exactly_the_calls_the_operator_makes(mode):
    used = OPERATOR_API_CALLS[mode]
    assert used, f"no {mode} operator API calls recorded: run this file together with tests/kube/test_operator.py"
    objects = render(MODES[mode])
    cluster, namespaced = rules(objects, "ClusterRole"), rules(objects, "Role")
    # a ClusterRole allows a call in any namespace and cluster-wide; a Role only inside its namespace
    missing = {c for c in used if c[:4] not in cluster and (c[4] == "cluster" or c[:4] not in namespaced)}
    assert not missing, f"used but not granted: {sorted(missing)}"
    unused = (cluster | namespaced) - {c[:4] for c in used}
    assert not unused, f"granted but never used: {sorted(unused)}"
