"""The request handler (runs in the server thread's event loop): discovery, plumbing and the write
path of the emulated API server; reads come from ReadPath (reads.py)."""

from __future__ import annotations

import collections
import copy
import secrets
import string
import uuid
import warnings
from collections.abc import Mapping
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import jsonpointer
import kmock
from kmock._internal import apps as _kmock_apps

from .api_semantics import _error, _merge_patch, _now
from .deletion import DeletePath
from .reads import ReadPath

# --- the request handler (runs in the server thread's event loop) ----------------------------------------------


@attrs.define
class Fault:
    """An error the emulator answers instead of serving: VERB (create, get, list, patch, ...) on RESOURCE (plural)."""

    verb: str
    resource: str
    status: int
    reason: str
    message: str
    times: int = 1


@attrs.define(kw_only=True)
class EmulatorHandler(ReadPath, DeletePath, kmock.KubernetesEmulator):
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
    # requests per bearer token (every object request, for load measurements: benchmarks/operator_load.py)
    request_counts: collections.Counter[str] = attrs.field(factory=collections.Counter, init=False)
    # injected API errors (KubeEmulator.inject_error): each answers its next `times` matching requests
    faults: list[Fault] = attrs.field(factory=list, init=False)

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
        verb = self._record(request, res)
        self._inject_fault(verb, res)
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

    def _inject_fault(self, verb: str, res: kmock.resource) -> None:
        """Answer with an injected error (a 429 from API priority and fairness, a quota 403, a 5xx) if one matches."""
        for fault in self.faults:
            if fault.times > 0 and fault.verb == verb and fault.resource == res.plural:
                fault.times -= 1
                raise _error(fault.status, fault.reason, fault.message)

    def _record(self, request: kmock.Request, res: kmock.resource) -> str:
        """Note the RBAC verb this request needs, per client (its bearer token); return the verb."""
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
        self.request_counts[token] += 1
        return verb

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
        if meta.get("deletionTimestamp") and not meta.get("finalizers") and not meta.get("deletionGracePeriodSeconds"):
            await self._remove(res, key, new)  # its last finalizer removed (a graceful deletion waits for its node)
        return new
