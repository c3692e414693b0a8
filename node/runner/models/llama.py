"""Llama-family decoder over a flattened, paged mixed batch.

Covers Llama 2/3, SmolLM2, Mistral and Qwen2: GQA, RoPE (``rope_theta``, linear and Llama-3
scaling), RMSNorm, SwiGLU, tied or untied embeddings, optional q/k/v bias. The numerics follow
Hugging Face transformers' ``modeling_llama.py`` (the reference the tests compare against); the
batch layout follows vLLM: there is no batch dimension, only ``T`` tokens of many sequences,
with each layer's attention reading and writing the paged KV cache through an
:class:`~cadenza.node.runner.backend.KernelBackend` (torch references or Triton kernels).

Weights are loaded from ``*.safetensors`` with the ``safetensors`` library, or drawn from a seed
(:func:`random_weights`: a model of a real model's shapes without its files, for benchmarks). q/k/v
and gate/up projections are fused into one matmul each (``qkv_proj``, ``gate_up_proj``).

Tensor parallelism: built with a :class:`~cadenza.node.runner.tp_shards.ShardPlan` of ``size > 1``
and a :class:`~cadenza.node.runner.collectives.Collectives`, each rank's model holds its shard
(the plan's module docstring says which) and reads only that part of each checkpoint tensor; the
row-parallel ``o_proj`` and ``down_proj`` and the vocab-parallel embedding end in an all-reduce,
and :meth:`LlamaForCausalLM.compute_logits` gathers the vocabulary slices on rank 0.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from cadenza.node.runner.backend import AttentionMetadata, KernelBackend
from cadenza.node.runner.models.config import ModelConfig
from cadenza.node.runner.models.rope import cos_sin_cache
from cadenza.node.runner.tp_shards import ShardPlan

KVCache = tuple[torch.Tensor, torch.Tensor]  # k_cache, v_cache: [NB, BS, Hkv, D]


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, kernels: KernelBackend) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.kernels = kernels

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.kernels.rms_norm(x, self.weight, self.eps, residual)


def _no_reduce(x: torch.Tensor) -> torch.Tensor:
    return x


class Attention(nn.Module):
    """Self-attention over this rank's heads (all of them at tensor-parallel size 1); ``reduce``
    sums the row-parallel ``o_proj``'s partial outputs over the ranks."""

    def __init__(self, cfg: ModelConfig, kernels: KernelBackend, plan: ShardPlan, reduce=_no_reduce) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = plan.num_heads, plan.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5
        self.kernels = kernels
        self.reduce = reduce

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, cos_sin: torch.Tensor, kv: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # (T, Hq, D)
        k = k.view(t, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = self.kernels.rotary_embedding(positions, q, k, cos_sin)
        o = self.kernels.attention(q, k, v, kv[0], kv[1], meta, self.scale)  # (T, Hq, D)
        return self.reduce(self.o_proj(o.reshape(t, self.q_size)))


class MLP(nn.Module):
    """SwiGLU over this rank's slice of the intermediate size; ``reduce`` sums the row-parallel
    ``down_proj``'s partial outputs."""

    def __init__(self, cfg: ModelConfig, kernels: KernelBackend, plan: ShardPlan, reduce=_no_reduce) -> None:
        super().__init__()
        self.kernels = kernels
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * plan.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(plan.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.down_proj(self.kernels.silu_and_mul(self.gate_up_proj(x))))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: KernelBackend, plan: ShardPlan, reduce=_no_reduce) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.self_attn = Attention(cfg, kernels, plan, reduce)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.mlp = MLP(cfg, kernels, plan, reduce)

    def forward(self, positions, x, residual, cos_sin, kv, meta):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, cos_sin, kv, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head.

    Args:
        cfg: model shape.
        kernels: the kernel backend every layer calls.
        max_position: rows of the RoPE table (the served ``max_model_len``).
        plan: this rank's shard (default: the whole model, tensor-parallel size 1).
        collectives: the all-reduce and gather between the ranks (needed when ``plan.size > 1``).
    """

    def __init__(self, cfg: ModelConfig, kernels: KernelBackend, max_position: int, plan: ShardPlan | None = None,
                 collectives=None) -> None:
        super().__init__()
        self.config = cfg
        self.plan = plan = plan or ShardPlan.of(cfg)
        if plan.size > 1 and collectives is None:
            raise ValueError(f"a shard of tensor-parallel size {plan.size} needs its collectives")
        self.collectives = collectives
        reduce = _no_reduce if plan.size == 1 else collectives.all_reduce
        self.embed_tokens = nn.Embedding(plan.vocab_per_rank, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, kernels, plan, reduce) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, plan.vocab_per_rank, bias=False)
        table = cos_sin_cache(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("cos_sin", table, persistent=False)
        # Whole layers in one compiled call each, for steps of at most ``fused_max_rows`` rows of at
        # most ``fused_max_query_len`` tokens (set by runner/cpu_decode.py on the CPU backend).
        self.fused_layers: list | None = None
        self.fused_max_rows = self.fused_max_query_len = 0

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        """``input_ids, positions [T]`` -> final hidden states ``[T, hidden_size]``."""
        x = self._embed(input_ids)
        residual = None
        if (self.fused_layers is not None and x.shape[0] <= self.fused_max_rows
                and meta.max_query_len <= self.fused_max_query_len):
            for fused, (k_cache, v_cache) in zip(self.fused_layers, kv_caches):
                x, residual = fused.forward(x, residual, positions, self.cos_sin, k_cache, v_cache, meta.slot_mapping,
                                            meta.query_start_loc, meta.seq_lens, meta.block_tables)
        else:
            for layer, kv in zip(self.layers, kv_caches):
                x, residual = layer(positions, x, residual, self.cos_sin, kv, meta)
        x, _ = self.norm(x, residual)
        return x

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, hidden_size]``; vocab-parallel, a rank looks up the ids in its rows
        and the all-reduce adds the others' (no host read: a CUDA graph can record it)."""
        plan = self.plan
        if plan.size == 1:
            return self.embed_tokens(input_ids)
        local = input_ids - plan.vocab_start
        inside = (local >= 0) & (local < plan.vocab_per_rank)
        x = self.embed_tokens(torch.where(inside, local, torch.zeros_like(local)))
        return self.collectives.all_reduce(x.masked_fill_(~inside.unsqueeze(1), 0.0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``[R, hidden_size]`` -> fp32 logits ``[R, vocab_size]``. Vocab-parallel, every rank computes
        its slice and rank 0 gets them all (the others get None); every rank must call it."""
        logits = (self.lm_head(hidden) if self.lm_head is not None else hidden @ self.embed_tokens.weight.t()).float()
        if self.plan.size == 1:
            return logits
        parts = self.collectives.gather(logits)
        return None if parts is None else torch.cat(parts, dim=1)[:, : self.config.vocab_size]

    def untie_lm_head(self) -> None:
        """Give tied embeddings an LM head module of their own (the same weight tensor), so the
        head can be swapped for a faster layer like any other linear."""
        if self.lm_head is None:
            weight = self.embed_tokens.weight
            self.lm_head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device,
                                     dtype=weight.dtype)
            self.lm_head.weight = weight

    def load_weights(self, path: str | Path) -> None:
        """Load every ``*.safetensors`` file of a Hugging Face folder, fusing q/k/v and gate/up.

        Raises:
            FileNotFoundError: no safetensors file.
            ValueError: a weight is missing, unexpected or of the wrong shape (names it).
        """
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        plan = self.plan
        params = dict(self.named_parameters())
        if plan.size > 1:  # rows no file fills: the vocabulary's padding, and row-parallel biases off rank 0
            for name, param in params.items():
                if name.startswith(("embed_tokens", "lm_head")) or ShardPlan.is_row_parallel_bias(name):
                    param.data.zero_()
        loaded: set[str] = set()
        for file in files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    target = _target(name, self.config, plan)
                    if target is None:
                        continue
                    param_name, offset = target
                    if param_name not in params:
                        raise ValueError(f"{file.name}: unexpected weight {name}")
                    param = params[param_name]
                    if plan.rank and ShardPlan.is_row_parallel_bias(param_name):
                        loaded.add(f"{param_name}@{offset}")  # added once, by rank 0: zero here
                        continue
                    tensor = _read_shard(f, name, plan.slice_of(name.removeprefix("model.")))
                    dest = param.data if offset is None else param.data.narrow(0, offset, tensor.shape[0])
                    if plan.size > 1 and param_name.startswith(("embed_tokens", "lm_head")):
                        dest = dest.narrow(0, 0, tensor.shape[0])  # the last rank's padding rows stay zero
                    if dest.shape != tensor.shape:
                        raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not fit {param_name} {tuple(dest.shape)}")
                    dest.copy_(tensor)
                    loaded.add(f"{param_name}@{offset}")
        expected = {f"{n}@{o}" for n in params for o in _offsets(n, self.config, plan)}
        if missing := sorted(expected - loaded):
            raise ValueError(f"weights missing from {path}: {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))


def load_model(
    path: str | Path,
    cfg: ModelConfig,
    kernels: KernelBackend,
    max_position: int,
    dtype: torch.dtype,
    device: torch.device,
    weights_seed: int | None = None,
    plan: ShardPlan | None = None,
    collectives=None,
) -> LlamaForCausalLM:
    """Build the model without initialising it (meta device), then load its weights in place —
    from ``path``'s safetensors, or with ``weights_seed`` drawn by :func:`random_weights` (``path``
    is then not read). With a ``plan`` of tensor-parallel size > 1, this rank's shard only (drawn
    weights are then this rank's own draw: a benchmark's shapes, not a split of the whole model's).

    Raises:
        FileNotFoundError, ValueError: as :meth:`LlamaForCausalLM.load_weights`.
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg, kernels, max_position, plan, collectives)
    finally:
        torch.set_default_dtype(previous)
    model = model.to_empty(device=device)
    model.cos_sin = cos_sin_cache(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling).to(device)
    if weights_seed is None:
        model.load_weights(path)
    else:
        random_weights(model, weights_seed)
    model = model.eval().requires_grad_(False)
    if device.type == "cpu" and dtype == torch.float32:
        from cadenza.node.runner.cpu_linear import compile_linears, pack_linears

        model.untie_lm_head()
        if kernels.name == "cpu":
            from cadenza.node.runner.cpu_decode import fuse_decode_layers

            compile_linears(model, device, dtype)
            if model.plan.size == 1:  # a fused layer has no place for the all-reduces between its halves
                fuse_decode_layers(model)
        else:
            pack_linears(model, device, dtype)
    return model


