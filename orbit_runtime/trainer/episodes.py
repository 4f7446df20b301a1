"""Multi-turn episodes: the model and an environment take turns; every token is kept as an id.

An episode's sample for the learner is (prompt ids, everything after them): the model's turns
exactly as vLLM generated them, with their rollout log-probs, and the environment's turns as
the chat template tokenizes them (`environments.chat_tokens`), masked out of the loss. So the
learner recomputes the log-prob of every model token on the very sequence the rollout saw, and
the mismatch metrics, TIS/MIS and the on-policy gate apply as in single-turn runs.

Many episodes are in flight at once (`environment.concurrency` threads, each one episode at a
time): vLLM batches the turns of all of them, and one episode's environment step never holds
up another's generation. An episode ends when the environment says so, or is truncated (its
finish_reason is "length", and `rollout.truncated` applies) after `max_turns` model turns, at
`max_tokens`, when a turn is cut at rollout.max_tokens, or when the environment raises. An
episode whose environment raised scores 0 and is left out of the loss (its tokens say nothing
about the policy).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from orbit_runtime.config.environment import EnvironmentSpec
from orbit_runtime.data.datasets import Example
from orbit_runtime.environments.base import Environment, EpisodeState, Message
from orbit_runtime.environments.chat_tokens import ChatTokens
from orbit_runtime.errors import OrbitError
from orbit_runtime.observability import environment_metrics as em
from orbit_runtime.rollout.client import Completion

log = logging.getLogger(__name__)

# generate_turn(prompt ids, max tokens, seed) -> the turn's completion (one vLLM request)
GenerateTurn = Callable[[list[int], int, "int | None"], Completion]


class EnvironmentFailed(OrbitError):
    """The environment raised on more than half of a step's episodes."""


@dataclass
class Episode:
    """One finished episode: the learner's sample (COMPLETION, with its token mask) and its conversation."""

    completion: Completion
    messages: list[Message]
    answer: str  # the model's last turn, as text: what `rewards` score
    environment_reward: float | None
    turns: int
    ending: str  # one of environment_metrics.EPISODE_ENDINGS
    environment_seconds: float = 0.0

    @property
    def model_tokens(self) -> int:
        """Tokens the model generated (the environment's are not counted)."""
        return sum(self.completion.token_mask or [])


def turn_seed(seed: int | None, member: int, turn: int) -> int | None:
    """The vLLM seed of turn TURN of episode MEMBER of a group whose prompt seed is SEED (None: unseeded)."""
    if seed is None:
        return None
    return int.from_bytes(hashlib.sha256(f"{seed}:{member}:{turn}".encode()).digest()[:4], "big") >> 1


