"""Decode steps on the CPU: each Llama layer in one compiled call.

A decode step of a few rows reads every weight once and does little else, so on a CPU what the
step costs beyond the weights' read is Python: per layer, nine module calls, views, splits and
five kernel calls. :func:`fuse_decode_layers` binds each layer's weights once to a
:func:`cadenza.kernels.cpu.decode_layer`, which runs the same kernels in the same order in one
call; :class:`~cadenza.node.runner.models.llama.LlamaForCausalLM` takes that path for steps of at
most ``FUSED_MAX_ROWS`` rows (where the compiled linear kernel is the faster one) whose rows all
have at most :data:`cadenza.kernels.cpu.SHORT_ROW` query tokens, and the module path otherwise.
The outputs are the module path's to float rounding (tests/node/test_cpu_backend.py).
"""

from __future__ import annotations

import logging

from cadenza.kernels import cpu
from cadenza.node.runner.cpu_linear import COMPILED_MAX_ROWS

logger = logging.getLogger(__name__)

FUSED_MAX_ROWS = COMPILED_MAX_ROWS


def fuse_decode_layers(model) -> int:
    """Give an fp32 CPU Llama model (its linear layers already compiled) its fused decode layers.

    Returns:
        The number of layers fused.

    Raises:
        RuntimeError: a weight is not fp32 and contiguous (the caller checked the dtype).
    """
    cfg = model.config
    fused = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        fused.append(cpu.decode_layer(
            layer.input_layernorm.weight.detach(), attn.qkv_proj.weight, attn.qkv_proj.bias, attn.o_proj.weight,
            layer.post_attention_layernorm.weight.detach(), mlp.gate_up_proj.weight, mlp.gate_up_proj.bias,
            mlp.down_proj.weight, mlp.down_proj.bias, cfg.rms_norm_eps, attn.scale, attn.num_heads,
            attn.num_kv_heads, attn.head_dim))
    model.fused_layers = fused
    model.fused_max_rows, model.fused_max_query_len = FUSED_MAX_ROWS, cpu.SHORT_ROW
    logger.info("fused decode layers: %d (steps of up to %d rows of up to %d tokens)", len(fused), FUSED_MAX_ROWS,
                cpu.SHORT_ROW)
    return len(fused)
