"""`python -m orbit_operator`: the operator process.

Configuration comes from the environment (see settings.OperatorSettings.from_env): watched
namespaces (ORBIT_NAMESPACES, comma-separated; unset: all), the node cache root, the runtime
image. It serves a liveness endpoint (ORBIT_LIVENESS_PORT, default 8080, /healthz) and its
own Prometheus metrics (ORBIT_METRICS_PORT, default 8081, /metrics: orbit_operator_*).
"""

from __future__ import annotations

import logging
import os
import sys

import kopf
from prometheus_client import start_http_server

from orbit_runtime.errors import OrbitError
from orbit_runtime.observability import metrics


def main() -> int:
    logging.basicConfig(level=os.environ.get("ORBIT_LOG_LEVEL", "INFO"), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        from orbit_operator import handlers  # registers the handlers; reads (and checks) the settings
        from orbit_operator.job_secrets import RedactingLogFilter

        for handler in logging.getLogger().handlers:  # every record the process logs, kopf's included
            handler.addFilter(RedactingLogFilter())
        logging.getLogger("kopf.objects").addFilter(RedactingLogFilter())  # kopf posts these as Events too

        settings = handlers.SETTINGS
        liveness_port = int(os.environ.get("ORBIT_LIVENESS_PORT", "8080"))
        metrics_port = int(os.environ.get("ORBIT_METRICS_PORT", "8081"))
    except (OrbitError, ValueError) as exc:
        print(f"orbit-operator: {exc}", file=sys.stderr)
        return 2
    bind = os.environ.get("ORBIT_BIND_ADDRESS", "0.0.0.0")
    start_http_server(metrics_port, addr=bind, registry=metrics.OPERATOR_REGISTRY)
    namespaces = list(settings.namespaces)
    kopf.run(
        standalone=True,  # one replica; no kopf peering objects needed
        namespaces=namespaces,
        clusterwide=not namespaces,
        liveness_endpoint=f"http://{bind}:{liveness_port}/healthz",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