class EpisodeRunner:
    """Runs groups of episodes of one environment against the rollout engine."""

    def __init__(self, environment: Environment, tokenizer, spec: EnvironmentSpec, *, turn_max_tokens: int,
                 max_model_len: int) -> None:  # fmt: skip
        self.environment = environment
        self.tokenizer = tokenizer
        self.chat = ChatTokens(tokenizer)
        self.spec = spec
        self.turn_max_tokens = turn_max_tokens
        self.max_model_len = max_model_len

    def run(self, generate: GenerateTurn, examples: list[Example], group: int, seeds: list[int] | None) -> list[Episode]:
        """GROUP episodes per example, prompt-major (as single-turn groups are), SEEDS[i] seeding example i's."""
        jobs = [(example, member, seeds[i] if seeds is not None else None)
                for i, example in enumerate(examples) for member in range(group)]  # fmt: skip
        cancel = threading.Event()
        pool = ThreadPoolExecutor(max_workers=min(len(jobs), self.spec.concurrency), thread_name_prefix="episode")
        try:
            futures = [pool.submit(self.episode, generate, example, member, seed, cancel) for example, member, seed in jobs]
            episodes = [f.result() for f in futures]
        finally:  # a failed request fails the batch: the others stop at their next turn (the engine may be restarting)
            cancel.set()
            pool.shutdown(wait=False, cancel_futures=True)
        failed = sum(e.ending == "env_error" for e in episodes)
        if failed * 2 > len(episodes):
            raise EnvironmentFailed(f"the environment raised on {failed} of {len(episodes)} episodes (see the warnings above)")
        return episodes

    def episode(self, generate: GenerateTurn, example: Example, member: int, seed: int | None,
                cancel: threading.Event | None = None) -> Episode:  # fmt: skip
        """One episode: alternate model turns (one request each) and environment steps."""
        env = self.environment
        try:
            state = env.reset(example)
            tools = env.tools(example)
            prompt = self.chat.opening(state.messages, tools)
        except Exception as exc:  # noqa: BLE001 - one bad example must not stop the run
            _environment_error("reset", example, 0, exc)
            messages = [{"role": "user", "content": example.prompt}]
            prompt = self.chat.opening(messages, None)  # a valid sample for the batch; env_error keeps it out of the loss
            return self._finish(EpisodeState(example, messages), prompt, [], [], [], "", "env_error", 0, 0.0, score=False)
        ids: list[int] = []
        logprobs: list[float] = []
        mask: list[bool] = []
        answer, ending, turns, env_seconds = "", "max_turns", 0, 0.0
        while turns < self.spec.max_turns:
            if cancel is not None and cancel.is_set():
                raise EpisodeCancelled()
            budget = min(self.turn_max_tokens, self.spec.max_tokens - len(ids), self.max_model_len - len(prompt) - len(ids))
            if budget <= 0:
                ending = "max_tokens"
                break
            turn = generate(prompt + ids, budget, turn_seed(seed, member, turns))
            turns += 1
            ids += turn.token_ids
            logprobs += turn.logprobs
            mask += [True] * len(turn.token_ids)
            answer = self.tokenizer.decode(turn.token_ids, skip_special_tokens=True)
            message = {"role": "assistant", "content": answer}
            state.messages.append(message)  # a cut turn too: the transcript and the rubric see what was generated
            if turn.finish_reason == "length" or not turn.token_ids:
                ending = "max_tokens" if budget < self.turn_max_tokens else "turn_cut"
                break
            started = time.monotonic()
            try:
                reply = env.step(state, message)
                appended = [] if reply.done or turns >= self.spec.max_turns else self.chat.environment_turn(
                    reply.messages, tools, turn.token_ids)  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - an environment's bug must not stop the run
                _environment_error("step", example, turns, exc)
                ending = "env_error"
                break
            finally:
                env_seconds += time.monotonic() - started
                em.ENVIRONMENT_STEP_SECONDS.observe(time.monotonic() - started)
            if reply.reward is not None:
                state.data["reward"] = reply.reward
            if reply.done:
                ending = "done"
                break
            state.messages.extend(reply.messages)
            if turns >= self.spec.max_turns:
                break
            total = len(ids) + len(appended)  # the next turn needs room for at least one token
            if total >= self.spec.max_tokens or len(prompt) + total >= self.max_model_len:
                ending = "max_tokens"
                break
            ids += appended
            logprobs += [0.0] * len(appended)  # not the model's tokens: masked out of the loss and the mismatch
            mask += [False] * len(appended)
        return self._finish(state, prompt, ids, logprobs, mask, answer, ending, turns, env_seconds)

    def _finish(self, state: EpisodeState, prompt: list[int], ids: list[int], logprobs: list[float], mask: list[bool],
                answer: str, ending: str, turns: int, env_seconds: float, score: bool = True) -> Episode:  # fmt: skip
        """The episode's environment reward (its `score`), metrics, and the learner's sample."""
        reward = None
        if score and ending != "env_error":
            try:
                reward = self.environment.score(state)
            except Exception as exc:  # noqa: BLE001
                _environment_error("score", state.example, turns, exc)
                ending = "env_error"
        em.EPISODES.labels(ending).inc()
        em.EPISODE_TURNS.observe(turns)
        completion = Completion(prompt_ids=prompt, token_ids=ids, logprobs=logprobs,
                                finish_reason="stop" if ending == "done" else "length", token_mask=mask)  # fmt: skip
        return Episode(completion, state.messages, answer, reward, turns, ending, env_seconds)


class EpisodeCancelled(Exception):
    """The batch failed elsewhere (a request the engine did not answer): this episode stops."""


def _environment_error(where: str, example: Example, turn: int, exc: Exception) -> None:
    em.ENVIRONMENT_ERRORS.inc()
    log.warning("environment %s failed (prompt %r, turn %d): %s: %s", where, example.prompt[:60], turn, type(exc).__name__, exc)


def episode_runner(spec, tokenizer) -> EpisodeRunner | None:
    """The runner of a job SPEC (a JobSpec) with an environment section, else None (single-turn)."""
    if spec.environment is None:
        return None
    from orbit_runtime.environments.loading import load_environment

    return EpisodeRunner(load_environment(spec.environment, spec), tokenizer, spec.environment,
                         turn_max_tokens=spec.rollout.max_tokens, max_model_len=spec.rollout.max_model_len)  # fmt: skip
