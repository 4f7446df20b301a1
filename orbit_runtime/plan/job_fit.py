"""Does a job's pod, as the job asks for it, fit? The check `orbit prepare-base`, the operator and
`orbit validate` run.

The pod's containers each get their own GPUs (Kubernetes never shares a GPU between
containers) and a memory limit. A role with GPUs must fit each of them; a role without runs
on the CPU and must fit its container's memory limit, which also has to hold what a GPU
role loads through the host (the learner materialises the whole base on the CPU first).
GPUs whose memory is unknown (no `nvidia.com/gpu.product` in the job's nodeSelector, no
operator setting) are not judged; the summary says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orbit_runtime.plan.architecture import Architecture, PlanError
from orbit_runtime.plan.hardware import gib
from orbit_runtime.plan.layouts import GpuGroup, rollout_usable
from orbit_runtime.plan.planner import Plan, make_plan
from orbit_runtime.plan.request import PlanRequest, RoleBudget
from orbit_runtime.plan.roles import host_bytes, learner_rows, reference_rows, rollout_rows

UNLIMITED = 1 << 62  # a container without a memory limit


@dataclass
class JobFit:
    fits: bool
    groups: list[GpuGroup]
    plan: Plan  # the three layouts on the job's node, for the message
    unjudged: list[str] = field(default_factory=list)  # roles whose GPU memory is unknown

    def _where(self, group: GpuGroup, short: bool = False) -> str:
        role = "/".join(group.roles)
        if group.gpus:
            gpu = self.plan.node.name.split(" x ", 1)[-1]
            return f"{role} {group.gpus}x{gpu}" if short else f"{role} on {group.gpus} x {gpu}"
        if "host_memory" in group.rows:
            return f"{role} host" if short else f"{role} container (host memory to load the base)"
        return role if short else f"{role} container"

    def summary(self) -> str:
        """One line for the job's status: each GPU or container, what it needs of what it has."""
        parts = [f"{self._where(g, short=True)} {gib(g.total)}/{gib(g.usable)} GiB" for g in self.groups if g.usable < UNLIMITED]
        tightest = max((g for g in self.groups if g.usable < UNLIMITED), key=lambda g: g.load, default=None)
        line = ("fits: " if self.fits else "does not fit: ") + ", ".join(parts or ["nothing limited"])
        if tightest is not None:
            line += f"; tightest: {'/'.join(tightest.roles)} {tightest.binding}"
        if self.unjudged:
            line += f"; GPU memory unknown for {', '.join(self.unjudged)} (name the GPU in nodeSelector nvidia.com/gpu.product)"
        return line

    def message(self) -> str:
        """Why it does not fit, row by row, and which layouts would fit this node."""
        lines = []
        for group in self.groups:
            if group.fits:
                continue
            rows = ", ".join(f"{k} {gib(v)}" for k, v in sorted(group.counted().items(), key=lambda kv: -kv[1]) if v)
            share = " (vLLM's gpu_memory_utilization of each GPU)" if group.gpus and "rollout" in group.roles else ""
            lines.append(f"{self._where(group)} needs {gib(group.total)} GiB of {gib(group.usable)} GiB{share} ({rows})")
        others = []
        for name, layout in self.plan.layouts.items():
            if layout.applicable and layout.fits and layout.groups and name != "full_finetune":
                tight = layout.tightest
                what = {"separate": f"separate copies split {layout.split}",
                        "shared": "one shared copy (placement: colocated)"}[name]  # fmt: skip
                others.append(f"{what} would fit ({gib(tight.total)} of {gib(tight.usable)} GiB on its fullest GPU)")
        if others and not self.plan.node.is_cpu:
            lines.append(f"on {self.plan.node.name}: " + "; ".join(others))
        return "; ".join(lines)


def fit_job(arch: Architecture, request: PlanRequest) -> JobFit:
    """The job's own pod (REQUEST.roles) on its node; PlanError if the request names no roles."""
    if request.roles is None:
        raise PlanError("the plan request names no pod roles (resources); use make_plan for a layout suggestion")
    plan = make_plan(arch, request)
    node, base = plan.node, plan.base
    roles = {name: request.roles.get(name, RoleBudget()) for name in ("rollout", "learner", "reference")}
    groups, unjudged = [], []

    def limit(name: str) -> int:
        return roles[name].memory_bytes or UNLIMITED

    def place(name: str, gpus: int, gpu_rows: dict[str, int] | None, cpu_rows: dict[str, int]) -> None:
        if gpus == 0:
            groups.append(GpuGroup((name,), 0, cpu_rows, limit(name)))
            return
        if node.gpu_memory_known:
            usable = rollout_usable(node, request) if name == "rollout" else node.usable_bytes
            groups.append(GpuGroup((name,), gpus, gpu_rows, usable))  # type: ignore[arg-type]
        else:
            unjudged.append(name)
        groups.append(GpuGroup((name,), 0, {"host_memory": host_bytes(name, base, request)}, limit(name)))

    rollout = roles["rollout"].gpus
    tp = min(request.tensor_parallel_size, rollout) if rollout else 1
    rollout_request = request.model_copy(update={"tensor_parallel_size": tp})
    place("rollout", tp if rollout else 0, rollout_rows(arch, base, rollout_request, tp) if rollout else None,
          rollout_rows(arch, base, request, 1, cpu=True))  # fmt: skip
    learner = roles["learner"].gpus
    shards = learner if request.learner_sharded and learner else 1
    learner_cpu = learner_rows(arch, base, request, cpu=True)
    if request.placement == "colocated":  # the rollout container holds the only copy; the learner maps it
        learner_cpu = {**learner_cpu, "base_int4": 0, "base_16bit": 0}
    place("learner", shards if learner else 0, learner_rows(arch, base, request, shards) if learner else None,
          learner_cpu)  # fmt: skip
    if request.reference_mode == "server":
        reference = roles["reference"].gpus
        place("reference", 1 if reference else 0, reference_rows(arch, base, request) if reference else None,
              reference_rows(arch, base, request, cpu=True))  # fmt: skip
    return JobFit(all(g.fits for g in groups), groups, plan, unjudged)
