"""The engine on the Triton backend (the interpreter on CPU) generates what the torch backend does."""

from __future__ import annotations

import pytest
import torch

from cadenza.node.runner.backend import ENV_VAR, TorchBackend, TritonBackend, resolve_backend_name, select_backend
from cadenza.node.core.config import ConfigError
from cadenza.node.frontend.llm import Engine
from cadenza.node.core.request import SamplingParams

PROMPT_LENS = [1, 4, 17, 33, 70]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Greedy tokens are compared bit for bit in float32 on every device: in bfloat16 (auto's dtype on
# CUDA) a tiny random model's top-2 logits can tie within bf16's resolution, and two correct
# kernels then pick different tokens (one prompt diverged at its second token on an H200).
DTYPE = "float32"


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 384, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def torch_tokens(tiny_llama_dir, prompts):
    engine = Engine.from_model(tiny_llama_dir, max_model_len=128, attention_backend="torch", device=DEVICE,
                               dtype=DTYPE)
    return engine.generate(prompts, GREEDY)


@pytest.mark.parametrize(
    "knobs",
    [dict(token_budget=32, chunk_size=5), dict(token_budget=64, chunk_size=None),
     dict(token_budget=24, chunk_size=16, block_size=8, num_kv_blocks=20)],
    ids=["chunk5", "unchunked", "small-pool"],
)
@pytest.mark.slow  # the Triton interpreter on a CPU: seconds per engine step
def test_triton_backend_generates_the_torch_backend_tokens(tiny_llama_dir, prompts, torch_tokens, knobs):
    engine = Engine.from_model(tiny_llama_dir, max_model_len=128, attention_backend="triton", device=DEVICE,
                               dtype=DTYPE, **knobs)
    assert engine.runner.backend.name == "triton"
    assert engine.generate(prompts, GREEDY) == torch_tokens
    assert engine.block_manager.num_used_blocks == 0


def test_auto_is_the_compiled_kernels_for_fp32_on_a_cpu_triton_on_a_gpu_and_torch_otherwise(monkeypatch):
    from cadenza.kernels import cpu

    monkeypatch.delenv(ENV_VAR, raising=False)
    assert resolve_backend_name("auto", torch.device("cpu")) == ("cpu" if cpu.available() else "torch")
    assert resolve_backend_name("auto", torch.device("cpu"), torch.bfloat16) == "torch"
    assert resolve_backend_name("auto", torch.device("cuda")) == "triton"
    monkeypatch.setattr(cpu, "available", lambda: False)  # no compiler on this machine
    assert resolve_backend_name("auto", torch.device("cpu")) == "torch"


def test_the_cpu_backend_asked_for_where_it_cannot_run_is_a_clear_error(monkeypatch):
    from cadenza.kernels import cpu

    with pytest.raises(ConfigError, match="float32 on the CPU only"):
        resolve_backend_name("cpu", torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ConfigError, match="float32 on the CPU only"):
        resolve_backend_name("cpu", torch.device("cuda"))
    monkeypatch.setattr(cpu, "available", lambda: False)
    monkeypatch.setattr(cpu, "build_error", lambda: "g++ not found")
    with pytest.raises(ConfigError, match=r"did not build \(g\+\+ not found"):
        resolve_backend_name("cpu", torch.device("cpu"))


def test_the_environment_variable_forces_a_backend_when_the_setting_is_auto(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "triton")
    assert isinstance(select_backend("auto", torch.device("cpu")), TritonBackend)
    monkeypatch.setenv(ENV_VAR, "torch")
    assert isinstance(select_backend("auto", torch.device("cuda")), TorchBackend)
    assert isinstance(select_backend("triton", torch.device("cpu")), TritonBackend)  # explicit wins


def test_an_unknown_backend_in_the_environment_is_refused(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "cuda-graphs")
    with pytest.raises(ConfigError, match=ENV_VAR):
        resolve_backend_name("auto", torch.device("cpu"))


def test_triton_without_triton_installed_is_a_clear_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    with pytest.raises(ConfigError, match="triton is not installed"):
        resolve_backend_name("triton", torch.device("cpu"))
