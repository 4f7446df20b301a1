"""A plan for people (a table of GiB per GPU) and for programs (`orbit plan --json`)."""

from __future__ import annotations

from orbit_runtime.config.learner import LOGPROB_CHUNK_TOKENS
from orbit_runtime.plan.activations import micro_batch, update_memory
from orbit_runtime.plan.hardware import USABLE_SHARE, gib
from orbit_runtime.plan.layouts import GpuGroup, LayoutPlan
from orbit_runtime.plan.planner import LAYOUTS, Plan

ROW_ORDER = ("base_int4", "base_16bit", "lora", "activations", "logits", "kv_cache", "rollout_activations", "weights",
             "gradients", "optimizer_state", "rollout_weights", "runtime", "host_memory")  # fmt: skip
ROW_LABELS = {
    "base_int4": "base INT4", "base_16bit": "base 16-bit", "lora": "LoRA state", "activations": "activations",
    "logits": "logits", "kv_cache": "KV cache", "rollout_activations": "vLLM scratch", "weights": "weights bf16",
    "gradients": "gradients", "optimizer_state": "fp32+AdamW", "rollout_weights": "vLLM copy", "runtime": "runtime",
    "host_memory": "host load",
}  # fmt: skip


def _group_json(group: GpuGroup) -> dict:
    return {"roles": list(group.roles), "gpus": group.gpus, "per_gpu_bytes": dict(group.rows), "peak_bytes": group.total,
            "usable_bytes": group.usable, "fits": group.fits, "binding": group.binding,
            "takes_turns": {k: list(v) for k, v in group.phases.items()}}  # fmt: skip


def layout_json(layout: LayoutPlan) -> dict:
    out: dict = {"fits": layout.fits, "binding": layout.binding, "split": layout.split, "notes": layout.notes,
                 "applicable": layout.applicable}  # fmt: skip
    if layout.groups and layout.applicable:
        tight = layout.tightest
        out.update(binding_roles=list(tight.roles), per_gpu_bytes=tight.counted(), total_bytes=tight.total,
                   usable_bytes=tight.usable, groups=[_group_json(g) for g in layout.groups])  # fmt: skip
    else:
        out.update(per_gpu_bytes={}, total_bytes=0, usable_bytes=0, groups=[])
    if layout.host:
        out["host_bytes"] = layout.host
    return out


def plan_json(plan: Plan) -> dict:
    """The JSON `orbit plan --json` prints (keys documented in docs/plan.md)."""
    arch, params, node, request = plan.arch, plan.params, plan.node, plan.request
    int4, dense = plan.base.on_gpu(1, "bf16" if arch.dtype in ("bfloat16", "bf16") else "fp16", plan.quantization.scale_dtype)
    update = update_memory(arch, request)
    mb = micro_batch(request)
    doc = {
        "model": {"source": arch.source, "model_type": arch.model_type, "architecture": arch.architecture, "layers": arch.layers,
                  "hidden_size": arch.hidden, "vocab_size": arch.vocab, "attention": arch.attention.kind,
                  "experts": arch.moe.experts if arch.moe else 0, "experts_per_token": arch.moe.top_k if arch.moe else 0},
        "total_params": params.total,
        "active_params": params.active,
        "active_params_without_input_embedding": params.active_without_input_embedding,
        "mtp_params": params.mtp,
        "params_by_group": params.groups(),
        "quantization": {"group_size": plan.quantization.group_size, "scale_dtype": plan.quantization.scale_dtype,
                         "ignore": list(plan.quantization.ignore), "source": plan.quantization.source,
                         "int4_params": plan.base.int4_params, "16bit_params": plan.base.dense_params},
        "checkpoint_bytes": int4 + dense,
        "lora_params": plan.lora_params,
        "adapter": plan.adapter,
        "node": {"name": node.name, "gpus": node.gpus, "gpu_memory_bytes": node.visible_bytes, "usable_bytes_per_gpu": node.usable_bytes,
                 "usable_share": USABLE_SHARE},
        "job": request.model_dump(mode="json", exclude={"node", "roles"}),
        "micro_batch": {"sequences": mb.rows, "padded_tokens": mb.tokens, "activations_with_checkpointing_bytes":
                        update.activations_with_checkpointing, "activations_without_checkpointing_bytes":
                        update.activations_without_checkpointing, "logits_bytes": update.logits,
                        "logits_unchunked_bytes": update.logits_unchunked},
        **{name: layout_json(plan.layouts[name]) for name in LAYOUTS},
        "recommended": plan.recommended,
        "recommended_placement": {"separate": "separate", "shared": "colocated"}.get(plan.recommended or ""),
    }  # fmt: skip
    doc["full_finetune"]["nodes"] = plan.layouts["full_finetune"].nodes
    doc["full_finetune"]["nodes_bf16_state"] = plan.nodes_bf16_state
    return doc


def _columns(plan: Plan) -> list[tuple[str, LayoutPlan, GpuGroup]]:
    out = []
    for name in LAYOUTS:
        layout = plan.layouts[name]
        if not layout.applicable:
            continue
        for group in layout.groups:
            who = {"full_finetune": "1 node", "shared": "all"}.get(name, "/".join(group.roles))
            count = f" x{group.gpus}" if group.gpus else " (host)"
            out.append((f"{name}\n{who}{count}", layout, group))
    return out


