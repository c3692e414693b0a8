"""Step time from a step's composition, by roofline: what the simulator's executor advances its
virtual clock by.

A step (one forward pass of a mixed batch) on a tensor-parallel group of ``tp`` devices costs, per
device, the sum of:

- **linear layers**: ``max(2 T P / tp / (peak x gemm_eff), P b / tp / (bw x mem_eff))`` for ``T``
  tokens over the layers' ``P`` weights of ``b`` bytes: weight-bandwidth-bound for a few decode
  rows, compute-bound for long prefill chunks (the crossover is the GPU's FLOP/byte ratio);
- **the LM head**: the same for the rows that sample only (logits are computed for them alone);
- **prefill attention**: ``4 A h d L / tp`` FLOPs for ``A`` query-key pairs (``prefill_attention_tokens``:
  each chunk's ``n (start + n/2)``), ``h`` heads of ``d``, ``L`` layers, at ``peak x attention_eff``;
- **decode attention**: reading the decode rows' KV, ``C x 2 h_kv d b L / tp`` bytes for ``C``
  context tokens, against its ``4 C h d L / tp`` FLOPs, whichever is slower;
- **tensor-parallel all-reduces**: two per layer of ``T x hidden x b`` bytes, ring algorithm
  (``2 (tp - 1) / tp`` of the message over the link) plus a latency each;
- **fixed costs**: the profile's per-step device overhead and the scheduler's host time per step
  and per row.

The terms are summed (no overlap assumed). This is the shape of the models in Vidur (MLSys'24,
per-operator) and DistServe's simulator (OSDI'24), with the per-operator profiles replaced by a
roofline and fitted efficiency factors. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

from cadenza.sim.hardware import HardwareProfile
from cadenza.sim.model_dims import ModelDims


@dataclass(frozen=True, slots=True)
class StepComposition:
    """What a step computes (tokens), as the scheduler's ``SchedulerOutput`` says.

    Attributes:
        prefill_tokens, decode_tokens: tokens of each kind.
        decode_context_tokens: tokens the decodes attend over (sum of their lengths).
        prefill_attention_tokens: query-key pairs of the chunks, ``sum n (start + n/2)``.
        num_rows: rows (requests) in the step.
        num_sampled: rows that sample (every decode, and the chunks that end a prompt).
    """

    prefill_tokens: int = 0
    decode_tokens: int = 0
    decode_context_tokens: int = 0
    prefill_attention_tokens: float = 0.0
    num_rows: int = 0
    num_sampled: int = 0

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens


@dataclass(frozen=True, slots=True)
class StepTime:
    """A step's predicted seconds, by term (see the module docstring)."""

    linear_s: float
    lm_head_s: float
    prefill_attention_s: float
    decode_attention_s: float
    allreduce_s: float
    fixed_s: float

    @property
    def total_s(self) -> float:
        return (self.linear_s + self.lm_head_s + self.prefill_attention_s + self.decode_attention_s
                + self.allreduce_s + self.fixed_s)


class Roofline:
    """The step-time model of one replica: a model on ``tp`` devices of one hardware profile.

    Args:
        dims: the model's dimensions.
        hw: the device profile.
        tp: tensor-parallel degree (devices per replica).

    Raises:
        ValueError: ``tp`` below 1, or heads that do not split over ``tp``.
    """

    def __init__(self, dims: ModelDims, hw: HardwareProfile, tp: int = 1) -> None:
        if tp < 1:
            raise ValueError(f"tp: must be >= 1, got {tp}")
        if dims.num_heads % tp or (dims.num_kv_heads % tp and tp % dims.num_kv_heads):
            raise ValueError(f"tp={tp}: {dims.name}'s {dims.num_heads} heads / {dims.num_kv_heads} KV heads do not split")
        self.dims, self.hw, self.tp = dims, hw, tp

    def _matmul(self, tokens: float, params: float) -> float:
        """Seconds of ``tokens`` rows through ``params`` weights, split over the group."""
        hw, tp = self.hw, self.tp
        compute = 2.0 * tokens * params / tp / (hw.peak_flops * hw.gemm_efficiency)
        memory = params * hw.dtype_bytes / tp / (hw.memory_bandwidth * hw.memory_efficiency)
        return max(compute, memory) if tokens > 0 else 0.0

    def step_time(self, step: StepComposition) -> StepTime:
        """Predicted seconds of one step (per device of the group, which run in lockstep)."""
        d, hw, tp = self.dims, self.hw, self.tp
        layers, heads_dim = d.num_layers, d.num_heads * d.head_dim
        attn_flops = hw.peak_flops * hw.attention_efficiency
        prefill_attention = 4.0 * step.prefill_attention_tokens * heads_dim * layers / tp / attn_flops
        kv_heads = max(1, d.num_kv_heads // tp)  # a KV head replicated when tp exceeds them
        decode_bytes = step.decode_context_tokens * 2 * kv_heads * d.head_dim * hw.dtype_bytes * layers
        decode_attention = max(4.0 * step.decode_context_tokens * heads_dim * layers / tp / attn_flops,
                               decode_bytes / (hw.memory_bandwidth * hw.memory_efficiency))
        allreduce = 0.0
        if tp > 1 and step.num_tokens:
            message = step.num_tokens * d.hidden_size * hw.dtype_bytes
            allreduce = 2 * layers * (2 * (tp - 1) / tp * message / hw.link_bandwidth + hw.link_latency_s)
        fixed = hw.step_overhead_s + hw.host_per_step_s + hw.host_per_row_s * step.num_rows
        return StepTime(
            linear_s=self._matmul(step.num_tokens, layers * d.layer_params),
            lm_head_s=self._matmul(step.num_sampled, d.lm_head_params),
            prefill_attention_s=prefill_attention,
            decode_attention_s=decode_attention,
            allreduce_s=allreduce,
            fixed_s=fixed if step.num_tokens else 0.0,
        )

    def kv_capacity_tokens(self, memory_utilization: float = 0.9, activation_reserve: float = 0.05) -> int:
        """Tokens of KV cache a replica holds: the devices' memory at ``memory_utilization``, less
        the weights and an ``activation_reserve`` share, over the KV bytes a token takes per device.

        Raises:
            ValueError: the weights (and reserve) do not fit.
        """
        d, hw, tp = self.dims, self.hw, self.tp
        usable = hw.memory_bytes * (memory_utilization - activation_reserve)
        free = usable - d.num_params * hw.dtype_bytes / tp
        if free <= 0:
            raise ValueError(f"{d.name} on {tp} x {hw.name}: the weights do not fit ({d.num_params / 1e9:.1f}B params)")
        per_token = 2 * d.num_layers * max(1, d.num_kv_heads // tp) * d.head_dim * hw.dtype_bytes
        return int(free // per_token)
