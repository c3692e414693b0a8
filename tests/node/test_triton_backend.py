"""The engine on the Triton backend (the interpreter on CPU) generates what the torch backend does:
the same greedy tokens in float32, and in bfloat16 the same logits within bf16's resolution."""

from __future__ import annotations

import dataclasses

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
# kernels then pick different tokens (one prompt diverged at its second token on an H200, at an
# fp32 margin of 0.012). bfloat16 is compared below, teacher-forced, logits within a tolerance.
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


# bfloat16 keeps 8 significant bits: rounding a value to bf16 errs by at most 2**-8 of it. A token's
# logits pass through BF16_ROUNDINGS_PER_LAYER roundings a layer (input norm, QKV, rotary, attention,
# O projection, post-attention norm, gate/up, SiLU-and-mul, down: node/runner/models/llama.py) and two
# more (the final norm, the LM head). Summing them, each backend is off from exact arithmetic by at
# most R x 2**-8 of the row's scale (its largest |logit|), so two correct backends disagree by at most
# 2 R x 2**-8: 40/256 of the row's largest |logit| for the tiny 2-layer model. Measured on this
# project's CPU (Triton interpreter, whose kernels compute in fp32 on bf16 storage): up to 16/256
# between the backends, 8/256 between the torch backend and itself in float32; a kernel that drops a
# sequence's last key moves a logit by ~200/256, a 10 % error in the softmax scale by ~50/256, and
# the test catches both (a 1 % one, ~8/256, is below what bf16 can tell).
BF16_RESOLUTION = 2.0 ** -8
BF16_ROUNDINGS_PER_LAYER = 9
TEACHER_GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def bf16_tolerance(num_layers: int) -> float:
    """How far apart two correct bf16 backends' logits may be, as a share of the row's largest |logit|."""
    return 2 * (BF16_ROUNDINGS_PER_LAYER * num_layers + 2) * BF16_RESOLUTION


def teacher_forced_logits(engine: Engine, prompts: list[list[int]], seed: int = 11) -> list[torch.Tensor]:
    """Each sampling step's logits, ``[rows, vocab]`` float32 on the CPU, with every sampled token
    replaced by one drawn from a generator seeded with ``seed``: two engines of the same knobs
    schedule the same rows, so both are fed the same tokens whatever their logits say, and a near
    tie in one step cannot send the two down different continuations."""
    model, draws, steps = engine.runner.model, torch.Generator().manual_seed(seed), []
    logits_of = model.compute_logits

    def forced(hidden: torch.Tensor) -> torch.Tensor:
        logits = logits_of(hidden)
        steps.append(logits.float().cpu())
        tokens = torch.randint(3, logits.shape[1], (logits.shape[0],), generator=draws).to(logits.device)
        out = torch.full_like(logits, float("-inf"))
        out[torch.arange(logits.shape[0], device=logits.device), tokens] = 0.0  # greedy picks the forced token
        return out

    model.compute_logits = forced  # the instance's, called from Python each step (no CUDA graphs here)
    engine.generate(prompts, TEACHER_GREEDY)
    return steps


def bf16_disagreements(steps: list[torch.Tensor], reference: list[torch.Tensor], tolerance: float) -> list[str]:
    """Where ``steps`` leave ``reference`` by more than bf16 allows: a logit further from the
    reference's than ``tolerance`` x the row's largest |logit|, or another greedy token at a row
    whose top-2 margin is above that tolerance (below it, bf16 cannot tell the two apart). Empty
    when they agree."""
    found = []
    assert [s.shape for s in steps] == [r.shape for r in reference], "the two engines scheduled different steps"
    for k, (got, ref) in enumerate(zip(steps, reference)):
        allowed = tolerance * ref.abs().amax(dim=1)  # [rows]
        worst = (got - ref).abs().amax(dim=1)
        top2 = ref.topk(2, dim=1).values
        decided = top2[:, 0] - top2[:, 1] > allowed
        for row in torch.nonzero(worst > allowed).flatten().tolist():
            found.append(f"step {k} row {row}: a logit {worst[row]:.4f} apart, allowed {allowed[row]:.4f}")
        for row in torch.nonzero(decided & (got.argmax(dim=1) != ref.argmax(dim=1))).flatten().tolist():
            margin = top2[row, 0] - top2[row, 1]
            found.append(f"step {k} row {row}: another greedy token at a top-2 margin of {margin:.4f}")
    return found


