"""Which part of each weight a tensor-parallel rank holds (Megatron-LM's split, as vLLM makes it).

A Llama layer is split over ``size`` ranks so that it needs two all-reduces (Shoeybi et al.,
"Megatron-LM", 2019, section 3; vLLM's ``ColumnParallelLinear``, ``RowParallelLinear`` and
``VocabParallelEmbedding``):

- **column-parallel** (the output features split): the fused q/k/v projection — each rank computes
  its own query heads and the KV heads they read — and the fused gate/up projection, its own slice
  of the intermediate size. No communication: attention and SiLU-and-mul are per head / per feature.
- **row-parallel** (the input features split): ``o_proj`` over the rank's heads and ``down_proj``
  over its slice of the intermediate size give partial sums, added by one all-reduce each. A bias
  of a row-parallel layer is added once (rank 0 holds it, the others hold zeros).
- **vocab-parallel**: the embedding and the LM head split the vocabulary, padded to a multiple of
  ``size`` (padding rows are zero and their logits are cut off): a token's embedding comes from the
  rank that holds its row (zeros elsewhere, then an all-reduce); the logits of each rank's slice are
  gathered on rank 0, which samples.
- **KV heads**: split like the query heads when there are at least as many as ranks; with fewer,
  each KV head is replicated on ``size / num_kv_heads`` consecutive ranks — the ranks whose query
  heads read it (GQA) — as vLLM does. Each rank's KV cache holds its own KV heads only.
- **replicated**: the RMSNorm weights and the RoPE table.

:class:`ShardPlan` says, for one rank, which rows (or columns) of each checkpoint tensor it loads
(:meth:`ShardPlan.slice_of`), so a rank reads only its shard from the safetensors files. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from cadenza.node.core.parallel import check_tensor_parallel
from cadenza.node.runner.models.config import ModelConfig

# checkpoint weight (after ``model.``) -> how it is split: column-parallel pieces of the fused q/k/v
# and gate/up weights, row-parallel weights (split on dim 1), vocab-parallel ones (dim 0).
_COLUMN = {"self_attn.q_proj": "q", "self_attn.k_proj": "kv", "self_attn.v_proj": "kv",
           "mlp.gate_proj": "mlp", "mlp.up_proj": "mlp"}
_ROW = ("self_attn.o_proj", "mlp.down_proj")
_VOCAB = ("embed_tokens", "lm_head")


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """One rank's share of a model.

    Attributes:
        rank, size: this rank and the tensor-parallel size.
        num_heads, num_kv_heads: query and KV heads on this rank.
        kv_head_start: the first (global) KV head this rank holds.
        intermediate_size: this rank's slice of the MLP's intermediate size.
        vocab_start, vocab_per_rank: this rank's rows of the (padded) vocabulary.
        vocab_size: the model's real vocabulary (logits past it are padding).
    """

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    kv_head_start: int
    head_dim: int
    intermediate_size: int
    vocab_start: int
    vocab_per_rank: int
    vocab_size: int

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int = 0, size: int = 1) -> "ShardPlan":
        """The plan of ``rank`` of ``size``.

        Raises:
            ConfigError: a size the model's heads or intermediate size do not split over
                (:func:`~cadenza.node.core.config.check_tensor_parallel`).
            ValueError: a rank outside ``[0, size)``.
        """
        check_tensor_parallel(size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size,
                              cfg.architecture)
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside [0, {size})")
        kv = cfg.num_key_value_heads
        kv_local = max(1, kv // size)
        # with fewer KV heads than ranks, rank r holds the one its query heads read: r * kv // size
        kv_start = rank * kv_local if kv >= size else rank * kv // size
        vocab_per_rank = -(-cfg.vocab_size // size)
        return cls(rank, size, cfg.num_attention_heads // size, kv_local, kv_start, cfg.head_dim,
                   cfg.intermediate_size // size, rank * vocab_per_rank, vocab_per_rank, cfg.vocab_size)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def slice_of(self, name: str) -> tuple[int, int, int] | None:
        """``(dim, start, stop)``: the part of checkpoint tensor ``name`` (``model.`` removed) this
        rank loads; None for a tensor every rank loads whole (norms, and everything at size 1).

        Vocab-parallel rows past the real vocabulary are not in the file: ``stop`` is capped at it
        and the rest of the rank's rows stay zero.
        """
        if self.size == 1:
            return None
        for src, kind in _COLUMN.items():
            if f".{src}." in name:
                if kind == "q":
                    return 0, self.rank * self.q_size, (self.rank + 1) * self.q_size
                if kind == "kv":
                    start = self.kv_head_start * self.head_dim
                    return 0, start, start + self.kv_size
                return 0, self.rank * self.intermediate_size, (self.rank + 1) * self.intermediate_size
        for src in _ROW:
            if f".{src}." in name:
                if name.endswith(".bias"):
                    return None  # added once: rank 0 keeps it, the model zeroes it elsewhere
                width = self.q_size if src == "self_attn.o_proj" else self.intermediate_size
                return 1, self.rank * width, (self.rank + 1) * width
        if name.startswith(_VOCAB):
            return 0, min(self.vocab_start, self.vocab_size), min(self.vocab_start + self.vocab_per_rank, self.vocab_size)
        return None

    @staticmethod
    def is_row_parallel_bias(name: str) -> bool:
        """A bias added after a row-parallel layer's all-reduce: held by rank 0 only."""
        return name.endswith(".bias") and any(f".{src}." in name or name.startswith(src + ".") for src in _ROW)
