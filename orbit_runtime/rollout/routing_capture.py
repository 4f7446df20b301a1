"""Routed experts returned by vLLM's CPU build, in the field vLLM's GPU build fills.

vLLM 0.32 returns the experts its routers chose (`--enable-return-routed-experts`: each
completion carries `routed_experts`, base64 `.npy` [prompt + completion - 1, layers, k]) only
from its V2 model runner, which needs Triton with a CPU backend; the CPU build has neither,
and refuses the flag ("AuxOutput Connector requires Model Runner V2; set
VLLM_USE_V2_MODEL_RUNNER=1", then "Model Runner V2 requires Triton."). With
ORBIT_RETURN_ROUTED_EXPERTS=1, Orbit's vLLM plugin fills the same field on the CPU build:

- Orbit's CPU MoE blocks (`vllm_cpu_moe.py`) call `capture_fn(layer_id, expert_ids)` in
  their forward, the hook vLLM's own capturer binds (`RoutedExpertsCaptureSource`);
- the V1 CPU model runner's `execute_model` records, per request of the step, the rows of
  the positions it forwarded; `sample_tokens` hands each request that sampled a token the
  rows since its last emission as vLLM's `AuxRequestOutput`;
- the scheduler gets vLLM's own scheduler-side connector, which turns those into
  `EngineCoreOutput.routed_experts`; from there vLLM's output processor and OpenAI server
  return them unchanged.

Prefix caching must be off (the server turns it off): a cached prefix is never forwarded,
so its rows would be missing (vLLM's V2 runner keeps them in a block store; this does not).
A preempted request recomputes positions it already recorded; those rows are not recorded twice.
A gap (positions never forwarded) is logged and filled with the dtype's largest value, which is
no expert: the learner then counts that sample's routing as missing.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from orbit_runtime.rollout.server import ROUTING_ENV as ENV

log = logging.getLogger(__name__)


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


class RoutingRecorder:
    """One step's expert ids per forwarded token and layer: [max tokens, layers, k] (vLLM's capturer's shape)."""

    def __init__(self, max_tokens: int, num_layers: int, top_k: int, num_experts: int) -> None:
        self.buffer = torch.zeros((max_tokens, num_layers, top_k), dtype=torch.int32)
        # as vLLM returns them, except that the type's largest value is never an expert: it marks a gap
        self.dtype = np.uint8 if num_experts < 256 else np.uint16

    def capture(self, layer_id: int, ids: torch.Tensor) -> None:
        self.buffer[: ids.shape[0], layer_id] = ids


@dataclass
class _RequestRows:
    next_position: int  # the first position not recorded yet
    pending_start: int  # the first position not emitted yet
    pending: list[np.ndarray] = field(default_factory=list)


@dataclass
class StepRows:
    """What one step forwarded: per request, its first position and its rows."""

    request_ids: list[str]
    first_positions: np.ndarray
    query_start: np.ndarray
    rows: np.ndarray


class RequestRoutingLog:
    """Per request: rows recorded and not yet emitted (pure bookkeeping, no vLLM)."""

    def __init__(self, row_shape: tuple[int, int], dtype) -> None:
        self.requests: dict[str, _RequestRows] = {}
        self.row_shape, self.dtype = row_shape, dtype

    def record(self, step: StepRows) -> None:
        for index, request_id in enumerate(step.request_ids):
            start = int(step.first_positions[index])
            rows = step.rows[step.query_start[index] : step.query_start[index + 1]]
            state = self.requests.setdefault(request_id, _RequestRows(0, 0))  # a request's rows start at position 0
            skip = state.next_position - start  # > 0: recomputed after a preemption
            if skip < 0:  # rows of the type's largest value: the learner finds no expert there, counts the sample missing
                log.warning("request %s: positions %d..%d were never forwarded (prefix caching must be off for routed "
                            "experts on the CPU build); its routing is marked incomplete", request_id, state.next_position, start)
                state.pending.append(np.full((-skip, *self.row_shape), np.iinfo(self.dtype).max, dtype=self.dtype))
                skip = 0
            if skip < len(rows):
                state.pending.append(rows[skip:])
                state.next_position = start + len(rows)

    def emit(self, request_id: str) -> tuple[int, np.ndarray]:
        """(first position, rows) recorded since the last emission of REQUEST_ID."""
        state = self.requests[request_id]
        rows = np.concatenate(state.pending) if state.pending else np.zeros((0, *self.row_shape), dtype=self.dtype)
        start = state.pending_start
        state.pending, state.pending_start = [], state.next_position
        return start, rows

    def peek(self, request_id: str) -> tuple[int, np.ndarray] | None:
        state = self.requests.get(request_id)
        if state is None or not state.pending:
            return None
        return state.pending_start, np.concatenate(state.pending)

    def finish(self, request_ids) -> None:
        for request_id in request_ids:
            self.requests.pop(request_id, None)


