"""The read path of the emulated API server: lists (with selectors), kubectl's Table responses and
watch streams replayed from the event log. A mixin of EmulatorHandler."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import time
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp.web
import kmock

from .api_semantics import _age, _error, _field, _jsonpath, _parse_selector


class ReadPath:
    """Lists, tables and watches (EmulatorHandler's ``_objects``, ``_log`` and ``_columns``)."""

    def _matcher(self, request: kmock.Request, namespace: str | None) -> Callable[[Mapping[str, Any]], bool]:
        try:
            labels = _parse_selector(request.params.get("labelSelector"))
            fields = _parse_selector(request.params.get("fieldSelector"))
        except ValueError as e:
            raise _error(400, "BadRequest", str(e)) from None
        name = request.name

        def matches(obj: Mapping[str, Any]) -> bool:
            meta = obj.get("metadata", {})
            if namespace is not None and meta.get("namespace") != namespace:
                return False
            if name is not None and meta.get("name") != name:
                return False
            obj_labels = meta.get("labels") or {}
            return all(term(obj_labels.get) for term in labels) and all(term(lambda k: _field(obj, k)) for term in fields)

        return matches

    async def _list(self, request: kmock.Request, res: kmock.resource, namespace: str | None) -> aiohttp.web.StreamResponse:
        matches = self._matcher(request, namespace)
        async with self._lock:
            items = [
                copy.deepcopy(obj.raw)
                for (r, _, _), obj in self._objects.items()
                if r == res and not obj.deleted and matches(obj.raw)
            ]
        items.sort(key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"]["name"]))
        return self._respond_objects(request, res, items, single=False)

    def _respond_objects(
        self, request: kmock.Request, res: kmock.resource, items: list[dict[str, Any]], single: bool
    ) -> aiohttp.web.StreamResponse:
        if "as=Table" in request.headers.get("Accept", ""):
            return aiohttp.web.json_response(self._table(request, res, items))
        if single:
            return aiohttp.web.json_response(items[0])
        kind = self.resources[res].kind or res.plural.capitalize()
        return aiohttp.web.json_response(
            {
                "apiVersion": self._api_version(res),
                "kind": f"{kind}List",
                "metadata": {"resourceVersion": str(self._rv)},
                "items": items,
            }
        )

    def _table(self, request: kmock.Request, res: kmock.resource, items: list[dict[str, Any]]) -> dict[str, Any]:
        columns = self._columns.get(res) or [{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
        include = request.params.get("includeObject", "Metadata")

        def cell(column: Mapping[str, Any], obj: Mapping[str, Any]) -> Any:
            value = _jsonpath(obj, column["jsonPath"])
            return _age(value) if column.get("type") == "date" and isinstance(value, str) else value

        def row(obj: dict[str, Any]) -> dict[str, Any]:
            result: dict[str, Any] = {"cells": [obj["metadata"]["name"]] + [cell(c, obj) for c in columns]}
            if include == "Object":
                result["object"] = obj
            elif include != "None":
                result["object"] = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj["metadata"]}
            return result

        return {
            "kind": "Table",
            "apiVersion": "meta.k8s.io/v1",
            "metadata": {"resourceVersion": str(self._rv)},
            "columnDefinitions": [
                {
                    "name": "Name",
                    "type": "string",
                    "format": "name",
                    "priority": 0,
                    "description": "Name must be unique within a namespace.",
                }
            ]
            + [
                {
                    "name": c["name"],
                    "type": c.get("type", "string"),
                    "format": c.get("format", ""),
                    "description": c.get("description", ""),
                    "priority": c.get("priority", 0),
                }
                for c in columns
            ],
            "rows": [row(obj) for obj in items],
        }

    async def _watch(self, request: kmock.Request, res: kmock.resource, namespace: str | None) -> aiohttp.web.StreamResponse:
        matches = self._matcher(request, namespace)
        since_param = request.params.get("resourceVersion") or "0"
        timeout = float(request.params["timeoutSeconds"]) if request.params.get("timeoutSeconds") else None
        as_table = "as=Table" in request.headers.get("Accept", "")
        try:
            since = int(since_param)
        except ValueError:
            raise _error(400, "BadRequest", f"invalid resourceVersion {since_param!r}") from None
        bus = self._buses[res]
        async with self._lock:
            marker = await bus.mark()  # under the lock: no event can slip between the replay and the stream
            if since == 0:  # "any": the current state as ADDED, then the changes
                initial = [
                    {"type": "ADDED", "object": copy.deepcopy(obj.raw)}
                    for (r, _, _), obj in self._objects.items()
                    if r == res and not obj.deleted
                ]
            elif self._log and len(self._log) == self._log.maxlen and self._log[0][0] > since + 1:
                initial = [
                    {
                        "type": "ERROR",
                        "object": {
                            "apiVersion": "v1",
                            "kind": "Status",
                            "status": "Failure",
                            "code": 410,
                            "reason": "Expired",
                            "message": f"too old resource version: {since}",
                            "metadata": {},
                        },
                    }
                ]
            else:
                initial = [event for rv, r, event in self._log if r == res and rv > since]
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        assert request._raw_request is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        stream = bus.stream(since=marker)
        raw_request = request._raw_request
        pending: asyncio.Future[dict[str, Any]] | None = None
        try:
            await response.prepare(raw_request)

            async def send(event: dict[str, Any]) -> None:
                obj = event["object"]
                if event["type"] != "ERROR" and not matches(obj):
                    return
                if as_table and event["type"] != "ERROR":
                    event = {"type": event["type"], "object": self._table(request, res, [obj])}
                await response.write(json.dumps(event).encode() + b"\n")

            for event in initial:
                await send(event)
            # Wait for events in slices, to notice a gone client (aiohttp does not cancel handlers on
            # disconnects) and the timeoutSeconds deadline; never cancel a pending anext(): it ends the stream.
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(anext(stream))
                slice_s = 1.0 if deadline is None else min(1.0, max(0.0, deadline - time.monotonic()))
                done, _ = await asyncio.wait({pending}, timeout=slice_s)
                if done:
                    event, pending = pending.result(), None
                    await send(event)
                elif deadline is not None and time.monotonic() >= deadline:
                    break
                elif raw_request.transport is None or raw_request.transport.is_closing():
                    break
        except ConnectionError:
            pass
        finally:
            if pending is not None:
                pending.cancel()
                with contextlib.suppress(BaseException):
                    await pending
            with contextlib.suppress(Exception):
                await stream.aclose()
            with contextlib.suppress(Exception):
                await bus.unmark(marker)
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
        return response
