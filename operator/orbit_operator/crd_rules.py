"""The CRD's CEL rules (`x-kubernetes-validations`): what the API server refuses that a schema cannot say.

Each rule says what the operator's own validation says (validation.py, job_spec.py), never more:
the API server refuses early, naming the field, what the operator would refuse anyway.

- exactly one base source (pvc, uri, nodeCache), and a nodeCache base is INT4;
- metadata.name at most MAX_NAME characters: the pod `<job>-<attempt>` and the ConfigMap
  `<job>-config` must stay valid names;
- while the job's pod runs, `spec.resources` and `spec.base` (but the planner-only
  architecture and modelConfig) do not change, unless the same change sets a new
  `spec.restartId` or `spec.suspend: true`: the two ways the operator applies a change. The
  operator decides "runs" from its status (reconcile.py): a pod was created (`podName`), the
  phase is Pending, Preparing or Running, and no restart or resume is pending (`reapply`,
  `restartId` as applied); a job Queued again by Kueue with a pod name counts as running. The
  other fields are still refused by the operator alone (a `SpecChangeRefused` condition): a rule
  per section would say the same with more cost. The rules compare with the previous object,
  the operator with the spec its pod runs: CEL refuses a strict subset of what the operator
  refuses (a revert to the running spec without a restartId is refused here, and is a no-op
  there). Quantities are compared as text: `cpu: 8` re-applied as `"8"` is no change.

Only `has()`, `size()`, `in`, `==`, ternaries and arithmetic: what Kubernetes' CEL and
cel-python (the tests evaluate every rule) both have. Optional fields are never compared
with null: where a field's default is null the CRD prunes an explicit null (crd.py).
"""

from __future__ import annotations

from orbit_operator.validation import MAX_NAME

# the old object's job has a pod of the applied spec, and this change neither restarts nor suspends it
RUNNING = (
    "has(oldSelf.status) && has(oldSelf.status.phase) && oldSelf.status.phase in ['Pending', 'Preparing', 'Running', 'Queued']"
    " && has(oldSelf.status.podName) && !(has(oldSelf.status.reapply) && oldSelf.status.reapply)"
    " && !(has(self.spec.suspend) && self.spec.suspend)"
    " && (has(self.spec.restartId) ? self.spec.restartId : '') == (has(oldSelf.status.restartId) ? oldSelf.status.restartId : '')"
)
BASE_FIXED = ("format", "pvc", "uri", "nodeCache", "groupSize", "credentialsSecret")  # not architecture, modelConfig
HOW = "set a new spec.restartId, or spec.suspend: true, in the same change"


def _same(path: str, as_text: bool = False) -> str:
    """PATH (under spec) is unchanged. AS_TEXT: compared as strings (a quantity: `cpu: 8` and `cpu: "8"` are the
    same to the operator, but not to CEL's ==)."""
    new, old = f"self.spec.{path}", f"oldSelf.spec.{path}"
    if as_text:
        return f"(has({new}) == has({old}) && (!has({new}) || string({new}) == string({old})))"
    return f"(has({new}) == has({old}) && (!has({new}) || {new} == {old}))"


def _same_resources() -> str:
    """spec.resources unchanged, field by field (every level is defaulted, so each has() is safe)."""
    fields = [_same(f"resources.{role}.{name}", as_text=name in ("cpu", "memory"))
              for role in ("rollout", "reference", "learner") for name in ("gpus", "cpu", "memory", "image")]  # fmt: skip
    return "(" + " && ".join(fields) + ")"


BASE_RULES = [
    {"rule": "(has(self.pvc) ? 1 : 0) + (has(self.uri) ? 1 : 0) + (has(self.nodeCache) ? 1 : 0) == 1",
     "message": "set exactly one of pvc, uri, nodeCache"},
    {"rule": "!has(self.nodeCache) || (has(self.format) && self.format == 'int4')",
     "message": "nodeCache holds INT4 bases only: set format: int4"},
]  # fmt: skip

ROOT_RULES = [
    {"rule": f"self.metadata.name.size() <= {MAX_NAME}",
     "message": f"metadata.name: at most {MAX_NAME} characters (the pod <name>-<attempt> and the ConfigMap <name>-config "
                "must stay valid names)"},
    {"rule": f"!({RUNNING}) || {_same_resources()}",
     "message": f"spec.resources cannot change while the job's pod runs: {HOW}"},
    {"rule": f"!({RUNNING}) || ({' && '.join(_same(f'base.{name}') for name in BASE_FIXED)})",
     "message": f"spec.base (but architecture and modelConfig) cannot change while the job's pod runs: {HOW}"},
]  # fmt: skip
