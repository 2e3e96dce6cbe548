"""Output phase of the chunked KDA prefill when the state walk does not compute it (``SPLIT_OUTPUT``).

One program per (chunk, head, value block), all chunks in parallel::

    O = QG S_c + Aqk V'        [64, BV]

with S_c the state at the chunk's start and V' the corrected values, both written by the state walk
(:mod:`.chunk_state` with ``WITH_OUTPUT`` false) in the dot dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def chunk_output_kernel(
    qg_ptr, aqk_ptr, hbuf_ptr, vbuf_ptr,  # QG [T, H, K]; Aqk [T, H, 64]; S_c [NC, H, K, V]; V' [T, H, V]
    chunk_seq_ptr, chunk_start_ptr, cu_seqlens_ptr,  # chunk plan
    o_ptr,  # o [T, H, V]
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    DOT_T: tl.constexpr, PREC: tl.constexpr,
):
    BT: tl.constexpr = 64
    c = tl.program_id(0)
    h = tl.program_id(1)
    iv = tl.program_id(2)
    seq = tl.load(chunk_seq_ptr + c)
    t0 = tl.load(chunk_start_ptr + c).to(tl.int64)
    n = tl.minimum(tl.load(cu_seqlens_ptr + seq + 1), t0 + BT) - t0  # rows in this chunk
    rt = tl.arange(0, BT)
    rk = tl.arange(0, K)
    rv = iv * BV + tl.arange(0, BV)
    m = (rt < n)[:, None]
    qg = tl.load(qg_ptr + (t0 + rt)[:, None] * (H * K) + h * K + rk[None, :], mask=m, other=0.0).to(DOT_T)
    aqk = tl.load(aqk_ptr + (t0 + rt)[:, None] * (H * BT) + h * BT + rt[None, :], mask=m, other=0.0).to(DOT_T)
    s = tl.load(hbuf_ptr + (c * H + h).to(tl.int64) * (K * V) + rk[:, None] * V + rv[None, :]).to(DOT_T)
    offs_v = (t0 + rt)[:, None] * (H * V) + h * V + rv[None, :]  # [BT, BV]
    v_new = tl.load(vbuf_ptr + offs_v, mask=m, other=0.0).to(DOT_T)
    o = tl.dot(qg, s, input_precision=PREC) + tl.dot(aqk, v_new, input_precision=PREC)
    tl.store(o_ptr + offs_v, o.to(o_ptr.dtype.element_ty), mask=m)