@torch.no_grad()
def random_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Fill every parameter in place, drawn on its own device from a generator seeded with
    ``seed``: matrices and embeddings from N(0, ``std``²), norm weights 1, biases 0 — Hugging Face's
    Llama initialisation (``initializer_range`` 0.02), under which bf16 activations stay finite
    through a deep model. The same seed on the same device gives the same weights."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            param.zero_()
        elif param.dim() == 1:
            param.fill_(1.0)
        else:
            if param.device not in generators:
                generators[param.device] = torch.Generator(param.device).manual_seed(seed)
            param.normal_(0.0, std, generator=generators[param.device])


def _read_shard(f, name: str, part: tuple[int, int, int] | None) -> torch.Tensor:
    """Checkpoint tensor ``name``, or only ``part`` of it (``(dim, start, stop)``) read from the file."""
    if part is None:
        return f.get_tensor(name)
    dim, start, stop = part
    view = f.get_slice(name)
    return view[start:stop] if dim == 0 else view[:, start:stop]


def _shard_offsets(cfg: ModelConfig, plan: ShardPlan) -> dict[str, tuple[str, int]]:
    """Where each fused piece sits in its fused weight, in this rank's (local) sizes."""
    q, kv = plan.q_size, plan.kv_size
    return {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0),
        "self_attn.k_proj": ("self_attn.qkv_proj", q),
        "self_attn.v_proj": ("self_attn.qkv_proj", q + kv),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0),
        "mlp.up_proj": ("mlp.gate_up_proj", plan.intermediate_size),
    }


def _target(name: str, cfg: ModelConfig, plan: ShardPlan) -> tuple[str, int | None] | None:
    """Checkpoint name -> (our parameter name, row offset in a fused weight or None)."""
    if "rotary_emb" in name:
        return None
    if name == "lm_head.weight":
        return None if cfg.tie_word_embeddings else (name, None)
    name = name.removeprefix("model.")
    for src, (dst, offset) in _shard_offsets(cfg, plan).items():
        if f".{src}." in name:
            return name.replace(src, dst), offset
    return name, None


def _offsets(param_name: str, cfg: ModelConfig, plan: ShardPlan) -> list[int | None]:
    """The offsets at which a fused parameter is loaded (``[None]`` for an unfused one)."""
    fused = [off for dst, off in _shard_offsets(cfg, plan).values() if param_name.endswith(f"{dst}.weight") or param_name.endswith(f"{dst}.bias")]
    return fused or [None]
