"""Plain-torch reference implementations of cadenza's kernels.

These are the ground truth the Triton kernels are tested against, and the engine's ``torch``
backend (CPU, or any device without Triton). Each function takes the same shapes as its kernel.
Notation: ``T`` tokens in the flattened (varlen) batch, ``S`` sequences (rows), ``Hq``/``Hkv``
query/KV heads, ``D`` head dim, ``NB`` KV blocks of ``BS`` token slots.

This module imports nothing of cadenza.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (Zhang & Sennrich, 2019), computed in fp32 as Hugging Face's ``LlamaRMSNorm``.

    Args:
        x: ``[T, H]``.
        weight: ``[H]``.
        eps: added to the mean square.
        residual: optional ``[T, H]``; when given, ``x + residual`` is normalised and also
            returned (the new residual stream), fusing the residual add.

    Returns:
        ``[T, H]`` in ``x``'s dtype, or ``(normed, x + residual)`` when ``residual`` is given.
    """
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, residual)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding (RoFormer, Su et al. 2021), GPT-NeoX "rotate half" layout.

    Args:
        positions: ``[T]`` int64 token positions.
        q: ``[T, Hq, D]``; k: ``[T, Hkv, D]``.
        cos_sin_cache: ``[max_position, D]`` fp32, ``cos`` in the first ``D/2`` columns and
            ``sin`` in the last (built with ``rope_theta`` and any ``rope_scaling`` applied).

    Returns:
        Rotated ``(q, k)`` as new tensors in the input dtype (the Triton kernel works in place).
    """
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)  # [T, D/2] each
    cos = torch.cat((cos, cos), dim=-1).unsqueeze(1)  # [T, 1, D]
    sin = torch.cat((sin, sin), dim=-1).unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        return (xf * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)

    return rotate(q), rotate(k)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation (Shazeer, 2020): ``silu(x[..., :I]) * x[..., I:]``.

    Args:
        x: ``[T, 2 * I]``, the fused gate and up projections.

    Returns:
        ``[T, I]``.
    """
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new keys and values into their cache slots, in place.

    Args:
        k, v: ``[T, Hkv, D]``.
        k_cache, v_cache: ``[NB, BS, Hkv, D]``.
        slot_mapping: ``[T]`` int64, slot ``block_id * BS + offset`` of each token.
    """
    nb, bs, h, d = k_cache.shape
    k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of a mixed prefill/decode batch over a paged KV cache.

    Row ``i`` has ``n_i = query_start_loc[i+1] - query_start_loc[i]`` new query tokens at the end
    of a sequence of ``seq_lens[i]`` tokens, all already written to the cache. Its query ``j``
    (position ``seq_lens[i] - n_i + j``) attends to keys ``0 .. seq_lens[i] - n_i + j``: full over
    the cached prefix, causal within the new tokens. GQA: query head ``h`` reads KV head
    ``h // (Hq / Hkv)``. Rows with one query token (decodes) are batched, in groups of similar
    length to bound padding; longer rows go one at a time. Softmax is computed in fp32 by ``scaled_dot_product_attention``'s math.

    Args:
        q: ``[T, Hq, D]``.
        k_cache, v_cache: ``[NB, BS, Hkv, D]``.
        query_start_loc: ``[S + 1]`` int, cumulative query lengths starting at 0.
        seq_lens: ``[S]`` int, tokens in each sequence including the new ones.
        block_tables: ``[S, max_blocks]`` int, block ids of each sequence in order.
        scale: softmax scale, usually ``D ** -0.5``.

    Returns:
        ``[T, Hq, D]`` in ``q``'s dtype.
    """
    bs = k_cache.shape[1]
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    num_rows = len(lens)
    decodes = sorted((i for i in range(num_rows) if starts[i + 1] - starts[i] == 1), key=lens.__getitem__)
    for group in _length_groups(decodes, lens):
        rows = torch.tensor(group, device=q.device)
        tokens = query_start_loc[:-1].index_select(0, rows)
        row_lens = seq_lens.index_select(0, rows)
        num_blocks = -(-lens[group[-1]] // bs)
        table = block_tables.index_select(0, rows)[:, :num_blocks]  # [R, nb]
        keys = _gather(k_cache, table)  # [R, Hkv, L, D]
        values = _gather(v_cache, table)
        mask = torch.arange(keys.shape[2], device=q.device)[None, :] < row_lens[:, None]  # [R, L]
        query = q.index_select(0, tokens).unsqueeze(2)  # [R, Hq, 1, D]
        o = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
        )
        out[tokens] = o.squeeze(2)
    attend_long_rows(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, out)
    return out


def attend_long_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    min_query_len: int = 2,
) -> None:
    """The rows of :func:`paged_attention` with at least ``min_query_len`` query tokens, one SDPA
    each, written into ``out [T, Hq, D]`` in place (other rows are left untouched)."""
    bs = k_cache.shape[1]
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i in range(len(lens)):
        s, e = starts[i], starts[i + 1]
        n = e - s
        if n < min_query_len:
            continue
        length = lens[i]
        num_blocks = -(-length // bs)
        table = block_tables[i : i + 1, :num_blocks]
        keys = _gather(k_cache, table)[:, :, :length]  # [1, Hkv, L, D]
        values = _gather(v_cache, table)[:, :, :length]
        query = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        if n == length:
            o = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:
            mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(diagonal=length - n)
            o = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        out[s:e] = o[0].transpose(0, 1)


def _length_groups(rows: list[int], lens: list[int]) -> list[list[int]]:
    """Split rows sorted by length into groups padded to at most ~2x their shortest member, so a
    few long sequences do not pad every short one to their length."""
    groups: list[list[int]] = []
    for i in rows:
        if groups and lens[i] <= max(2 * lens[groups[-1][0]], lens[groups[-1][0]] + 256):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _gather(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``[NB, BS, H, D]`` cache, ``[R, nb]`` table -> ``[R, H, nb * BS, D]``."""
    r, nb = table.shape
    _, bs, h, d = cache.shape
    blocks = cache.index_select(0, table.reshape(-1))  # [R * nb, BS, H, D]
    return blocks.view(r, nb * bs, h, d).transpose(1, 2)
