"""The learner's side of the shared base: ask the rollout engine for it, map it read-only."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from orbit_runtime.shared_base.arena import Arena, MappedArena, digest, is_sealed, map_arena
from orbit_runtime.shared_base.transport import ArenaReceiver, TransportError

SHARE_METHOD = "orbit_share_base"  # OrbitWorkerExtension's method


@dataclass
class AttachedBase:
    """The engine's base as this process maps it. META: what the engine said about it (pid,
    inode, kernel, isa_hint, dtype, bytes)."""

    arena: Arena
    mapped: MappedArena
    meta: dict

    @property
    def tensors(self):
        return self.mapped.tensors

    def digest(self) -> str:
        return digest(self.mapped.tensors)

    def close(self) -> None:
        """Close the descriptor; the pages stay mapped while any tensor views them."""
        self.arena.close()


def attach_shared_base(client, timeout_s: float = 300.0) -> AttachedBase:
    """Have the engine behind CLIENT (a RolloutClient) send its arena; map and check it."""
    receiver = ArenaReceiver()
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="share-base") as pool:
            rpc = pool.submit(client.collective_rpc, SHARE_METHOD, receiver.path, timeout_s=timeout_s)
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    arena, meta = receiver.receive(timeout_s=1.0)
                    break
                except TransportError:
                    if rpc.done():
                        rpc.result()  # the engine's error, if it failed
                        raise TransportError("the rollout engine answered but never sent its shared base") from None
                    if time.monotonic() > deadline:
                        raise
            try:
                results = rpc.result()
            except BaseException:
                arena.close()
                raise
    finally:
        receiver.close()
    if len(results) != 1:
        arena.close()
        raise TransportError(f"the colocated base needs one vLLM worker (tensor_parallel_size 1); {len(results)} answered")
    if results[0].get("inode") != arena.inode or not is_sealed(arena.fd):
        arena.close()
        raise TransportError("the memory file received is not the one the engine shared, or is not sealed")
    return AttachedBase(arena, map_arena(arena), meta)