def bf16_engine(model_dir, backend: str, dtype: str = "bfloat16", **knobs) -> Engine:
    """An engine whose logits :func:`teacher_forced_logits` can record (no CUDA graphs: a replay
    would not call back into Python)."""
    return Engine.from_model(model_dir, max_model_len=128, attention_backend=backend, device=DEVICE,
                             dtype=dtype, cuda_graphs=False, **knobs)


BF16_KNOBS = {"chunk5": dict(token_budget=32, chunk_size=5),
              "small-pool": dict(token_budget=24, chunk_size=16, block_size=8, num_kv_blocks=20)}


@pytest.mark.parametrize("knobs", list(BF16_KNOBS.values()), ids=list(BF16_KNOBS))
@pytest.mark.slow  # the Triton interpreter on a CPU
def test_triton_backend_logits_match_the_torch_backend_in_bf16(tiny_llama_dir, prompts, knobs):
    """On CUDA this compares the kernels' native bf16 path (16-bit operands into tl.dot) with the
    torch backend. On a CPU it runs too: under the interpreter, which computes bf16 arithmetic
    wrongly, the kernels load bf16, compute in fp32 and store bf16 (kernels/_triton.py), so
    it checks the bf16 storage path (KV cache writes, loads, conversions) but not the native dot."""
    reference = teacher_forced_logits(bf16_engine(tiny_llama_dir, "torch", **knobs), prompts)
    engine = bf16_engine(tiny_llama_dir, "triton", **knobs)
    assert engine.runner.backend.name == "triton" and engine.runner.dtype == torch.bfloat16
    tolerance = bf16_tolerance(engine.model_config.num_hidden_layers)
    assert bf16_disagreements(teacher_forced_logits(engine, prompts), reference, tolerance) == []
    rows = torch.cat(reference)
    top2 = rows.topk(2, dim=1).values
    decided = (top2[:, 0] - top2[:, 1] > tolerance * rows.abs().amax(dim=1)).sum().item()
    assert len(rows) == len(prompts) * TEACHER_GREEDY.max_tokens and decided >= 4  # some greedy tokens checked


def test_a_bf16_backend_is_within_half_the_tolerance_of_float32(tiny_llama_dir, prompts):
    """One backend's bf16 error alone, against the same backend in float32: the tolerance's
    derivation (each backend off by at most R x 2**-8) holds."""
    reference = teacher_forced_logits(bf16_engine(tiny_llama_dir, "torch", "float32", **BF16_KNOBS["chunk5"]), prompts)
    engine = bf16_engine(tiny_llama_dir, "torch", **BF16_KNOBS["chunk5"])
    tolerance = bf16_tolerance(engine.model_config.num_hidden_layers)
    assert bf16_disagreements(teacher_forced_logits(engine, prompts), reference, tolerance / 2) == []


@pytest.mark.parametrize("fault", ["drops the last key", "softmax scale 10 % off"])
def test_the_bf16_comparison_fails_a_backend_with_a_faulty_kernel(tiny_llama_dir, prompts, fault):
    """The check can fail: the torch backend against itself with its attention broken in a test
    (an off-by-one in the sequence lengths; a wrong softmax scale) is refused."""
    reference = teacher_forced_logits(bf16_engine(tiny_llama_dir, "torch", **BF16_KNOBS["chunk5"]), prompts)
    engine = bf16_engine(tiny_llama_dir, "torch", **BF16_KNOBS["chunk5"])
    backend = engine.runner.backend
    attention = backend.attention

    def faulty(q, k, v, k_cache, v_cache, meta, scale):
        if fault == "drops the last key":
            meta = dataclasses.replace(meta, seq_lens=(meta.seq_lens - 1).clamp(min=1))
        else:
            scale = scale * 1.1
        return attention(q, k, v, k_cache, v_cache, meta, scale)

    backend.attention = faulty
    tolerance = bf16_tolerance(engine.model_config.num_hidden_layers)
    found = bf16_disagreements(teacher_forced_logits(engine, prompts), reference, tolerance)
    assert any("apart" in line for line in found)


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
