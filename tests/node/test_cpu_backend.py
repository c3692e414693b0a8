"""The engine on the compiled CPU kernels generates what the torch references do, and its linear
layers run the compiled few-row kernel."""

from __future__ import annotations

import pytest
import torch

from cadenza.kernels import cpu
from cadenza.node.core.request import SamplingParams
from cadenza.node.frontend.llm import Engine
from cadenza.node.runner.cpu_linear import COMPILED_MAX_ROWS, CompiledLinear

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"the CPU kernels did not build: {cpu.build_error()}")

PROMPT_LENS = [1, 4, 17, 33, 70, 200]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
KNOBS = [dict(token_budget=32, chunk_size=5), dict(token_budget=256, chunk_size=None),
         dict(token_budget=24, chunk_size=16, block_size=8, num_kv_blocks=60)]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 384, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("knobs", KNOBS, ids=["chunk5", "unchunked", "small-pool"])
def test_cpu_backend_generates_the_torch_backend_tokens(tiny_llama_dir, prompts, knobs):
    outputs = {}
    for backend in ("torch", "cpu"):
        engine = Engine.from_model(tiny_llama_dir, max_model_len=256, attention_backend=backend, **knobs)
        assert engine.runner.backend.name == backend
        outputs[backend] = engine.generate(prompts, GREEDY)
        assert engine.block_manager.num_used_blocks == 0
    assert outputs["cpu"] == outputs["torch"]


def test_the_cpu_backend_compiles_every_linear_layer(tiny_llama_dir):
    engine = Engine.from_model(tiny_llama_dir, max_model_len=64, attention_backend="cpu")
    model = engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, CompiledLinear)]
    assert len(layers) == 4 * model.config.num_hidden_layers + 1  # qkv, o, gate_up, down; the LM head
    assert not [m for m in model.modules() if type(m) is torch.nn.Linear]
    layer = layers[0]
    for rows in (1, COMPILED_MAX_ROWS, COMPILED_MAX_ROWS + 1, 300):  # the kernel, then oneDNN
        x = torch.randn(rows, layer.in_features)
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias),
                                   rtol=1e-5, atol=1e-5)


def test_decode_steps_take_the_fused_layers_and_match_the_module_path(tiny_llama_dir, prompts):
    """Steps of a few decoding rows run each layer in one compiled call; switching the fused path off
    gives the same greedy tokens."""
    engine = Engine.from_model(tiny_llama_dir, max_model_len=256, attention_backend="cpu", token_budget=64,
                               chunk_size=16)
    model = engine.runner.model
    assert model.fused_layers is not None and len(model.fused_layers) == model.config.num_hidden_layers
    calls = []
    fused = model.fused_layers
    model.fused_layers = [_Counting(layer, calls) for layer in fused]
    fused_tokens = engine.generate(prompts[:3], GREEDY)
    assert calls and set(calls) <= {1, 2, 3}  # the decode steps of three rows, never a prefill chunk of 16
    model.fused_layers = None  # the module path
    assert engine.generate(prompts[:3], GREEDY) == fused_tokens


class _Counting:
    def __init__(self, inner, calls):
        self.inner, self.calls = inner, calls

    def forward(self, *args):
        self.calls.append(args[0].shape[0])
        return self.inner.forward(*args)
