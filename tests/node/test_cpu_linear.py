"""oneDNN-packed linear layers: the same products as torch's, chosen only where they pay."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cadenza.node.runner import cpu_linear as packed_linear
from cadenza.node.runner.cpu_linear import PackedLinear, pack_linears

needs_onednn = pytest.mark.skipif(not packed_linear._available(), reason="this torch build has no oneDNN linear ops")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_computes_what_torchs_does(rows, bias):
    layer = nn.Linear(48, 80, bias=bias)
    x = torch.randn(2, rows, 48)
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear(layer.weight, layer.bias)(x), layer(x), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_only_the_shapes_where_packing_pays_are_packed(monkeypatch):
    model = nn.Sequential(nn.Linear(16, 32), nn.Sequential(nn.Linear(32, 16), nn.Linear(16, 32)))
    monkeypatch.setattr(packed_linear, "packing_pays", lambda weight: weight.shape == (32, 16))
    monkeypatch.setattr(packed_linear, "MIN_WEIGHT_BYTES", 0)
    monkeypatch.setattr(packed_linear, "_decided", {})
    choice = pack_linears(model, torch.device("cpu"), torch.float32)
    assert choice == {(32, 16): True, (16, 32): False}
    assert isinstance(model[0], PackedLinear) and isinstance(model[1][1], PackedLinear)
    assert isinstance(model[1][0], nn.Linear)


def test_nothing_is_packed_off_the_cpu_or_below_fp32():
    model = nn.Sequential(nn.Linear(8, 8))
    assert pack_linears(model, torch.device("cpu"), torch.bfloat16) == {} and isinstance(model[0], nn.Linear)
