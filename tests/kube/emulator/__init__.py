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
* garbage collection (background propagation): when an object is removed, objects whose
  ``ownerReferences`` are then all gone are deleted too (gracefully, for a pod bound to a node:
  :meth:`KubeEmulator.bind_pod`; :meth:`KubeEmulator.finish_pod_deletion` plays its kubelet);
* injected errors (:meth:`KubeEmulator.inject_error`): the next N requests of a verb on a resource
  answer a Status error (429, a quota 403, 5xx), as API priority and fairness, ResourceQuota or a
  struggling server do;
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

Not emulated: namespace deletion cascades, foreground deletion, PUT/replace, server-side apply,
schema validation/defaulting, admission, pod logs/exec, pagination (``limit`` is ignored), real kubelets
(use :meth:`KubeEmulator.set_pod_status`). Object endpoints are served by this module directly, so kmock DSL
reactions (``handler[...] << ...``) only apply to non-object paths (discovery, ``/version``, custom URLs).

Modules: ``handler`` (discovery and the write path), ``deletion`` (finalizers, graceful deletion, garbage
collection), ``reads`` (lists, tables, watches),
``api_semantics`` (patches, selectors, jsonpath), ``server`` (the thread and the test-side API),
``kopf_process`` (a real ``kopf run``), ``fixtures``, ``kmock_fix``.

Typical use (the ``kube`` fixture, see tests/kube/conftest.py, starts it with the Orbit CRD loaded)::

    def test_operator(kube, tmp_path):
        kube.kubectl("apply", "--validate=false", "-f", "examples/rljob-cpu.yaml")
        with kopf_operator(kube, "-m", "orbit_operator", log_path=tmp_path / "kopf.log"):
            job = kube.path(RLJOBS, "default", "quickstart-cpu")
            kube.wait_for(lambda: kube.get(job).get("status", {}).get("phase") == "Pending")
            pod = kube.wait_for(lambda: kube.list_pods("default"))[0]
            kube.set_pod_status("default", pod["metadata"]["name"], "Running")
"""

from . import kmock_fix  # noqa: F401  (installs the path-parser fix)
from .fixtures import kube, kube_server
from .kopf_process import kopf_operator
from .resources import ORBIT_CRD, REPO_ROOT, RLJOBS
from .server import KubeApiError, KubeEmulator

__all__ = ["ORBIT_CRD", "REPO_ROOT", "RLJOBS", "KubeApiError", "KubeEmulator", "kopf_operator", "kube", "kube_server"]
