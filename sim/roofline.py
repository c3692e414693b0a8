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
- **fixed costs**: the profile's per-step and per-row device overhead.

The terms are summed (no overlap between them assumed). The host **dispatches** the step while
the device runs it: an eager runner issues each kernel from Python, builds its inputs and waits
for sampling, ``dispatch_per_step_s + dispatch_per_row_s x rows`` (0 in a roofline profile, an
engine with no host time), and the step takes the longer of the device's time and the dispatch.
A step the runner **replays as a CUDA graph** (a profile with ``cuda_graphs``: decode-only steps
and steps with one bounded prefill chunk, :func:`replays_graph`) has no dispatch; what the host
still does — build and copy the inputs before the launch, launch, read the sampled tokens after —
``graph_per_step_s + graph_per_row_s x rows``, is serial with the device and adds to its time.
The scheduler's host time per step and per row comes before and adds. Within a term, compute
and memory traffic overlap on a GPU (the slower counts); a profile with ``overlap`` off adds them
(a CPU). This is the shape of the models in Vidur (MLSys'24, per-operator) and DistServe's
simulator (OSDI'24), with the per-operator profiles replaced by a roofline and fitted efficiency
factors. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from cadenza.node.core.config import CUDA_GRAPH_MAX_ROWS
from cadenza.node.core.parallel import check_tensor_parallel
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

    @property
    def prefill_rows(self) -> int:
        """Rows that prefill (chunks): every row but the decodes, which take one token each."""
        return self.num_rows - self.decode_tokens


def replays_graph(hw: HardwareProfile, step: StepComposition) -> bool:
    """Whether the runner replays ``step`` as a CUDA graph on ``hw``: the profile has
    ``cuda_graphs``, the step has at most ``CUDA_GRAPH_MAX_ROWS`` decode rows and decodes only or
    adds one prefill chunk of at most ``hw.graph_max_prefill_tokens`` tokens (the shapes the engine
    captures, :mod:`cadenza.node.runner.cuda_graphs`); any other step runs eagerly."""
    return (hw.cuda_graphs and step.prefill_rows <= 1 and step.decode_tokens <= CUDA_GRAPH_MAX_ROWS
            and step.prefill_tokens <= hw.graph_max_prefill_tokens)


def _add(compute: float, memory: float) -> float:
    return compute + memory


class UnitTerms(NamedTuple):
    """A step's roofline terms in seconds at 100 % of the peaks (see :meth:`Roofline.unit_terms`)."""

    linear_compute_s: float
    linear_memory_s: float
    lm_head_compute_s: float
    lm_head_memory_s: float
    prefill_attention_s: float
    decode_attention_compute_s: float
    decode_attention_memory_s: float
    allreduce_s: float


@dataclass(frozen=True, slots=True)
class StepTime:
    """A step's predicted seconds, by term (see the module docstring).

    The device terms add up to the device's time. ``dispatch_s`` is the host's time to issue an
    eager step (the runner's Python dispatch, input building, sampling's synchronisation): the step
    ends when both are done, so it takes the longer of the two. ``replay_s`` is a graphed step's
    host time (inputs built and copied, the graph launched, the sampled tokens read), serial with
    the device: it adds. One of the two is 0. ``runner_s`` is what the step log's ``seconds``
    measures; ``host_s`` (the scheduler's time) comes before the step and adds to ``total_s``.
    """

    linear_s: float
    lm_head_s: float
    prefill_attention_s: float
    decode_attention_s: float
    allreduce_s: float
    fixed_s: float
    dispatch_s: float = 0.0
    replay_s: float = 0.0
    host_s: float = 0.0

    @property
    def device_s(self) -> float:
        return (self.linear_s + self.lm_head_s + self.prefill_attention_s + self.decode_attention_s
                + self.allreduce_s + self.fixed_s)

    @property
    def runner_s(self) -> float:
        return max(self.device_s, self.dispatch_s) + self.replay_s

    @property
    def total_s(self) -> float:
        return self.runner_s + self.host_s


class Roofline:
    """The step-time model of one replica: a model on ``tp`` devices of one hardware profile.

    Args:
        dims: the model's dimensions.
        hw: the device profile.
        tp: tensor-parallel degree (devices per replica).

    Raises:
        ConfigError: a ``tp`` the engine would refuse for this model
            (:func:`~cadenza.node.core.parallel.check_tensor_parallel`; a ValueError).
    """

    def __init__(self, dims: ModelDims, hw: HardwareProfile, tp: int = 1) -> None:
        check_tensor_parallel(tp, dims.num_heads, dims.num_kv_heads, dims.intermediate_size, dims.name)  # the engine's rule
        self.dims, self.hw, self.tp = dims, hw, tp

    def unit_terms(self, step: StepComposition) -> UnitTerms:
        """The step's terms at the profile's peaks (every efficiency 1), compute and memory apart:
        what :meth:`step_time` weighs by the efficiency factors, and what a calibration fits them
        on (:mod:`cadenza.sim.calibrate`)."""
        d, hw, tp = self.dims, self.hw, self.tp
        flops, bandwidth = hw.peak_flops, hw.memory_bandwidth
        layers, heads_dim = d.num_layers, d.num_heads * d.head_dim
        linear_params, tokens = layers * d.layer_params, step.num_tokens
        kv_heads = max(1, d.num_kv_heads // tp)  # a KV head replicated when tp exceeds them
        allreduce = 0.0
        if tp > 1 and tokens:
            message = tokens * d.hidden_size * hw.dtype_bytes
            allreduce = 2 * layers * (2 * (tp - 1) / tp * message / hw.link_bandwidth + hw.link_latency_s)
        return UnitTerms(
            linear_compute_s=2.0 * tokens * linear_params / tp / flops,
            linear_memory_s=linear_params * hw.dtype_bytes / tp / bandwidth if tokens else 0.0,
            lm_head_compute_s=2.0 * step.num_sampled * d.lm_head_params / tp / flops,
            lm_head_memory_s=d.lm_head_params * hw.dtype_bytes / tp / bandwidth if step.num_sampled else 0.0,
            prefill_attention_s=4.0 * step.prefill_attention_tokens * heads_dim * layers / tp / flops,
            decode_attention_compute_s=4.0 * step.decode_context_tokens * heads_dim * layers / tp / flops,
            decode_attention_memory_s=(step.decode_context_tokens * 2 * kv_heads * d.head_dim * hw.dtype_bytes
                                       * layers / bandwidth),
            allreduce_s=allreduce,
        )

    def step_time(self, step: StepComposition) -> StepTime:
        """Predicted seconds of one step (per device of the group, which run in lockstep)."""
        hw, u = self.hw, self.unit_terms(step)
        a, m = hw.attention_efficiency, hw.memory_efficiency
        if hw.gemm_curve:
            g, g_head = hw.gemm_efficiency_at(step.num_tokens), hw.gemm_efficiency_at(step.num_sampled)
        else:
            g = g_head = hw.gemm_efficiency
        both = max if hw.overlap else _add
        if not step.num_tokens:
            return StepTime(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        rows = step.num_rows
        graphed = replays_graph(hw, step)
        return StepTime(
            linear_s=both(u.linear_compute_s / g, u.linear_memory_s / m),
            lm_head_s=both(u.lm_head_compute_s / g_head, u.lm_head_memory_s / m),
            prefill_attention_s=u.prefill_attention_s / a,
            decode_attention_s=both(u.decode_attention_compute_s / a, u.decode_attention_memory_s / m),
            allreduce_s=u.allreduce_s,
            fixed_s=hw.step_overhead_s + hw.device_per_row_s * rows,
            dispatch_s=0.0 if graphed else hw.dispatch_per_step_s + hw.dispatch_per_row_s * rows,
            replay_s=hw.graph_per_step_s + hw.graph_per_row_s * rows if graphed else 0.0,
            host_s=hw.host_per_step_s + hw.host_per_row_s * rows,
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
        return int(free // self.kv_bytes_per_token())

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token takes on each device of the group."""
        d = self.dims
        return 2 * d.num_layers * max(1, d.num_kv_heads // self.tp) * d.head_dim * self.hw.dtype_bytes
