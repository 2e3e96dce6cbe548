"""Host wrapper of the FlyDSL expanded-heads MLA prefill (:mod:`.mla_prefill`) and its ``supports``.

The op is ``rocm_k3.ops.mla_prefill`` (with the optional output gate). This backend serves calls whose every
non-empty chunk has at least ``EXPANDED_MIN_QUERIES`` new queries (the expanded kernel's side of the crossover,
measured for the Triton twin on the H200; not measured on an AMD GPU); a call with a shorter chunk is declined,
so the registry runs it on the next backend (Triton's absorbed kernel, or the reference). ``supports`` reads
``cu_seqlens_q`` on the host for that (one sync, as the kernels' own host loop does).

Per sequence the context is walked in segments of ``SEGMENT_KEYS`` keys: ``expand_segment`` (the Triton twin's,
shared) gathers and expands them, and one launch per segment attends; the (max, sum, acc) state of the chunk's
queries is carried in fp32 buffers between segments. Compile-verified only (gfx942, gfx950).
"""

from __future__ import annotations

import torch

from rocm_k3.flydsl_kernels.ops_impl import lazy_builder, stream_of
from rocm_k3.ops.devices import device_info
from rocm_k3.ops.mla import EXPANDED_MIN_QUERIES, SEGMENT_KEYS, expand_segment, prefill_geometry

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16"}
_GATE_DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
_launcher = lazy_builder("rocm_k3.flydsl_kernels.mla_prefill", "build_mla_prefill_expanded")


def _config(q, kv_cache, kv_b_weight, gate, *, first: bool, last: bool):
    from rocm_k3.flydsl_kernels.mla_prefill import MlaPrefillConfig

    geo = prefill_geometry(q, kv_cache, kv_b_weight)
    return MlaPrefillConfig(device_info(q.device).arch, q.shape[1], geo.nope, geo.rope, geo.v, geo.kv_lora_rank,
                            _DTYPES[q.dtype], None if gate is None else _GATE_DTYPES[gate.dtype], first, last)


def mla_prefill_supports(q, kv_cache, block_table, cu_seqlens_q, seq_lens, kv_b_weight, *, scale=None, gate=None):
    if q.dtype not in _DTYPES:
        return False, f"the FlyDSL MLA prefill takes bf16/fp16 (MFMA operands), got {q.dtype}"
    if kv_cache.stride(-1) != 1:
        return False, "kv_cache must have a contiguous last dim"
    counts = torch.diff(cu_seqlens_q).tolist()
    short = [n for n in counts if 0 < n < EXPANDED_MIN_QUERIES]
    if short:
        return False, (f"chunks of fewer than {EXPANDED_MIN_QUERIES} queries ({short[:4]}) take the absorbed kernel, "
                       "which FlyDSL does not have")
    geo = prefill_geometry(q, kv_cache, kv_b_weight)
    if max(q.shape[1] * (geo.nope + geo.v), geo.latent) * SEGMENT_KEYS >= 2**31:
        return False, "a segment's expanded K/V would exceed int32 offsets"
    try:
        _config(q, kv_cache, kv_b_weight, gate, first=True, last=True)
    except (ValueError, KeyError) as exc:
        return False, str(exc)
    return True, "flydsl expanded-heads prefill"


def mla_prefill(q, kv_cache, block_table, cu_seqlens_q, seq_lens, kv_b_weight, *, scale=None, gate=None):
    """FlyDSL ``mla_prefill``: ``[T, H, Dv]`` in q's dtype, times ``sigmoid(gate)`` when a gate is given."""
    tokens, num_heads, q_width = q.shape
    geo = prefill_geometry(q, kv_cache, kv_b_weight)
    out = torch.zeros(tokens, num_heads, geo.v, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    scale = q_width ** -0.5 if scale is None else float(scale)
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    q = q.contiguous()
    g = out if gate is None else gate.contiguous()  # never read without a gate
    w = kv_b_weight.to(q.dtype)  # [H (Dn + Dv), R]
    unused = torch.empty(1, num_heads, geo.v, dtype=torch.float32, device=q.device)  # state of one-segment contexts
    for i, length in enumerate(lens):
        q0, n = cu[i], cu[i + 1] - cu[i]
        if n == 0:
            continue
        acc, ml = unused, unused
        if length > SEGMENT_KEYS:
            acc = torch.empty(n, num_heads, geo.v, dtype=torch.float32, device=q.device)  # [n, H, Dv]
            ml = torch.empty(n, num_heads, 2, dtype=torch.float32, device=q.device)  # [n, H, (max, sum)]
        for key0 in range(0, length, SEGMENT_KEYS):
            count = min(SEGMENT_KEYS, length - key0)
            kv, latent = expand_segment(kv_cache, block_table[i], key0, count, w, q.dtype)
            cfg = _config(q, kv_cache, kv_b_weight, gate, first=key0 == 0, last=key0 + count >= length)
            _launcher(cfg)(q, kv.view(count, num_heads, geo.nope + geo.v), latent.contiguous(), g, out, acc, ml,
                           q0, n, length - n, key0, count, scale, **stream_of(q))
    return out
