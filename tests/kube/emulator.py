"""A Kubernetes API server emulator on a real loopback HTTP port, for ``kubectl`` and real kopf operators.

kmock 0.8's ``KubernetesEmulator`` (kopf's recommended API mock) keeps objects in memory, serves discovery
and watch streams, and lives in the test's own event loop. That is enough for in-process kopf tests, but a
real ``kopf run`` process or ``kubectl`` needs a server that behaves more like an API server. This module
runs a subclass of it (:class:`EmulatorHandler`) on ``127.0.0.1:<free port>`` in a background thread
(:class:`KubeEmulator`) and fills in what real clients rely on:

* server-populated ``uid``, ``resourceVersion`` (one global counter), ``creationTimestamp``, ``generation``
  (bumped when anything outside ``metadata``/``status`` changes), ``apiVersion``/``kind``; ``generateName``;
* the status subresource split: ``PATCH .../status`` changes only ``.status``; a patch of the main resource
  never changes ``.status``; status in a create is dropped (pods start as ``phase: Pending``);
* merge (RFC 7396), strategic-merge (treated as a merge patch) and JSON patches; a failed JSON-patch ``test``
  op is HTTP 422 (kopf's finalizer patches rely on it), a stale ``metadata.resourceVersion`` in a merge patch
  is 409; no-op patches bump nothing and emit no watch event (as a real server);
* DELETE of an object with finalizers sets ``deletionTimestamp`` and keeps it until the finalizers are gone
  (kmock does this; re-implemented here together with the rest of the write path);
* graceful pod deletion: DELETE of a pod a node runs (``spec.nodeName`` set, not finished) sets
  ``deletionTimestamp``/``deletionGracePeriodSeconds``; the node removes it with a second DELETE
  (``gracePeriodSeconds=0``) once its processes are gone (tests/e2e/node.py does);
* proper Status errors (``NotFound``, ``AlreadyExists``, ``Conflict``, ``Invalid``, ...); 404 for unknown
  resources; 405 for PUT and other unsupported verbs/subresources;
* List responses with ``apiVersion``/``kind``/``resourceVersion``; ``labelSelector`` and ``fieldSelector``
  (``=``, ``==``, ``!=``, ``in``, ``notin``, exists, ``!``) on lists and watches;
* watches that honour ``resourceVersion`` (replayed from an in-memory event log, so ``kubectl delete --wait``
  and kopf's list-then-watch see no gaps), ``timeoutSeconds``, and a JSON content type;
* ``Table`` responses (what ``kubectl get`` asks for), with a CRD's ``additionalPrinterColumns``;
* discovery: kmock's bundled built-in resources (``load_bundled()``), CRDs registered on create (either via
  :meth:`KubeEmulator.load_crd` or ``kubectl apply -f crd.yaml``); the core ``groupVersion`` is ``v1``
  (kmock renders ``/v1``); ``/api/v1/namespaces[/<name>]`` parse (kmock 0.8's path parser crashes on them:
  a strict-superset fix is installed into ``kmock._internal.parsing`` on import). Namespaces ``default``
  and ``kube-system`` exist from the start.

Not emulated: ownerReference garbage collection, namespace deletion cascades, PUT/replace, server-side apply,
schema validation/defaulting, admission, pod logs/exec, pagination (``limit`` is ignored), real kubelets
(use :meth:`KubeEmulator.set_pod_status`). Object endpoints are served by this module directly, so kmock DSL
reactions (``handler[...] << ...``) only apply to non-object paths (discovery, ``/version``, custom URLs).

Typical use (the ``kube`` fixture, see tests/kube/conftest.py, starts it with the Orbit CRD loaded)::

    def test_operator(kube, tmp_path):
        kube.kubectl("apply", "--validate=false", "-f", "examples/rljob-cpu.yaml")
        with kopf_operator(kube, "-m", "orbit_operator", log_path=tmp_path / "kopf.log"):
            job = kube.path(RLJOBS, "default", "quickstart-cpu")
            kube.wait_for(lambda: kube.get(job).get("status", {}).get("phase") == "Pending")
            pod = kube.wait_for(lambda: kube.list_pods("default"))[0]
            kube.set_pod_status("default", pod["metadata"]["name"], "Running")
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import datetime
import json
import os
import re
import secrets
import signal
import socket
import string
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import aiohttp.web
import attrs
import jsonpatch
import jsonpointer
import kmock
import pytest
import yaml
from kmock._internal import apps as _kmock_apps
from kmock._internal import parsing as _kmock_parsing

REPO_ROOT = Path(__file__).resolve().parents[2]
ORBIT_CRD = REPO_ROOT / "charts" / "orbit" / "crds" / "rltrainingjob.yaml"
RLJOBS = "orbit.dev/v1alpha1/rltrainingjobs"  # a resource key for KubeEmulator.path()

_T = TypeVar("_T")


# --- kmock 0.8's path parser crashes on /api/v1/namespaces and misreads /api/v1/namespaces/<name> -----------


def _install_namespace_path_fix() -> None:
    original = _kmock_parsing.parse_path
    if getattr(original, "_orbit_namespaces_fix", False):
        return

    def parse_path(path: str) -> _kmock_parsing.ParsedPath:
        parts = path.strip("/").split("/")
        if parts[:3] == ["api", "v1", "namespaces"] and (
            len(parts) <= 4 or (len(parts) == 5 and parts[4] in ("status", "finalize"))
        ):
            return _kmock_parsing.ParsedPath(
                group="",
                version="v1",
                plural="namespaces",
                namespace=None,
                name=parts[3] if len(parts) > 3 else None,
                subresource=parts[4] if len(parts) > 4 else None,
            )
        return original(path)

    parse_path._orbit_namespaces_fix = True  # type: ignore[attr-defined]
    _kmock_parsing.parse_path = parse_path


_install_namespace_path_fix()


# --- small pure helpers ----------------------------------------------------------------------------------------


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _error(code: int, reason: str, message: str, **details: Any) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=code, reason=reason, message=message, details=details or {"causes": []})


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7396 JSON merge patch: dicts merge recursively, ``null`` deletes, anything else replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge_patch(result.get(key), value)
    return result


_SELECTOR_TERM = re.compile(
    r"^\s*(?P<neg>!)?\s*(?P<key>[A-Za-z0-9_./-]+)\s*"
    r"(?:(?P<op>==|=|!=)\s*(?P<value>[A-Za-z0-9_./-]*)|\s+(?P<setop>in|notin)\s*\((?P<values>[^)]*)\))?\s*$"
)


def _parse_selector(selector: str | None) -> list[Callable[[Callable[[str], str | None]], bool]]:
    """Parse a label/field selector into predicates over a getter (key -> value or None); ValueError if bad."""
    terms: list[Callable[[Callable[[str], str | None]], bool]] = []
    for raw in re.split(r",(?![^()]*\))", selector or ""):
        if not raw.strip():
            continue
        m = _SELECTOR_TERM.match(raw)
        if m is None or (m["neg"] and (m["op"] or m["setop"])):
            raise ValueError(f"unable to parse requirement: {raw!r}")
        key, op, value = m["key"], m["op"] or m["setop"], m["value"]
        values = {v.strip() for v in (m["values"] or "").split(",")}
        if op in ("=", "=="):
            terms.append(lambda get, k=key, v=value: get(k) == v)
        elif op == "!=":
            terms.append(lambda get, k=key, v=value: get(k) != v)
        elif op == "in":
            terms.append(lambda get, k=key, vs=values: get(k) in vs)
        elif op == "notin":
            terms.append(lambda get, k=key, vs=values: get(k) not in vs)
        elif m["neg"]:
            terms.append(lambda get, k=key: get(k) is None)
        else:
            terms.append(lambda get, k=key: get(k) is not None)
    return terms


def _field(obj: Mapping[str, Any], dotted: str) -> str | None:
    value: Any = obj
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return None if value is None else str(value)


def _jsonpath(obj: Any, path: str) -> Any:
    """The simple JSONPaths of printer columns: ``.a.b``, ``.a[0].b``."""
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        if part.startswith("["):
            index = int(part[1:-1])
            obj = obj[index] if isinstance(obj, list) and len(obj) > index else None
        else:
            obj = obj.get(part) if isinstance(obj, Mapping) else None
    return obj


def _age(timestamp: str) -> str:
    then = datetime.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    seconds = max(0, int((datetime.datetime.now(datetime.UTC) - then).total_seconds()))
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 3 * 3600:
        return f"{seconds // 60}m"
    if seconds < 48 * 3600:
        return f"{seconds // 3600}h"
    return f"{seconds // 86400}d"


# --- the request handler (runs in the server thread's event loop) ----------------------------------------------


@attrs.define(kw_only=True)
class EmulatorHandler(kmock.KubernetesEmulator):
    """kmock's KubernetesEmulator with the write path, watches, lists and discovery of a real API server.

    Objects live in kmock's ``self.objects`` (with their version history: ``objects[res, ns, name].history``);
    read them from other threads only through HTTP (see :class:`KubeEmulator`), as the loop thread mutates them.
    """

    _rv: int = attrs.field(default=0, init=False)
    _log: collections.deque[tuple[int, kmock.resource, dict[str, Any]]] = attrs.field(
        factory=lambda: collections.deque(maxlen=100_000), init=False
    )
    _columns: dict[kmock.resource, list[dict[str, Any]]] = attrs.field(factory=dict, init=False)
    # every object request: (bearer token, verb, API group, resource, subresource or "", "namespaced" or
    # "cluster": whether the URL named a namespace), for RBAC checks
    calls: set[tuple[str, str, str, str, str, str]] = attrs.field(factory=set, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        with warnings.catch_warnings():  # kmock 0.8 uses the deprecated importlib.resources.read_binary
            warnings.simplefilter("ignore", DeprecationWarning)
            self.resources.load_bundled()
        for name in ("default", "kube-system"):
            obj = self._new_object(kmock.resource("", "v1", "namespaces"), {"metadata": {"name": name}}, None)
            self._objects[kmock.resource("", "v1", "namespaces"), None, name] = obj
            self._log.append(
                (
                    int(obj["metadata"]["resourceVersion"]),
                    kmock.resource("", "v1", "namespaces"),
                    {"type": "ADDED", "object": obj},
                )
            )

    # -- discovery --

    def _get_resources(self) -> list[kmock.resource]:
        # Only declared resources (bundled + CRDs + DSL filters), not whatever objects happen to exist.
        return kmock.KubernetesScaffold._get_resources(self)

    async def _serve_version(self, request: kmock.Request) -> dict[str, Any]:
        payload = await super()._serve_version(request)
        assert request.resource is not None
        group, version = request.resource.group, request.resource.version
        payload["groupVersion"] = version if group == "" else f"{group}/{version}"  # kmock says "/v1"
        for entry in payload["resources"]:
            if "/" in entry["name"]:  # kmock copies short names to subresources: kubectl warns of ambiguity
                entry.update(shortNames=[], categories=[], verbs=["get", "patch", "update"])
        return payload

    def register_crd(self, crd: Mapping[str, Any]) -> list[kmock.resource]:
        """Make a CRD's served versions discoverable (kind, short names, categories, subresources, columns)."""
        spec = crd["spec"]
        names = spec["names"]
        registered = []
        for version in spec.get("versions", []):
            if not version.get("served", True):
                continue
            res = kmock.resource(spec["group"], version["name"], names["plural"])
            self.resources[res] = kmock.ResourceInfo(
                kind=names["kind"],
                singular=names.get("singular") or names["kind"].lower(),
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                verbs={"create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"},
                shortnames=set(names.get("shortNames", [])),
                categories=set(names.get("categories", [])),
                subresources=set((version.get("subresources") or {}).keys()),
            )
            columns = version.get("additionalPrinterColumns")
            self._columns[res] = (
                list(columns) if columns else [{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
            )
            registered.append(res)
        return registered

    def _unregister_crd(self, crd: Mapping[str, Any]) -> None:
        spec = crd["spec"]
        for version in spec.get("versions", []):
            res = kmock.resource(spec["group"], version["name"], spec["names"]["plural"])
            if res in self.resources:
                del self.resources[res]
            self._columns.pop(res, None)

    # -- plumbing --

    def _api_version(self, res: kmock.resource) -> str:
        return res.version if res.group == "" else f"{res.group}/{res.version}"

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _current(self, key: tuple[kmock.resource, str | None, str]) -> dict[str, Any] | None:
        if key not in self._objects or self._objects[key].deleted:
            return None
        return copy.deepcopy(self._objects[key].raw)

    async def _emit(self, res: kmock.resource, type_: str, obj: dict[str, Any]) -> None:
        event = {"type": type_, "object": obj}
        self._log.append((int(obj["metadata"]["resourceVersion"]), res, event))
        await self._buses[res].put(event)

    def _new_object(self, res: kmock.resource, data: Mapping[str, Any], namespace: str | None) -> dict[str, Any]:
        info = self.resources[res]
        obj = copy.deepcopy(dict(data))
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise _error(422, "Invalid", "metadata.name or metadata.generateName is required")
            alphabet = string.ascii_lowercase + string.digits
            meta["name"] = meta["generateName"] + "".join(secrets.choice(alphabet) for _ in range(5))
        if namespace is not None:
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        for key in ("deletionTimestamp", "deletionGracePeriodSeconds"):
            meta.pop(key, None)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1, resourceVersion=self._next_rv())
        obj["apiVersion"] = self._api_version(res)
        obj["kind"] = info.kind or res.plural.capitalize()
        if "status" in info.subresources:
            obj.pop("status", None)
        if res == kmock.resource("", "v1", "pods"):
            obj["status"] = {"phase": "Pending", "qosClass": "BestEffort"}
        elif res == kmock.resource("", "v1", "namespaces"):
            obj["status"] = {"phase": "Active"}
        elif res == kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions"):
            obj["status"] = {
                "acceptedNames": obj["spec"]["names"],
                "storedVersions": [v["name"] for v in obj["spec"].get("versions", []) if v.get("storage")],
                "conditions": [
                    {"type": t, "status": "True", "lastTransitionTime": _now(), "reason": r}
                    for t, r in (("NamesAccepted", "NoConflicts"), ("Established", "InitialNamesAccepted"))
                ],
            }
        return obj

    # -- the request entry point for object endpoints --

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        res = request.resource
        if res is None or res.plural is None:  # discovery, /version, custom paths: kmock's DSL & fallbacks
            return await _kmock_apps.RawHandler._handle(self, request)
        res = kmock.resource(res.group, res.version, res.plural)
        self._record(request, res)
        if res not in self.resources:
            raise _error(404, "NotFound", "the server could not find the requested resource")
        info = self.resources[res]
        namespace = request.namespace if info.namespaced else None
        action = request.action
        if request.subresource is not None and request.subresource != "status":
            raise _error(405, "MethodNotAllowed", f"subresource {request.subresource!r} is not emulated")
        if request.subresource == "status" and "status" not in info.subresources:
            raise _error(404, "NotFound", "the server could not find the requested resource")

        if action == kmock.action.WATCH:
            return await self._watch(request, res, namespace)
        if action == kmock.action.LIST:
            return await self._list(request, res, namespace)
        if action is None or request.name is None and action != kmock.action.CREATE:
            raise _error(405, "MethodNotAllowed", f"{request.method.value} on {request.url.path} is not emulated")

        async with self._lock:
            if action == kmock.action.CREATE:
                obj = await self._create(request, res, namespace if info.namespaced else None)
                return aiohttp.web.json_response(obj, status=201)
            assert request.name is not None
            key = (res, namespace, request.name)
            current = self._current(key)
            if current is None:
                raise _error(
                    404,
                    "NotFound",
                    f'{res.plural}.{res.group or "core"} "{request.name}" not found',
                    name=request.name,
                    group=res.group,
                    kind=res.plural,
                )
            if action == kmock.action.FETCH:
                return self._respond_objects(request, res, [current], single=True)
            if action == kmock.action.UPDATE:
                obj = await self._patch(request, res, key, current)
            elif action == kmock.action.DELETE:
                obj = await self._delete(res, key, current, self._grace_period(request, res, current))
            else:
                raise _error(405, "MethodNotAllowed", f"{action} is not emulated")
            return aiohttp.web.json_response(obj)

    def _record(self, request: kmock.Request, res: kmock.resource) -> None:
        """Note the RBAC verb this request needs, per client (its bearer token)."""
        verbs = {kmock.action.WATCH: "watch", kmock.action.LIST: "list", kmock.action.FETCH: "get", kmock.action.CREATE: "create",
                 kmock.action.UPDATE: "patch", kmock.action.DELETE: "delete"}  # fmt: skip
        if request.method.value == "PUT":
            verb = "update"
        elif request.method.value == "DELETE" and request.name is None:
            verb = "deletecollection"
        else:
            verb = verbs.get(request.action, str(request.method.value).lower())
        token = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        scope = "namespaced" if request.namespace else "cluster"
        self.calls.add((token, verb, res.group or "", res.plural or "", request.subresource or "", scope))

    async def _create(self, request: kmock.Request, res: kmock.resource, namespace: str | None) -> dict[str, Any]:
        if request.subresource is not None or not isinstance(request.data, Mapping):
            raise _error(400, "BadRequest", "the body of a create must be a JSON object")
        info = self.resources[res]
        if info.namespaced:
            namespace = namespace or request.data.get("metadata", {}).get("namespace") or "default"
        obj = self._new_object(res, request.data, namespace)
        key = (res, namespace, obj["metadata"]["name"])
        if self._current(key) is not None:
            self._rv -= 1  # nothing was written
            raise _error(
                409, "AlreadyExists", f'{res.plural} "{key[2]}" already exists', name=key[2], group=res.group, kind=res.plural
            )
        if key in self._objects:
            self._objects[key].history.append(obj)
        else:
            self._objects[key] = obj
        if res == kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions"):
            self.register_crd(obj)
        await self._emit(res, "ADDED", obj)
        return obj

    async def _patch(self, request: kmock.Request, res: kmock.resource, key: Any, old: dict[str, Any]) -> dict[str, Any]:
        content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
        patch = request.data
        if content_type == "application/json-patch+json":
            if not isinstance(patch, list):
                raise _error(400, "BadRequest", "a JSON patch must be a list of operations")
            try:
                new = jsonpatch.apply_patch(copy.deepcopy(old), patch, in_place=False)
            except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as e:
                raise _error(422, "Invalid", f"the JSON patch could not be applied: {e}", name=key[2]) from None
        elif content_type in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
            if not isinstance(patch, Mapping):
                raise _error(400, "BadRequest", "a merge patch must be a JSON object")
            expected_rv = (patch.get("metadata") or {}).get("resourceVersion")
            if expected_rv is not None and expected_rv != old["metadata"]["resourceVersion"]:
                raise _error(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {res.plural} "{key[2]}": '
                    "the object has been modified; please apply your changes to the latest version",
                    name=key[2],
                    group=res.group,
                    kind=res.plural,
                )
            new = _merge_patch(old, patch)
        else:
            raise _error(415, "UnsupportedMediaType", f"the patch type {content_type!r} is not emulated")
        if not isinstance(new, dict):
            raise _error(422, "Invalid", "the patched object is not a JSON object")
        new = copy.deepcopy(new)  # a merge patch shares untouched sub-dicts (e.g. metadata) with `old`

        has_status = "status" in self.resources[res].subresources
        if request.subresource == "status":  # only .status may change
            status = new.get("status")
            new = copy.deepcopy(old)
            new.pop("status", None)
            if status is not None:
                new["status"] = status
        elif has_status:  # the main resource: .status may not change
            new.pop("status", None)
            if "status" in old:
                new["status"] = old["status"]
        meta = new.get("metadata")
        if not isinstance(meta, dict):
            meta = new["metadata"] = {}
        for field in (
            "name",
            "namespace",
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "generation",
            "resourceVersion",
        ):
            meta.pop(field, None)
            if field in old["metadata"]:
                meta[field] = old["metadata"][field]
        new["apiVersion"], new["kind"] = old["apiVersion"], old["kind"]
        if new == old:
            return old  # a no-op: no new resourceVersion, no watch event

        def spec_part(o: Mapping[str, Any]) -> dict[str, Any]:
            return {k: v for k, v in o.items() if k not in ("metadata", "status", "apiVersion", "kind")}

        if spec_part(new) != spec_part(old):
            meta["generation"] = old["metadata"].get("generation", 1) + 1
        meta["resourceVersion"] = self._next_rv()
        self._objects[key].history.append(new)
        await self._emit(res, "MODIFIED", new)
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            await self._remove(res, key, new)
        return new

    @staticmethod
    def _grace_period(request: kmock.Request, res: kmock.resource, obj: Mapping[str, Any]) -> int:
        """A pod's graceful-deletion period: 0 unless a node runs it (``spec.nodeName``) and it has not
        finished; then the request's ``gracePeriodSeconds`` or the pod's ``terminationGracePeriodSeconds``."""
        running = (obj.get("spec") or {}).get("nodeName") and (obj.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
        if res != kmock.resource("", "v1", "pods") or not running:
            return 0
        body = request.data if isinstance(request.data, Mapping) else {}
        for raw in (request.params.get("gracePeriodSeconds"), body.get("gracePeriodSeconds")):
            if raw is not None:
                return max(0, int(raw))
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
        return final

    # -- reading: lists, tables, watches --

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


# --- the server thread and the test-side API -------------------------------------------------------------------


class KubeEmulator:
    """The emulator on a real HTTP port, run in a daemon thread with its own event loop.

    Start/stop it (or use it as a context manager), point clients at :attr:`url` via :meth:`write_kubeconfig`,
    and read/write objects over HTTP with the helpers below (``api_path`` is a URL path such as
    ``/apis/orbit.dev/v1alpha1/namespaces/default/rltrainingjobs/x``; :meth:`path` builds one).
    """

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port
        self.handler: EmulatorHandler | None = None
        self.kubeconfig: Path | None = None  # the last one written by write_kubeconfig()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping: asyncio.Event | None = None

    # -- lifecycle --

    @property
    def url(self) -> str:
        if self._thread is None:
            raise RuntimeError("the emulator is not started")
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> KubeEmulator:
        if self._thread is not None:
            raise RuntimeError("the emulator is already started")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        ready = threading.Event()
        failure: list[BaseException] = []

        async def serve() -> None:
            self._loop = asyncio.get_running_loop()
            self._stopping = asyncio.Event()
            try:
                async with EmulatorHandler() as handler:
                    self.handler = handler
                    runner = aiohttp.web.ServerRunner(aiohttp.web.Server(handler), shutdown_timeout=0.5)
                    await runner.setup()
                    await aiohttp.web.SockSite(runner, sock).start()
                    ready.set()
                    try:
                        await self._stopping.wait()
                    finally:
                        await runner.cleanup()
            except BaseException as e:  # surfaced by start() if it happens before ready
                failure.append(e)
                raise
            finally:
                ready.set()

        def run() -> None:
            with contextlib.suppress(BaseException):  # a start failure is reported by start()
                asyncio.run(serve())  # also cancels what is left (e.g. idle keep-alive connections)

        self._thread = threading.Thread(target=run, name=f"kube-emulator-{self.port}", daemon=True)
        self._thread.start()
        if not ready.wait(timeout) or failure:
            raise RuntimeError(f"the emulator did not start: {failure[0] if failure else 'timeout'}")
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is None:
            return
        if self._loop is not None and self._stopping is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(timeout)
        self._thread = None

    def __enter__(self) -> KubeEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- client configuration --

    def write_kubeconfig(self, path: str | os.PathLike[str], namespace: str = "default", token: str = "emulator",
                         default: bool = True) -> Path:  # fmt: skip
        """Write a kubeconfig (context ``emulator``, bearer TOKEN: calls are recorded per token, see
        :meth:`api_calls`) for kubectl, kopf and the kubernetes client; DEFAULT: the one :meth:`env` uses."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "preferences": {},
            "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "emulator", "user": {"token": token}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "emulator", "namespace": namespace}}],
        }
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        if default:
            self.kubeconfig = path
        return path

    def api_calls(self, token: str) -> set[tuple[str, str, str, str, str]]:
        """(verb, group, resource, subresource, scope) of every object request made with TOKEN so far."""
        assert self.handler is not None
        return {call[1:] for call in list(self.handler.calls) if call[0] == token}

    def env(self, kubeconfig: str | os.PathLike[str] | None = None) -> dict[str, str]:
        """``os.environ`` plus what a subprocess needs to reach the emulator (KUBECONFIG, no proxy, a cache dir)."""
        kubeconfig = Path(kubeconfig) if kubeconfig is not None else self._require_kubeconfig()
        no_proxy = ",".join(filter(None, [os.environ.get("NO_PROXY", ""), "127.0.0.1", "localhost"]))
        return {
            **os.environ,
            "KUBECONFIG": str(kubeconfig),
            "NO_PROXY": no_proxy,
            "no_proxy": no_proxy,
            "KUBECACHEDIR": str(kubeconfig.parent / ".kube-cache"),
        }

    def kubectl(
        self, *args: str, check: bool = True, timeout: float = 60.0, kubeconfig: str | os.PathLike[str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``kubectl --kubeconfig <file> <args>`` (cwd: the repo root); raise with its output if it fails."""
        env = self.env(kubeconfig)
        cmd = ["kubectl", "--kubeconfig", env["KUBECONFIG"], "--cache-dir", env["KUBECACHEDIR"], *args]
        proc = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc

    def _require_kubeconfig(self) -> Path:
        if self.kubeconfig is None:
            raise RuntimeError("call write_kubeconfig() first")
        return self.kubeconfig

    # -- resources --

    def load_crd(self, crd: str | os.PathLike[str] | Mapping[str, Any] = ORBIT_CRD) -> dict[str, Any]:
        """Create a CRD (a YAML file or a dict): its resource becomes discoverable for kubectl and kopf."""
        if not isinstance(crd, Mapping):
            crd = yaml.safe_load(Path(crd).read_text())
        return self.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)

    @staticmethod
    def path(resource: str, namespace: str | None = None, name: str | None = None, subresource: str | None = None) -> str:
        """The URL path of a collection or an object: ``path("v1/pods", "default", "p")``,
        ``path("orbit.dev/v1alpha1/rltrainingjobs", "default")``, ``path("v1/namespaces", name="x")``."""
        *group_version, plural = resource.strip("/").split("/")
        prefix = "/api/v1" if group_version == ["v1"] else "/apis/" + "/".join(group_version)
        parts = [prefix] + (["namespaces", namespace] if namespace else []) + [plural]
        parts += [name] if name else []
        parts += [subresource] if subresource else []
        return "/".join(parts)

    # -- HTTP access --

    def request(
        self,
        method: str,
        api_path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        params: Mapping[str, str] | None = None,
        timeout: float = 10.0,
    ) -> tuple[int, Any]:
        """One HTTP request; returns (status, parsed JSON body or text). Never raises on HTTP errors."""
        url = self.url + api_path + ("?" + urllib.parse.urlencode(params) if params else "")
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            url, data=data, method=method.upper(), headers={"Content-Type": content_type, "Accept": "application/json"}
        )
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(req, timeout=timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, raw.decode(errors="replace")

    def _ok(self, method: str, api_path: str, body: Any = None, **kwargs: Any) -> Any:
        status, payload = self.request(method, api_path, body, **kwargs)
        if status >= 300:
            message = payload.get("message") if isinstance(payload, dict) else payload
            raise KubeApiError(status, f"{method} {api_path} -> {status}: {message}", payload)
        return payload

    def get(self, api_path: str) -> dict[str, Any] | None:
        """The object at ``api_path``, or None if absent (404)."""
        status, payload = self.request("GET", api_path)
        if status == 404:
            return None
        if status >= 300:
            raise KubeApiError(status, f"GET {api_path} -> {status}: {payload}", payload)
        return payload

    def list(
        self, api_path: str, *, label_selector: str | None = None, field_selector: str | None = None
    ) -> list[dict[str, Any]]:
        """The items of a collection (``path(resource, namespace)``; no namespace: all namespaces)."""
        params = {k: v for k, v in (("labelSelector", label_selector), ("fieldSelector", field_selector)) if v}
        return self._ok("GET", api_path, params=params)["items"]

    def create(self, api_path: str, obj: Mapping[str, Any]) -> dict[str, Any]:
        """POST ``obj`` to a collection path; returns the stored object (uid, resourceVersion, ... filled in)."""
        return self._ok("POST", api_path, dict(obj))

    def patch(self, api_path: str, patch: Any, *, subresource: str | None = None, patch_type: str = "merge") -> dict[str, Any]:
        """PATCH an object; ``patch_type``: "merge" (a dict) or "json" (a list of ops)."""
        content_type = {
            "merge": "application/merge-patch+json",
            "json": "application/json-patch+json",
            "strategic": "application/strategic-merge-patch+json",
        }[patch_type]
        full_path = api_path + (f"/{subresource}" if subresource else "")
        return self._ok("PATCH", full_path, patch, content_type=content_type)

    def patch_status(self, api_path: str, status: Mapping[str, Any]) -> dict[str, Any]:
        """Merge-patch ``.status`` through the status subresource (as a controller would)."""
        return self.patch(api_path, {"status": dict(status)}, subresource="status")

    def delete(self, api_path: str) -> dict[str, Any] | None:
        """DELETE an object; returns it (with deletionTimestamp if finalizers hold it), None if it was absent."""
        status, payload = self.request("DELETE", api_path, {"propagationPolicy": "Background"})
        if status == 404:
            return None
        if status >= 300:
            raise KubeApiError(status, f"DELETE {api_path} -> {status}: {payload}", payload)
        return payload

    def list_pods(self, namespace: str | None = "default", *, label_selector: str | None = None) -> list[dict[str, Any]]:
        return self.list(self.path("v1/pods", namespace), label_selector=label_selector)

    def events(self, namespace: str | None = "default", *, involved_name: str | None = None) -> list[dict[str, Any]]:
        """Core v1 Events (e.g. kopf's), optionally only those about the object ``involved_name``."""
        events = self.list(self.path("v1/events", namespace))
        return [e for e in events if involved_name is None or e.get("involvedObject", {}).get("name") == involved_name]

    def set_pod_status(
        self,
        namespace: str,
        name: str,
        phase: str = "Running",
        *,
        pod_ip: str | None = None,
        exit_code: int | None = None,
        reason: str | None = None,
        message: str | None = None,
        restart_count: int = 0,
        ready: bool | None = None,
        container_statuses: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """Play the kubelet: set a pod's phase, conditions, podIP and per-container statuses.

        ``phase``: Pending (containers waiting, ContainerCreating), Running (running, ready unless
        ``ready=False``), Succeeded (terminated, exit 0, Completed) or Failed (terminated, ``exit_code`` or 1,
        ``reason`` or "Error"). ``container_statuses`` replaces the generated ones verbatim. ``pod_ip``
        defaults to 10.244.0.<n> once the pod runs. Returns the updated pod.
        """
        pod_path = self.path("v1/pods", namespace, name)
        pod = self.get(pod_path)
        if pod is None:
            raise KubeApiError(404, f"pod {namespace}/{name} not found", None)
        now = _now()
        is_ready = (phase == "Running") if ready is None else ready
        if container_statuses is None:
            container_statuses = []
            for container in pod.get("spec", {}).get("containers", []):
                if phase == "Pending":
                    state: dict[str, Any] = {"waiting": {"reason": reason or "ContainerCreating"}}
                elif phase == "Running":
                    state = {"running": {"startedAt": now}}
                else:
                    code = exit_code if exit_code is not None else (0 if phase == "Succeeded" else 1)
                    state = {
                        "terminated": {
                            "exitCode": code,
                            "reason": reason or ("Completed" if code == 0 else "Error"),
                            "startedAt": pod["metadata"]["creationTimestamp"],
                            "finishedAt": now,
                            **({"message": message} if message else {}),
                        }
                    }
                container_statuses.append(
                    {
                        "name": container["name"],
                        "image": container.get("image", ""),
                        "imageID": "",
                        "ready": is_ready,
                        "started": phase == "Running",
                        "restartCount": restart_count,
                        "state": state,
                    }
                )
        if pod_ip is None and phase != "Pending":
            pod_ip = (pod.get("status") or {}).get("podIP") or f"10.244.0.{int(pod['metadata']['resourceVersion']) % 250 + 2}"
        conditions = [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
            {"type": "Initialized", "status": "True", "lastTransitionTime": now},
            {"type": "ContainersReady", "status": str(is_ready), "lastTransitionTime": now},
            {"type": "Ready", "status": str(is_ready), "lastTransitionTime": now},
        ]
        status: dict[str, Any] = {
            "phase": phase,
            "conditions": conditions,
            "containerStatuses": container_statuses,
            "hostIP": "10.0.0.1",
            "startTime": pod["metadata"]["creationTimestamp"],
        }
        if pod_ip:
            status.update(podIP=pod_ip, podIPs=[{"ip": pod_ip}])
        if reason and phase != "Pending":
            status["reason"] = reason
        if message:
            status["message"] = message
        return self.patch_status(pod_path, status)

    @staticmethod
    def wait_for(predicate: Callable[[], _T], timeout: float = 30.0, interval: float = 0.2, message: str = "condition") -> _T:
        """Poll ``predicate`` until it returns something truthy (returned); AssertionError after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(KubeApiError):
                value = predicate()
                if value:
                    return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {message}")
            time.sleep(interval)


class KubeApiError(Exception):
    def __init__(self, status: int, message: str, payload: Any) -> None:
        super().__init__(message)
        self.status = status
        self.payload = payload


# --- a real kopf operator process -------------------------------------------------------------------------------


@contextlib.contextmanager
def kopf_operator(
    kube: KubeEmulator,
    *targets: str,
    log_path: str | os.PathLike[str],
    args: tuple[str, ...] = ("--standalone", "--all-namespaces"),
    env: Mapping[str, str] | None = None,
    stop_timeout: float = 10.0,
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``python -m kopf run <args> <targets>`` against the emulator for the ``with`` block.

    ``targets``: script paths and/or ``-m module`` pairs. Output (stdout+stderr) goes to ``log_path``; it is
    appended to the AssertionError if the process died early. Stopped with SIGINT (kopf's graceful exit),
    then killed after ``stop_timeout`` seconds.
    """
    log_path = Path(log_path)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kopf", "run", *args, *targets],
            env={**kube.env(), "PYTHONUNBUFFERED": "1", **(env or {})},
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            yield proc
        except BaseException as e:
            if proc.poll() is not None and isinstance(e, AssertionError):
                raise AssertionError(f"{e}\nkopf exited with {proc.returncode}:\n{log_path.read_text()[-5000:]}") from e
            raise
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(stop_timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


# --- pytest fixtures (import them into a conftest.py: ``from tests.kube.emulator import kube, kube_server``) ----


@pytest.fixture
def kube_server() -> Iterator[KubeEmulator]:
    """A bare emulator (built-in resources only), stopped at the end of the test."""
    with KubeEmulator() as emulator:
        yield emulator


@pytest.fixture
def kube(kube_server: KubeEmulator, tmp_path: Path) -> KubeEmulator:
    """The emulator with the RLTrainingJob CRD loaded and a kubeconfig at ``kube.kubeconfig`` (in tmp_path)."""
    kube_server.load_crd(ORBIT_CRD)
    kube_server.write_kubeconfig(tmp_path / "kubeconfig")
    return kube_server
