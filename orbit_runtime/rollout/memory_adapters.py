"""Adapter versions handed to vLLM in memory (placement colocated): no files between learner and engine.

Runs inside a vLLM worker. The learner stages each version's LoRA tensors (PEFT names and
config, the same content `save_pretrained` writes) through a sealed arena
(`orbit_stage_adapter`); the tensors are copied into the worker's memory and the arena is
closed. Then the learner loads the version through vLLM's own `/v1/load_lora_adapter` under
its fresh name with the path `MEMORY_PREFIX + name`: the worker's LoRA loader, wrapped
here, builds the `LoRAModel` from the staged tensors with vLLM's `from_lora_tensors` (what
`from_local_checkpoint` does after reading the files) and vLLM copies it into its LoRA
slots as for any adapter. Any other path loads from disk as before.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from orbit_runtime.shared_base.arena import Arena, map_arena, memcpy_clone

MEMORY_PREFIX = "/orbit-memory/"  # absolute, so vLLM never takes it for a Hugging Face repo id
MAX_STAGED = 16  # a bound on versions staged and never unstaged (a learner that died mid-sync); unloads unstage


class MemoryAdapters:
    """The staged versions of one worker, and the hook that lets its LoRA manager load them."""

    def __init__(self, lora_manager) -> None:
        self.staged: OrderedDict[str, tuple[dict[str, torch.Tensor], dict]] = OrderedDict()
        self.manager = lora_manager
        original = lora_manager._load_adapter

        def load(lora_request):
            if str(lora_request.lora_path).startswith(MEMORY_PREFIX):
                return self._load(lora_request)
            return original(lora_request)

        lora_manager._load_adapter = load

    def stage(self, name: str, arena: Arena, config: dict) -> int:
        """Copy the arena's tensors into this worker's memory (the arena is closed after)."""
        tensors = {k: memcpy_clone(v) for k, v in map_arena(arena).tensors.items()}
        self.staged[name] = (tensors, config)
        self.staged.move_to_end(name)
        while len(self.staged) > MAX_STAGED:
            self.staged.popitem(last=False)
        return len(tensors)

    def unstage(self, name: str) -> bool:
        return self.staged.pop(name, None) is not None

    def _load(self, lora_request):
        from vllm.lora.peft_helper import PEFTHelper

        manager = self.manager
        name = str(lora_request.lora_path).removeprefix(MEMORY_PREFIX)
        if name not in self.staged:
            raise FileNotFoundError(f"adapter {name!r} was not staged in memory (orbit_stage_adapter)")
        staged, config = self.staged[name]
        # a copy per load: vLLM scales LoRA weights in place (optimize()), and may load a name again
        tensors = {k: memcpy_clone(v) for k, v in staged.items()}
        peft_helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": manager.max_position_embeddings})
        peft_helper.validate_legal(manager.lora_config)
        adapters = manager._adapter_manager
        model = adapters.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        mapper = mapper.get_rename_mapper() if mapper is not None else None
        _check_modules(tensors, adapters, mapper, name)
        lora = manager._lora_model_cls.from_lora_tensors(
            lora_model_id=lora_request.lora_int_id,
            tensors=tensors,
            peft_helper=peft_helper,
            device="cpu",
            dtype=manager.lora_config.lora_dtype,
            model_vocab_size=manager.vocab_size,
            weights_mapper=mapper,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )
        # the checks vLLM's own loader runs after reading an adapter from disk
        lora.is_3d_lora_weight = lora_request.is_3d_lora_weight
        adapters._validate_moe_lora_format(lora)
        adapters._validate_modules_to_save(lora)
        adapters._validate_token_classification_lora(lora)
        return lora


def _check_modules(tensors: dict, adapters, mapper, name: str) -> None:
    """Refuse tensors for modules vLLM's model has no LoRA for (its file loader does the same)."""
    from vllm.lora.utils import parse_fine_tuned_lora_name

    expected = set()
    for module in adapters.supported_lora_modules:
        expected |= set(adapters.packed_modules_mapping.get(module, [module]))
    modules = sorted({parse_fine_tuned_lora_name(k, mapper)[0] for k in tensors})
    unexpected = [m for m in modules if m.rsplit(".", 1)[-1] not in expected]
    if unexpected:
        raise ValueError(f"adapter {name!r}: LoRA for modules vLLM's model does not support: {unexpected[:5]}")
