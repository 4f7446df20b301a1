# Orbit operator image: the kopf operator and the job-spec models; no torch, no vLLM.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin orbit
WORKDIR /app
COPY pyproject.toml README.md ./
COPY orbit_runtime ./orbit_runtime
COPY operator ./operator
# DL3013 (pin pip versions): this installs the repository itself; its pins are in pyproject.toml
# hadolint ignore=DL3013
RUN pip install --no-cache-dir '.[operator]'

USER 10001
# configuration from the environment: see operator/orbit_operator/settings.py and __main__.py
ENTRYPOINT ["python", "-m", "orbit_operator"]
