# Orbit operator image: the kopf operator and the job-spec models; no torch, no vLLM.
# Build from the repo root (`make images` passes the version from pyproject.toml):
#   docker build --build-arg VERSION=0.1.0 -t ghcr.io/orbit-rl/orbit-operator:0.1.0 .
FROM python:3.11.11-slim-bookworm

ARG VERSION
LABEL org.opencontainers.image.title="orbit-operator" \
      org.opencontainers.image.description="Orbit's Kubernetes operator: RLTrainingJob -> one pod (rollout, reference, learner)" \
      org.opencontainers.image.source="https://github.com/orbit-rl/orbit" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}"

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin orbit
WORKDIR /app
COPY pyproject.toml README.md constraints.txt ./
COPY orbit_runtime ./orbit_runtime
COPY operator ./operator
# DL3013 (pin pip versions): this installs the repository itself; every dependency is pinned by constraints.txt
# hadolint ignore=DL3013
RUN pip install --no-cache-dir -c constraints.txt '.[operator]'

USER 10001
EXPOSE 8080 8081
# the liveness endpoint kopf serves (Kubernetes uses the chart's probes; this is for plain docker)
HEALTHCHECK --interval=30s --timeout=5s CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=4)"]
# configuration from the environment: see operator/orbit_operator/settings.py and __main__.py
ENTRYPOINT ["python", "-m", "orbit_operator"]