def render(plan: Plan, console) -> None:
    """Print the plan as a table (GiB per GPU) with a verdict per layout."""
    from rich.table import Table

    arch, params, q, r = plan.arch, plan.params, plan.quantization, plan.request
    moe = f", {arch.moe.experts} experts ({arch.moe.top_k} a token)" if arch.moe else ""
    console.print(f"[bold]{arch.architecture}[/] ({arch.source}): {params.total / 1e9:,.1f}B parameters, "
                  f"{params.active / 1e9:,.1f}B active a token{moe}" + (f"; MTP layers {params.mtp / 1e9:.1f}B (not loaded)" if params.mtp else ""))  # fmt: skip
    console.print(f"INT4 group {q.group_size} ({q.source}): {plan.base.int4_params / 1e9:,.1f}B parameters in INT4, "
                  f"{plan.base.dense_params / 1e9:,.1f}B 16-bit; LoRA rank {r.rank}: {plan.lora_params / 1e6:,.1f}M parameters")  # fmt: skip
    a = plan.adapter
    routed = f", {a['routed_expert_params'] / a['params']:.1%} of them on routed experts" if a["routed_expert_params"] else ""
    console.print(f"adapter: {a['params'] / 1e6:,.1f}M parameters{routed}; learner fp32 {gib(a['learner_fp32_bytes'])} GiB + "
                  f"AdamW {gib(a['optimizer_bytes'])} GiB; each sync writes {gib(a['sync_bytes_per_step'])} GiB ({r.dtype})")  # fmt: skip
    mb = micro_batch(r)
    console.print(f"job: {r.prompts} prompts x {r.group} = {r.samples} samples of {r.prompt_tokens} + {r.completion_tokens} tokens; "
                  f"micro-batch {mb.rows} sequences ({mb.tokens:,} tokens), gradient checkpointing "
                  f"{'on' if r.gradient_checkpointing else 'off'}, learner {r.learner_dtype}, vLLM {r.dtype}, reference {r.reference_mode}")  # fmt: skip
    console.print(f"node: {plan.node.name}, {gib(plan.node.usable_bytes)} GiB usable a GPU ({USABLE_SHARE:.0%} of "
                  f"{gib(plan.node.visible_bytes)} GiB)")  # fmt: skip
    columns = _columns(plan)
    table = Table(title="GiB per GPU (rows in parentheses take turns with others: not in the peak)")
    table.add_column("row")
    for header, _, _ in columns:
        table.add_column(header, justify="right")
    present = [row for row in ROW_ORDER if any(group.rows.get(row) for _, _, group in columns)]
    for row in present:
        cells = []
        for _, _, group in columns:
            value = group.rows.get(row)
            counted = row in group.counted()
            cells.append(gib(value) if counted else (f"({gib(value)})" if value else ""))
        table.add_row(ROW_LABELS[row], *cells)
    table.add_row("[bold]peak[/]", *[f"[bold]{gib(g.total)}[/]" for _, _, g in columns])
    table.add_row("usable", *[gib(g.usable) for _, _, g in columns])
    table.add_row("fits", *[("yes" if g.fits else f"[red]no: {g.binding}[/]") for _, _, g in columns])
    console.print(table)
    update = update_memory(plan.arch, r)
    console.print(f"the learner's micro-batch on one device: activations {gib(update.activations_with_checkpointing)} GiB with "
                  f"gradient checkpointing, {gib(update.activations_without_checkpointing)} GiB without; logits "
                  f"{gib(update.logits)} GiB (the log-softmax in chunks of {LOGPROB_CHUNK_TOKENS:,} tokens; "
                  f"{gib(update.logits_unchunked)} GiB over all tokens at once)")  # fmt: skip
    for name in LAYOUTS:
        layout = plan.layouts[name]
        verdict = "fits" if layout.fits else f"does not fit (binding: {layout.binding})"
        extra = ""
        if name == "full_finetune":
            nodes = "more than 256" if layout.nodes is None else str(layout.nodes)
            extra = (f"; needs {nodes} node(s) of this kind ({plan.nodes_bf16_state or 'more than 256'} with bf16 AdamW moments "
                     "and no fp32 master)")  # fmt: skip
        elif layout.split:
            extra = f"; split {layout.split}"
        console.print(f"[bold]{name}[/]: {verdict}{extra}")
        for note in layout.notes:
            console.print(f"  - {note}")
        if layout.host:
            console.print("  - host memory to load: " + ", ".join(f"{k} {gib(v)} GiB" for k, v in layout.host.items()))
    placement = {"separate": "placement: separate", "shared": "placement: colocated"}.get(plan.recommended or "")
    if plan.recommended == "shared" and not plan.node.is_cpu:
        placement += "; Orbit runs it on CPU only so far"
    console.print(f"recommended: {plan.recommended or 'no layout fits this node'}" + (f" ({placement})" if placement else ""))
