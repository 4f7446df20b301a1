"""Fixtures for tests against the emulated Kubernetes API (see tests/kube/emulator/).

``kube``: the emulator on a loopback port with the RLTrainingJob CRD loaded and ``kube.kubeconfig`` written;
``kube_server``: the same without the CRD or a kubeconfig. Other test packages can reuse them with
``from tests.kube.emulator import kube, kube_server  # noqa: F401`` in their own conftest.py.
"""

from tests.kube.emulator import kube, kube_server  # noqa: F401
