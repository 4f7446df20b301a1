"""RBAC equals use: the API calls the operator made in its tests (tests/kube/test_operator.py, and
the end-to-end tests in tests/e2e when they run first) against the chart's rendered roles, for
each mode. The operator runs with its own token, so the emulator records its calls apart from
kubectl's and the test node's, with their scope (a namespace in the URL or not).

Whichever of the operator scenarios (tests/kube/test_operator.py, test_operator_controller.py)
have not run in this session (this file alone, or run first) are run here, each against a fresh
emulator: the check never depends on which other tests ran."""

from __future__ import annotations

import inspect
import tempfile
from pathlib import Path

import pytest

from tests.kube import test_kueue, test_operator, test_operator_controller, test_operator_security
from tests.kube.emulator import ORBIT_CRD, KubeEmulator
from tests.kube.test_operator import OPERATOR_API_CALLS, RECORDED_TESTS
from tests.unit.test_chart import by_kind, render

MODES = {"cluster-wide": None, "namespaced": {"watchNamespaces": ["default"]}, "kueue": {"kueue": {"enabled": True}},
         "network-policy": {"networkPolicy": {"enabled": True}}}  # fmt: skip
# the calls a mode's roles must equal: kueue is cluster-wide with Workloads on top (its scenarios: tests/kube/test_kueue.py)
USED_IN = {"cluster-wide": ("cluster-wide",), "namespaced": ("namespaced",), "kueue": ("cluster-wide", "kueue"),
           "network-policy": ("cluster-wide", "network-policy")}  # its scenario: tests/kube/test_operator_security.py  # fmt: skip


def rules(objects: list[dict], kind: str) -> set[tuple[str, str, str, str]]:
    """(verb, group, resource, subresource) every rule of the rendered KIND objects allows."""
    out = set()
    for role in by_kind(objects, kind):
        if role["metadata"].get("labels", {}).get("rbac.orbit.dev/for") == "kueue":
            continue  # Kueue's own ServiceAccount's (tests/unit/test_kueue_lifecycle.py), not the operator's
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], rule  # no wildcards
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    name, _, sub = resource.partition("/")
                    out |= {(verb, group, name, sub) for verb in rule["verbs"]}
    return out


def operator_scenarios() -> dict[str, object]:
    """The tests that run the operator: name -> function(kube, tmp_path)."""
    modules = (test_operator, test_operator_controller, test_kueue, test_operator_security)
    return {name: fn for module in modules for name, fn in inspect.getmembers(module, inspect.isfunction)
            if name.startswith("test_") and fn.__module__ == module.__name__
            and list(inspect.signature(fn).parameters) == ["kube", "tmp_path"]}  # fmt: skip


@pytest.fixture(scope="module")
def operator_calls() -> dict[str, set[tuple[str, str, str, str, str]]]:
    """OPERATOR_API_CALLS once every operator scenario has run (here, for those that have not)."""
    for name, scenario in sorted(operator_scenarios().items()):
        if name in RECORDED_TESTS:
            continue
        with KubeEmulator() as kube, tempfile.TemporaryDirectory(prefix="orbit-rbac-") as tmp:
            kube.load_crd(ORBIT_CRD)
            kube.write_kubeconfig(Path(tmp) / "kubeconfig")
            scenario(kube, Path(tmp))
        RECORDED_TESTS.add(name)
    return OPERATOR_API_CALLS


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_chart_grants_exactly_the_calls_the_operator_makes(mode, operator_calls):
    used = set().union(*(operator_calls[m] for m in USED_IN[mode]))
    assert used, f"no {mode} operator API calls recorded"
    objects = render(MODES[mode])
    cluster, namespaced = rules(objects, "ClusterRole"), rules(objects, "Role")
    # a ClusterRole allows a call in any namespace and cluster-wide; a Role only inside its namespace
    missing = {c for c in used if c[:4] not in cluster and (c[4] == "cluster" or c[:4] not in namespaced)}
    assert not missing, f"used but not granted: {sorted(missing)}"
    unused = (cluster | namespaced) - {c[:4] for c in used}
    assert not unused, f"granted but never used: {sorted(unused)}"