def install() -> None:
    """Patch vLLM's V1 CPU model runner and its scheduler as the module docstring says (idempotent)."""
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector, AuxRequestOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    if getattr(CPUModelRunner, "_orbit_routing", False):
        return
    CPUModelRunner._orbit_routing = True
    scheduler_init = Scheduler.__init__

    def init_scheduler(self, *args, **kwargs):
        scheduler_init(self, *args, **kwargs)
        if self.aux_output_connector is None:
            self.aux_output_connector = AuxOutputSchedulerConnector()

    Scheduler.__init__ = init_scheduler
    load_model, execute_model, sample_tokens = CPUModelRunner.load_model, CPUModelRunner.execute_model, CPUModelRunner.sample_tokens

    def load(self, *args, **kwargs):
        load_model(self, *args, **kwargs)
        from orbit_runtime.rollout.vllm_cpu_moe import ExpertLinearsMoeBlock

        config = self.model_config.hf_text_config
        blocks = [m for m in self.model.modules() if isinstance(m, ExpertLinearsMoeBlock)]
        if not blocks:
            raise RuntimeError(f"{ENV}=1: the served model has no Orbit CPU MoE block to capture routing from")
        self._orbit_recorder = RoutingRecorder(self.scheduler_config.max_num_batched_tokens, config.num_hidden_layers,
                                               blocks[0].spec.top_k, blocks[0].spec.num_experts)  # fmt: skip
        self._orbit_log = RequestRoutingLog(tuple(self._orbit_recorder.buffer.shape[1:]), self._orbit_recorder.dtype)
        for block in blocks:
            block.capture_fn = partial(self._orbit_recorder.capture, block.layer_id)

    def execute(self, scheduler_output, *args, **kwargs):
        self._orbit_log.finish(scheduler_output.finished_req_ids)
        result = execute_model(self, scheduler_output, *args, **kwargs)
        tokens = scheduler_output.total_num_scheduled_tokens
        if tokens:
            count = self.input_batch.num_reqs
            recorder = self._orbit_recorder
            self._orbit_log.record(StepRows(
                list(self.input_batch.req_ids[:count]),
                self.input_batch.num_computed_tokens_cpu[:count].copy(),
                self.query_start_loc.np[: count + 1].copy(),
                recorder.buffer[:tokens].numpy().astype(recorder.dtype),
            ))  # fmt: skip
        if result is not None and hasattr(result, "sampled_token_ids"):
            attach(self, result)
        return result

    def sample(self, *args, **kwargs):
        output = sample_tokens(self, *args, **kwargs)
        attach(self, output)
        return output

    def attach(runner, output) -> None:
        """Give vLLM's scheduler the rows of every request in OUTPUT (emitted for those that sampled)."""
        if not output.req_ids:  # vLLM's shared empty output: nothing to attach, never mutate it
            return
        rows: dict[str, AuxRequestOutput] = {}
        for request_id in output.req_ids:
            index = output.req_id_to_index[request_id]
            sampled = index < len(output.sampled_token_ids) and len(output.sampled_token_ids[index]) > 0
            if request_id not in runner._orbit_log.requests:
                continue
            if sampled:
                rows[request_id] = AuxRequestOutput(*runner._orbit_log.emit(request_id))
            elif (pending := runner._orbit_log.peek(request_id)) is not None:
                rows[request_id] = AuxRequestOutput(*pending)
        output.aux_output_connector_output = rows

    CPUModelRunner.load_model = load
    CPUModelRunner.execute_model = execute
    CPUModelRunner.sample_tokens = sample
