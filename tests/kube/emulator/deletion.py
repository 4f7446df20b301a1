"""The deletion path of the emulated API server: finalizers, a node-bound pod's graceful
deletion, and garbage collection of dependents (background propagation). A mixin of
EmulatorHandler (its ``_objects``, ``_emit`` and ``_next_rv``)."""

from __future__ import annotations

import copy
import datetime
from collections.abc import Mapping
from typing import Any

import kmock

from .api_semantics import _now


class DeletePath:
    @classmethod
    def _grace_period(cls, request: kmock.Request, res: kmock.resource, obj: Mapping[str, Any]) -> int:
        body = request.data if isinstance(request.data, Mapping) else {}
        raw = request.params.get("gracePeriodSeconds", body.get("gracePeriodSeconds"))
        return cls._grace_period_of(res, obj, None if raw is None else int(raw))

    @staticmethod
    def _grace_period_of(res: kmock.resource, obj: Mapping[str, Any], requested: int | None) -> int:
        """A pod's graceful-deletion period: 0 unless a node runs it (``spec.nodeName``) and it has not
        finished; then the request's ``gracePeriodSeconds`` or the pod's ``terminationGracePeriodSeconds``."""
        running = (obj.get("spec") or {}).get("nodeName") and (obj.get("status") or {}).get("phase") not in (
            "Succeeded",
            "Failed",
        )
        if res != kmock.resource("", "v1", "pods") or not running:
            return 0
        if requested is not None:
            return max(0, requested)
        return int(obj["spec"].get("terminationGracePeriodSeconds", 30))

    async def _delete(self, res: kmock.resource, key: Any, old: dict[str, Any], grace_seconds: int = 0) -> dict[str, Any]:
        """Remove the object, or mark it (``deletionTimestamp``) while finalizers or a node's graceful
        shutdown of a pod (``grace_seconds`` > 0; the node deletes it again with 0 when its processes are
        gone, as a kubelet does) hold it."""
        meta = old["metadata"]
        if meta.get("deletionTimestamp") and not (grace_seconds == 0 and not meta.get("finalizers")):
            return old  # already being deleted, waiting for its finalizers or its node
        if grace_seconds > 0:
            new = copy.deepcopy(old)
            stamp = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=grace_seconds)
            new["metadata"].update(deletionTimestamp=stamp.strftime("%Y-%m-%dT%H:%M:%SZ"), deletionGracePeriodSeconds=grace_seconds,
                                   resourceVersion=self._next_rv())  # fmt: skip
            self._objects[key].history.append(new)
            await self._emit(res, "MODIFIED", new)
            return new
        if meta.get("finalizers"):
            new = copy.deepcopy(old)
            new["metadata"].update(
                deletionTimestamp=_now(),
                deletionGracePeriodSeconds=0,
                generation=meta.get("generation", 1) + 1,
                resourceVersion=self._next_rv(),
            )
            self._objects[key].history.append(new)
            await self._emit(res, "MODIFIED", new)
            return new
        return await self._remove(res, key, old)

    async def _remove(self, res: kmock.resource, key: Any, obj: dict[str, Any]) -> dict[str, Any]:
        final = copy.deepcopy(obj)
        final["metadata"]["resourceVersion"] = self._next_rv()
        self._objects[key].delete()
        if res == kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions"):
            self._unregister_crd(final)
        await self._emit(res, "DELETED", final)
        await self._collect_dependents(final["metadata"].get("uid"))
        return final

    async def _collect_dependents(self, uid: str | None) -> None:
        """Garbage collection, background propagation: delete every object whose owners are now all
        gone (a pod a node runs gets its graceful deletion, as the garbage collector's DELETE would)."""
        if not uid:
            return
        live = {obj.raw["metadata"].get("uid") for obj in self._objects.values() if not obj.deleted}
        for key, obj in list(self._objects.items()):
            owners = (
                {ref.get("uid") for ref in obj.raw.get("metadata", {}).get("ownerReferences") or []} if not obj.deleted else set()
            )
            if uid in owners and not owners & live:
                current = copy.deepcopy(obj.raw)
                await self._delete(key[0], key, current, self._grace_period_of(key[0], current, None))
