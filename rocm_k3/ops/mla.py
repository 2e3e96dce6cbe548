"""MLA (multi-head latent attention, DeepSeek-V3 style, NoPE) over a paged latent cache, of any latent geometry.

Widths (the released K3 / Kimi Linear values in brackets): R = kv_lora_rank [512], P = qk_rope_head_dim [64],
Dn = qk_nope_head_dim [128], Dv = v_head_dim [128]. No op takes them as arguments: they are read from the
tensor shapes (:func:`prefill_geometry` for the prefill, whose shapes determine all four).

Cache layout (one tensor per MLA layer)::

    kv_cache     [num_blocks, block_size, R + P]   c_kv (already RMS-normed, R) | k_pe (P)   [576]
    block_table  int32 [N, max_blocks]             physical block of each logical block of sequence i
    slot_mapping int64 [T]                         slot = block * block_size + offset; -1 = do not write

Token ``p`` of sequence ``i`` lives at ``kv_cache[block_table[i, p // block_size], p % block_size]``.

K3 uses no rotary embedding: the P "rope" dims of q and the shared k_pe are used exactly as given, never
rotated, so no op takes positions. The per-head up-projection ``kv_b_weight [H * (Dn + Dv), R]`` holds, for
head h, rows ``h*(Dn+Dv) : h*(Dn+Dv)+Dn`` = W_uk (c_kv -> k_nope) and the next Dv rows = W_uv (c_kv -> v).

Ops:
- :func:`mla_write_cache` stores the latents of new tokens (in place).
- :func:`mla_prefill` expands k/v from the cached latents and runs causal attention (q = new tokens, which are the
  last ones of each sequence's context: chunked prefill and prefix hits read earlier context from the cache).
- :func:`mla_decode` attends in the absorbed R-d latent space (the caller folds W_uk into q and applies W_uv to
  the output).

Public functions check shapes, dtypes and devices only (no device syncs, so they stay graph-capturable). The
reference implementations additionally check the index VALUES (slot range, block ids, seq_lens against the
block table capacity, cu_seqlens_q consistency) and raise ValueError; kernel backends trust them.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch

from rocm_k3.ops import registry

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PREFILL_Q_CHUNK = 256  # reference prefill: queries per score block

# A chunk of at least this many queries takes the expanded kernel. Measured on the H200 (2026-12-04, 12 heads, bf16,
# benchmarks/RESULTS.md): the expanded kernel is 1.56x faster at n = 128 of L = 4096 and 2.60x at n = 128 of
# L = 32768, 0.79x (slower) at n = 64 of L = 4096 (2.57x at n = 64 of L = 32768).
EXPANDED_MIN_QUERIES = 128
SEGMENT_KEYS = 32768  # keys expanded per pass: workspace H * (Dn + Dv) * 2 B per key (12 heads: 192 MiB)


# ----------------------------------------------------------------------------------------------------------
# boundary validation (shapes, dtypes, devices)
# ----------------------------------------------------------------------------------------------------------
def _tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _float(name: str, t: object) -> torch.Tensor:
    t = _tensor(name, t)
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must have dtype float32, bfloat16 or float16, got {t.dtype}")
    return t


def _int(name: str, t: object, dtype: torch.dtype) -> torch.Tensor:
    t = _tensor(name, t)
    if t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    return t


def _shape(name: str, t: torch.Tensor, expected: Sequence[int | None], spec: str) -> None:
    """``expected`` holds a size per dim, None = any; ``spec`` is the symbolic shape for the message."""
    ok = t.dim() == len(expected) and all(e is None or e == s for e, s in zip(expected, t.shape))
    if not ok:
        raise ValueError(f"{name} must have shape {spec}, got {list(t.shape)}")


def _same_device(ref_name: str, ref: torch.Tensor, **others: torch.Tensor) -> None:
    for name, t in others.items():
        if t.device != ref.device:
            raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}; all must share a device")


class MLAGeometry(NamedTuple):
    """The latent widths of one MLA call (see the module docstring)."""

    kv_lora_rank: int  # R: c_kv width
    rope: int  # P: k_pe / q_pe width
    nope: int  # Dn: per-head no-position query / key width
    v: int  # Dv: per-head value width

    @property
    def latent(self) -> int:
        return self.kv_lora_rank + self.rope


def prefill_geometry(q: torch.Tensor, kv_cache: torch.Tensor, kv_b_weight: torch.Tensor) -> MLAGeometry:
    """The widths of a prefill from ``q [T, H, Dn + P]``, ``kv_cache [.., .., R + P]``, ``kv_b [H * (Dn + Dv), R]``.

    R = kv_b's columns, P = cache width - R, Dn = q width - P, Dv = kv_b rows / H - Dn; each must be >= 1
    (ValueError naming the tensor otherwise).
    """
    num_heads, q_width = q.shape[1], q.shape[2]
    rows, lora = kv_b_weight.shape
    rope = kv_cache.shape[2] - lora
    if rope < 1:
        raise ValueError(
            f"kv_cache must have shape [num_blocks, block_size, {lora} + rope] with rope >= 1 (kv_lora_rank {lora} "
            f"from kv_b_weight's columns), got {list(kv_cache.shape)}"
        )
    nope = q_width - rope
    if nope < 1:
        raise ValueError(
            f"q must have shape [T, H, qk_nope + {rope}] with qk_nope >= 1 (rope {rope} from kv_cache), got "
            f"{list(q.shape)}"
        )
    if rows % num_heads or rows // num_heads <= nope:
        raise ValueError(
            f"kv_b_weight must have shape [H * ({nope} + v_head_dim), {lora}] with v_head_dim >= 1 for H = "
            f"{num_heads} (qk_nope {nope} from q), got {list(kv_b_weight.shape)}"
        )
    return MLAGeometry(lora, rope, nope, rows // num_heads - nope)


def _check_cache(kv_cache: object) -> torch.Tensor:
    kv_cache = _float("kv_cache", kv_cache)
    _shape("kv_cache", kv_cache, (None, None, None), "[num_blocks, block_size, kv_lora_rank + rope]")
    if kv_cache.shape[1] == 0:
        raise ValueError("kv_cache block_size (dim 1) must be >= 1, got 0")
    if kv_cache.shape[2] < 2:
        raise ValueError(f"kv_cache must hold c_kv and k_pe (width >= 2) per token, got {list(kv_cache.shape)}")
    return kv_cache


def _check_paged(kv_cache: object, block_table: object, seq_lens: object, n: int) -> None:
    """Cache layout, block_table int32 [N, max_blocks] and seq_lens int32 [N] for N = n sequences."""
    _check_cache(kv_cache)
    block_table = _int("block_table", block_table, torch.int32)
    seq_lens = _int("seq_lens", seq_lens, torch.int32)
    _shape("block_table", block_table, (n, None), f"[N, max_blocks] with N = {n}")
    _shape("seq_lens", seq_lens, (n,), f"[N] with N = {n}")


def _check_scale(scale: object, required: bool) -> None:
    if scale is None and not required:
        return
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float{'' if required else ' or None'}, got {type(scale).__name__}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be finite and > 0, got {scale}")


# ----------------------------------------------------------------------------------------------------------
# value checks (reference only: they read index tensors on the host)
# ----------------------------------------------------------------------------------------------------------
def _check_paged_values(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                        min_len: int = 0) -> list[int]:
    """Check that every sequence fits its block-table row and only names existing blocks; return seq_lens.

    Raises ValueError naming the sequence. Reads the index tensors on the host (a device sync).
    """
    num_blocks, block_size = kv_cache.shape[0], kv_cache.shape[1]
    max_blocks = block_table.shape[1]
    lens = [int(x) for x in seq_lens.tolist()]
    table = block_table.cpu()
    for i, length in enumerate(lens):
        if length < min_len:
            raise ValueError(f"seq_lens[{i}] must be >= {min_len}, got {length}")
        used = -(-length // block_size)  # ceil
        if used > max_blocks:
            raise ValueError(
                f"block_table too small: seq_lens[{i}] = {length} needs {used} blocks of {block_size} tokens, "
                f"but block_table has {max_blocks} columns"
            )
        row = table[i, :used]
        if used and (int(row.min()) < 0 or int(row.max()) >= num_blocks):
            raise ValueError(
                f"block_table[{i}, :{used}] holds block ids outside [0, {num_blocks}): {row.tolist()}"
            )
    return lens


def _check_cu_seqlens_values(cu_seqlens_q: torch.Tensor, total: int, lens: list[int]) -> list[int]:
    cu = [int(x) for x in cu_seqlens_q.tolist()]
    if cu[0] != 0 or cu[-1] != total:
        raise ValueError(f"cu_seqlens_q must start at 0 and end at T = {total}, got {cu}")
    for i, length in enumerate(lens):
        n = cu[i + 1] - cu[i]
        if n < 0:
            raise ValueError(f"cu_seqlens_q must be non-decreasing, got {cu}")
        if n > length:
            raise ValueError(
                f"sequence {i} has {n} query tokens but seq_lens[{i}] = {length}: the new tokens must already be "
                f"in the cache (write them with mla_write_cache first)"
            )
    return cu


def expand_segment(kv_cache: torch.Tensor, table_row: torch.Tensor, key0: int, count: int,
                   w: torch.Tensor, compute: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Latents of keys ``key0 .. key0 + count`` from their pages -> (``[count, H * (Dn + Dv)]`` expanded keys and
    values in ``compute``, ``[count, R + P]`` latents whose last P columns are k_pe)."""
    block_size = kv_cache.shape[1]
    pos = torch.arange(key0, key0 + count, device=kv_cache.device)
    latent = kv_cache[table_row[pos // block_size].long(), pos % block_size]  # [count, R + P]
    lora = w.shape[1]
    return latent[:, :lora].to(compute) @ w.t(), latent  # [count, H (Dn + Dv)]


def _gather_latents(kv_cache: torch.Tensor, table_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` cached latents of one sequence, fp32 [length, R + P]."""
    block_size = kv_cache.shape[1]
    pos = torch.arange(length, device=kv_cache.device)
    blocks = table_row.to(kv_cache.device)[pos // block_size].long()  # [length]
    return kv_cache[blocks, pos % block_size].float()  # [length, R + P]


# ----------------------------------------------------------------------------------------------------------
# references
# ----------------------------------------------------------------------------------------------------------
def _mla_write_cache_reference(latent: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    capacity = kv_cache.shape[0] * kv_cache.shape[1]
    if slot_mapping.numel():
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < -1 or hi >= capacity:
            raise ValueError(
                f"slot_mapping values must be -1 (skip) or in [0, {capacity}) for kv_cache "
                f"{list(kv_cache.shape)}, got range [{lo}, {hi}]"
            )
    keep = slot_mapping >= 0  # [T]
    flat = kv_cache.view(-1, kv_cache.shape[2])  # [num_blocks * block_size, R + P], shares storage
    flat[slot_mapping[keep]] = latent[keep].to(kv_cache.dtype)


def _mla_prefill_reference(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, kv_b_weight: torch.Tensor, *,
                           scale: float | None = None, gate: torch.Tensor | None = None) -> torch.Tensor:
    lens = _check_paged_values(kv_cache, block_table, seq_lens)
    cu = _check_cu_seqlens_values(cu_seqlens_q, q.shape[0], lens)
    geo = prefill_geometry(q, kv_cache, kv_b_weight)
    lora, nope = geo.kv_lora_rank, geo.nope
    scale = q.shape[2] ** -0.5 if scale is None else float(scale)
    num_heads = q.shape[1]
    w = kv_b_weight.float().view(num_heads, nope + geo.v, lora)  # [H, Dn + Dv, R]
    w_uk, w_uv = w[:, :nope], w[:, nope:]  # [H, Dn, R], [H, Dv, R]
    out = torch.zeros(q.shape[0], num_heads, geo.v, dtype=q.dtype, device=q.device)
    for i, length in enumerate(lens):
        q0, q1 = cu[i], cu[i + 1]  # new tokens: the last q1 - q0 of the L context positions
        if q0 == q1:
            continue
        latent = _gather_latents(kv_cache, block_table[i], length)  # [L, R + P]
        c_kv, k_pe = latent[:, :lora], latent[:, lora:]  # [L, R], [L, P]
        k_nope = torch.einsum("lc,hdc->hld", c_kv, w_uk)  # [H, L, Dn]
        v = torch.einsum("lc,hdc->hld", c_kv, w_uv)  # [H, L, Dv]
        k_pos = torch.arange(length, device=q.device)
        for c0 in range(q0, q1, _PREFILL_Q_CHUNK):  # bounds the [H, chunk, L] score tensor on long prompts
            c1 = min(c0 + _PREFILL_Q_CHUNK, q1)
            qc = q[c0:c1].float().transpose(0, 1)  # [H, c, Dn + P]
            scores = qc[..., :nope] @ k_nope.transpose(1, 2) + qc[..., nope:] @ k_pe.T  # [H, c, L]
            q_pos = torch.arange(c0 - q1 + length, c1 - q1 + length, device=q.device)  # absolute positions
            future = k_pos[None, :] > q_pos[:, None]  # [c, L]
            probs = torch.softmax((scores * scale).masked_fill(future, float("-inf")), dim=-1)  # [H, c, L]
            o = (probs @ v).transpose(0, 1)  # [c, H, Dv] fp32
            if gate is not None:
                o = o * torch.sigmoid(gate[c0:c1].float())
            out[c0:c1] = o.to(q.dtype)
    return out


def _mla_decode_reference(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                          block_table: torch.Tensor, seq_lens: torch.Tensor, *, scale: float) -> torch.Tensor:
    lens = _check_paged_values(kv_cache, block_table, seq_lens, min_len=1)
    lora = q_latent.shape[2]
    out = torch.empty_like(q_latent)  # [N, H, R]
    for i, length in enumerate(lens):
        latent = _gather_latents(kv_cache, block_table[i], length)  # [L, R + P]
        c_kv, k_pe = latent[:, :lora], latent[:, lora:]  # [L, R], [L, P]
        scores = q_latent[i].float() @ c_kv.T + q_pe[i].float() @ k_pe.T  # [H, L]
        probs = torch.softmax(scores * float(scale), dim=-1)  # [H, L]
        out[i] = (probs @ c_kv).to(q_latent.dtype)  # [H, R]
    return out


REFERENCE_IMPLS = {
    "mla_write_cache": _mla_write_cache_reference,
    "mla_prefill": _mla_prefill_reference,
    "mla_decode": _mla_decode_reference,
}


# ----------------------------------------------------------------------------------------------------------
# public ops
# ----------------------------------------------------------------------------------------------------------
def mla_write_cache(latent: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                    backend: str | None = None) -> None:
    """Store the latents of new tokens in the paged cache, in place.

    Args:
        latent: [T, R + P] (normed c_kv | k_pe), same dtype as ``kv_cache``.
        kv_cache: [num_blocks, block_size, R + P], contiguous; updated in place.
        slot_mapping: int64 [T]; token t goes to flat slot ``slot_mapping[t]`` (= block * block_size + offset),
            -1 skips the token (e.g. padding or a prefix-cache hit).
    """
    latent = _float("latent", latent)
    kv_cache = _check_cache(kv_cache)
    slot_mapping = _int("slot_mapping", slot_mapping, torch.int64)
    width = kv_cache.shape[2]
    _shape("latent", latent, (None, width), f"[T, {width}] to match kv_cache [num_blocks, block_size, {width}]")
    _shape("slot_mapping", slot_mapping, (latent.shape[0],), f"[T] with T = {latent.shape[0]}")
    if latent.dtype != kv_cache.dtype:
        raise TypeError(f"latent dtype {latent.dtype} must match kv_cache dtype {kv_cache.dtype}")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous (its flat slot index is block * block_size + offset)")
    _same_device("latent", latent, kv_cache=kv_cache, slot_mapping=slot_mapping)
    registry.dispatch("mla_write_cache", backend, latent, kv_cache, slot_mapping)


def mla_prefill(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
                seq_lens: torch.Tensor, kv_b_weight: torch.Tensor, *, scale: float | None = None,
                gate: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """Causal MLA attention of new tokens over their sequence's cached context, with expanded k/v.

    Args:
        q: [T, H, Dn + P] (nope | pe), new tokens of N sequences concatenated.
        kv_cache: [num_blocks, block_size, R + P]; must already hold every context token INCLUDING the new ones.
        block_table: int32 [N, max_blocks].
        cu_seqlens_q: int32 [N + 1]; sequence i's queries are rows ``cu_seqlens_q[i] : cu_seqlens_q[i+1]``.
        seq_lens: int32 [N]; context length of sequence i after this step (cached + new).
        kv_b_weight: [H * (Dn + Dv), R]; per head, Dn rows W_uk then Dv rows W_uv.
        scale: softmax scale, default (Dn + P)^-0.5.
        gate: optional output-gate logits [T, H, Dv] (K3's MLA output gate, any float dtype, last dim
            contiguous): the result is ``out * sigmoid(gate)``, applied in fp32 before the one rounding to q's
            dtype (fused into the kernel's epilogue where the backend can).

    The widths are read from the shapes (:func:`prefill_geometry`). Math (fp32), for sequence i with
    L = seq_lens[i] and n new tokens, query j at position ``L - n + j``::

        c_kv, k_pe = cache[:L, :R], cache[:L, R:]
        k_nope[h] = c_kv @ W_uk[h]^T  [L, Dn];  v[h] = c_kv @ W_uv[h]^T  [L, Dv]
        s[h, j, l] = scale * (q_nope[j, h] . k_nope[h, l] + q_pe[j, h] . k_pe[l]),  l <= L - n + j
        out[j, h] = softmax_l(s[h, j]) @ v[h]   (times sigmoid(gate[j, h]) with a gate)

    Returns: [T, H, Dv] in q's dtype.
    """
    q = _float("q", q)
    _shape("q", q, (None, None, None), "[T, H, qk_nope + rope]")
    cu_seqlens_q = _int("cu_seqlens_q", cu_seqlens_q, torch.int32)
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] < 2:
        raise ValueError(f"cu_seqlens_q must have shape [N + 1] with N >= 1, got {list(cu_seqlens_q.shape)}")
    n = cu_seqlens_q.shape[0] - 1
    _check_paged(kv_cache, block_table, seq_lens, n)
    kv_b_weight = _float("kv_b_weight", kv_b_weight)
    _shape("kv_b_weight", kv_b_weight, (None, None), "[H * (qk_nope + v_head_dim), kv_lora_rank]")
    prefill_geometry(q, kv_cache, kv_b_weight)
    if kv_cache.dtype != q.dtype:
        raise TypeError(f"kv_cache dtype {kv_cache.dtype} must match q dtype {q.dtype}")
    _check_scale(scale, required=False)
    _same_device("q", q, kv_cache=kv_cache, block_table=block_table, cu_seqlens_q=cu_seqlens_q,
                 seq_lens=seq_lens, kv_b_weight=kv_b_weight)
    kwargs = {"scale": scale}
    if gate is not None:  # only gated calls pass it: a backend without a gate keyword still serves the others
        gate = _float("gate", gate)
        v_dim = prefill_geometry(q, kv_cache, kv_b_weight).v
        _shape("gate", gate, (q.shape[0], q.shape[1], v_dim), f"[T, H, v_head_dim] = {[*q.shape[:2], v_dim]}")
        if gate.stride(-1) != 1:
            raise ValueError("gate must have a contiguous last dim")
        _same_device("q", q, gate=gate)
        kwargs["gate"] = gate
    return registry.dispatch("mla_prefill", backend, q, kv_cache, block_table, cu_seqlens_q, seq_lens, kv_b_weight,
                             **kwargs)


def mla_decode(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, *, scale: float, backend: str | None = None) -> torch.Tensor:
    """One-token-per-sequence MLA attention in the absorbed R-d latent space.

    Args:
        q_latent: [N, H, R] = q_nope[h] @ W_uk[h] (W_uk absorbed by the caller).
        q_pe: [N, H, P], same dtype as q_latent.
        kv_cache: [num_blocks, block_size, R + P], same dtype as q_latent.
        block_table: int32 [N, max_blocks].
        seq_lens: int32 [N], each >= 1 (the new token is already cached).
        scale: softmax scale (K3: (Dn + P)^-0.5, the scale of the unabsorbed attention).

    Math (fp32): ``s[h, l] = scale * (q_latent[h] . c_kv[l] + q_pe[h] . k_pe[l])`` over the seq_lens[i] cached
    tokens, ``out[h] = softmax_l(s[h]) @ c_kv``. The caller applies W_uv: ``o[h] = out[h] @ W_uv[h]^T``.

    Returns: [N, H, R] in q_latent's dtype.
    """
    q_latent = _float("q_latent", q_latent)
    _shape("q_latent", q_latent, (None, None, None), "[N, H, kv_lora_rank]")
    n, num_heads, lora = q_latent.shape
    q_pe = _float("q_pe", q_pe)
    _shape("q_pe", q_pe, (n, num_heads, None), f"[N, H, rope] = [{n}, {num_heads}, rope]")
    _check_paged(kv_cache, block_table, seq_lens, n)
    width = lora + q_pe.shape[2]
    if kv_cache.shape[2] != width:
        raise ValueError(
            f"kv_cache must have shape [num_blocks, block_size, {width}] (kv_lora_rank {lora} of q_latent + rope "
            f"{q_pe.shape[2]} of q_pe), got {list(kv_cache.shape)}"
        )
    for name, t in (("q_pe", q_pe), ("kv_cache", kv_cache)):
        if t.dtype != q_latent.dtype:
            raise TypeError(f"{name} dtype {t.dtype} must match q_latent dtype {q_latent.dtype}")
    _check_scale(scale, required=True)
    _same_device("q_latent", q_latent, q_pe=q_pe, kv_cache=kv_cache, block_table=block_table, seq_lens=seq_lens)
    return registry.dispatch("mla_decode", backend, q_latent, q_pe, kv_cache, block_table, seq_lens, scale=scale)
