"""The ``triton`` layout of MXFP4 routed experts: made once by :func:`prepare`, read by the MMA kernels.

Pure torch (no Triton import), so the reference backend can undo it expert by expert (:func:`checkpoint_expert`).

Why this layout: the MMA kernels (:mod:`.kernels`) multiply ``W [rows, K] @ x^T`` with the decoded weights as the
wide (M) operand of the tensor-core MMA held in registers. In the 16-bit MMA A-operand layout (NVIDIA
``mma.m16n8k16`` / ``wgmma`` register A, kWidth 2) the thread of lane ``4g + q`` of warp ``w`` owns, in every
64-row x 64-K unit, rows ``16w + g + 8h`` and K ``16s + 8c + 2q + e`` (h, c, e in {0, 1}, s in 0..3): 32 codes.
The layout stores exactly those 32 codes as one 16-byte chunk, so one 16-byte load per unit gives a thread its
operand, and the bits inside every 32-bit word are placed so that a few shifts and masks produce the bf16 pairs
(:data:`BIT_POSITIONS`). No element ever moves between threads.

Codes of one expert matrix (rows R, K): ``[R/64, K/128, 2, 128, 16]`` uint8 = [row group, K group, K unit,
chunk, byte]. Chunk ``ch = 32w + 4g + q``; word ``4*(2 s1 + s0)`` .. ``+3`` of a chunk covers k-step
``s = 2 s1 + s0`` (16 K: one quarter of the unit, inside one MX block). A word holds 8 codes, one per
(register ``j = 2c + h``, half ``e``) of the four bf16x2 registers the decode makes from it:

    row = 64 * group + 16 w + 8 h + g,   k = 128 * kgroup + 64 * unit + 32 s1 + 16 s0 + 8 c + 2 q + e

and the code's sign / e1 / e0 / m bits sit at ``BIT_POSITIONS[j][e]`` of the word (little-endian bytes). The
positions are chosen so that the decode needs 9 integer ops per word (the fewest for this output format; a search
over shifts, rotations and two-piece merges found no 8): with ``M = 0x81C081C0`` (sign + 3 magnitude bits of both
bf16 halves), register 0 is ``word & M``, 1 ``(word << 4) & M``, 2 ``rotl(word, 10) & M`` (one funnel shift) and
3 ``((word << 6) & 0x80C080C0) | ((word >> 2) & 0x01000100)``. Each result is the bf16 pair ``E2M1 * 2^-126``
(code 1 is the bf16 subnormal 2^-127), and one bf16x2 multiply by ``2^(s - 1)`` (exact while s <= 128, checked
here: ``fold``) gives ``E2M1 * 2^(s - 127)``.

Scales of one matrix: ``[R/64, K/128, 32, 8]`` uint8: the 8 E8M0 bytes thread (w, g) needs per K group,
``byte = 4 unit + 2 h + s1`` for rows ``16w + g + 8h`` and MX block ``4 kgroup + 2 unit + s1``: still one byte
per 32 weights, read as one 8-byte load per 128 K (the four lanes q of a row share it). In each 32-bit half,
``& 0x00FF00FF`` (``s1 = 0``) or ``>> 8`` then that mask (``s1 = 1``) puts the scales of rows r and r + 8 in the
two 16-bit halves, the register one word's decode multiplies by.

w13 rows are re-ordered before the swizzle so that row group ``2j`` holds gate rows ``64j .. 64j + 63`` and group
``2j + 1`` the matching up rows: one 128-row tile has both halves of 64 outputs and SiTU runs in the epilogue.
Sizes are padded with zero codes and scale bytes to N multiples of 64, Kout and K multiples of 128.
"""

from __future__ import annotations

import dataclasses

import torch

from rocm_k3.ops.moe_types import ExpertDims, ExpertWeights

LAYOUT = "triton"
ROW_GROUP = 64  # rows of one decode unit (one warpgroup's MMA M extent)
K_UNIT = 64  # K of one 16-byte chunk per thread
K_GROUP = 128  # K of one scale load (two units)
CHUNKS = 128  # chunks (threads of a warpgroup) per unit
MASK = 0x81C081C0  # sign + 3 magnitude bits of both bf16 halves
# (sign, e1, e0, m) bit of the word holding the code of decode register j, half e: BIT_POSITIONS[j][e]; the
# decode's shift of register j (module docstring) moves them to 15, 8, 7, 6 (+ 16 e)
BIT_POSITIONS = (((15, 8, 7, 6), (31, 24, 23, 22)),  # word & M
                 ((11, 4, 3, 2), (27, 20, 19, 18)),  # (word << 4) & M
                 ((5, 30, 29, 28), (21, 14, 13, 12)),  # rotl(word, 10) & M
                 ((9, 10, 1, 0), (25, 26, 17, 16)))  # sign, e0, m from word << 6; e1 from word >> 2
FOLD_MAX_SCALE = 128  # E8M0 bytes up to this: bias and scale fold into one bf16 multiplier 2^(s - 1)
_EXPERT_CHUNK_BYTES = 1 << 28  # experts converted per step bounded by ~256 MB of checkpoint codes


@dataclasses.dataclass(frozen=True)
class TritonExperts:
    """The prepared tensors of one layer (``ExpertWeights.extras["triton"]``).

    w13 uint8 [E, 2 Np/64, Kp/128, 2, 128, 16] and w13_s uint8 [E, 2 Np/64, Kp/128, 32, 8] (gate/up interleaved
    per 64 rows); w2 uint8 [E, Kop/64, Np2/128, 2, 128, 16], w2_s likewise; Np = N padded to 64, Kp = K padded
    to 128, Kop = Kout padded to 128 (whole 128-row tiles), Np2 = N padded to 128. fold13 / fold2: every scale
    byte of that matrix is <= 128 (the one-multiply decode is exact).
    """

    w13: torch.Tensor
    w13_s: torch.Tensor
    w2: torch.Tensor
    w2_s: torch.Tensor
    fold13: bool
    fold2: bool


def _ceil(v: int, m: int) -> int:
    return (v + m - 1) // m * m


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> uint8 [..., K] one E2M1 code per element (low nibble = even k)."""
    return torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2)


def _pack_nibbles(nib: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K] codes -> uint8 [..., K/2] (low nibble = even element)."""
    pairs = nib.unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _place(nib: torch.Tensor, j: int, e: int) -> torch.Tensor:
    """int32 word bits of codes ``nib`` (int32) as decode register j, half e."""
    word = torch.zeros_like(nib)
    for bit, pos in zip((3, 2, 1, 0), BIT_POSITIONS[j][e]):
        word |= ((nib >> bit) & 1) << pos
    return word


def _take(words: torch.Tensor, j: int, e: int) -> torch.Tensor:
    """Inverse of :func:`_place`: the E2M1 codes (int32) held as register j, half e of int32 ``words``."""
    code = torch.zeros_like(words)
    for bit, pos in zip((3, 2, 1, 0), BIT_POSITIONS[j][e]):
        code |= ((words >> pos) & 1) << bit
    return code


def swizzle_matrix(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint (codes uint8 [E, R, K/2], scales uint8 [E, R, K/32]) with R % 64 == 0 and K % 128 == 0 ->
    (codes uint8 [E, R/64, K/128, 2, 128, 16], scales uint8 [E, R/64, K/128, 32, 8]) (module docstring)."""
    E, R, half_k = codes.shape
    K = 2 * half_k
    G, U = R // ROW_GROUP, K // K_GROUP
    nib = _nibbles(codes).to(torch.int32)
    # row = 64 grp + 16 w + 8 h + g ; k = 128 kg + 64 u + 32 s1 + 16 s0 + 8 c + 2 q + e
    t = nib.reshape(E, G, 4, 2, 8, U, 2, 2, 2, 2, 4, 2)  # E grp w h g kg u s1 s0 c q e
    t = t.permute(0, 1, 5, 6, 2, 4, 10, 7, 8, 9, 3, 11)  # E grp kg u w g q s1 s0 c h e
    words = torch.zeros(t.shape[:-3], dtype=torch.int32, device=codes.device)
    for c in range(2):
        for h in range(2):
            for e in range(2):
                words |= _place(t[..., c, h, e], 2 * c + h, e)
    out = words.reshape(E, G, U, 2, CHUNKS, 4).contiguous().view(torch.uint8)  # [E, G, U, 2, 128, 16]
    # scale of rows 16 w + g + 8 h, MX block 4 kg + 2 u + s1
    s = scales.reshape(E, G, 4, 2, 8, U, 2, 2).permute(0, 1, 5, 2, 4, 6, 3, 7)  # E grp kg w g u h s1
    return out, s.reshape(E, G, U, 32, 8).contiguous()


def unswizzle_matrix(chunks: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact inverse of :func:`swizzle_matrix`: back to (codes [E, R, K/2], scales [E, R, K/32])."""
    E, G, U = chunks.shape[:3]
    words = chunks.contiguous().view(torch.int32).reshape(E, G, U, 2, 4, 8, 4, 2, 2)  # E grp kg u w g q s1 s0
    nib = torch.empty(*words.shape, 2, 2, 2, dtype=torch.int32, device=chunks.device)  # ... c h e
    for c in range(2):
        for h in range(2):
            for e in range(2):
                nib[..., c, h, e] = _take(words, 2 * c + h, e)
    t = nib.permute(0, 1, 4, 10, 5, 2, 3, 7, 8, 9, 6, 11)  # E grp w h g kg u s1 s0 c q e
    codes = _pack_nibbles(t.reshape(E, G * ROW_GROUP, U * K_GROUP).to(torch.uint8)).contiguous()
    scales = s.reshape(E, G, U, 4, 8, 2, 2, 2).permute(0, 1, 3, 6, 4, 2, 5, 7)  # E grp w h g kg u s1
    return codes, scales.reshape(E, G * ROW_GROUP, U * 4).contiguous()


def _pad(codes: torch.Tensor, scales: torch.Tensor, rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero codes and scale bytes up to ``rows`` x ``k`` (padding multiplies to exact zeros; no copy if complete)."""
    E, R, half_k = codes.shape
    if R == rows and 2 * half_k == k:
        return codes, scales
    pc = torch.zeros(E, rows, k // 2, dtype=torch.uint8, device=codes.device)
    ps = torch.zeros(E, rows, k // 32, dtype=torch.uint8, device=codes.device)
    pc[:, :R, :half_k] = codes
    ps[:, :R, : scales.shape[2]] = scales
    return pc, ps


def _gate_up_rows(w: torch.Tensor, n: int, n_pad: int) -> torch.Tensor:
    """[E, 2N, C] (gate rows, then up rows) -> [E, 2 Np, C]: 64 gate rows, the same 64 up rows, and so on."""
    E, _, C = w.shape
    gate, up = w[:, :n], w[:, n:]
    if n_pad != n:
        gate = torch.cat([gate, torch.zeros(E, n_pad - n, C, dtype=w.dtype, device=w.device)], 1)
        up = torch.cat([up, torch.zeros(E, n_pad - n, C, dtype=w.dtype, device=w.device)], 1)
    return torch.stack([gate.reshape(E, -1, ROW_GROUP, C), up.reshape(E, -1, ROW_GROUP, C)], 2).reshape(E, 2 * n_pad, C)


def _swizzle_in_chunks(codes: torch.Tensor, scales: torch.Tensor, rows: int, k: int) -> tuple[torch.Tensor, ...]:
    """Pad and swizzle a few experts at a time (bounded temporaries); outputs allocated once."""
    E = codes.shape[0]
    per = max(1, _EXPERT_CHUNK_BYTES // max(1, codes[0].numel()))
    out_c = torch.empty(E, rows // ROW_GROUP, k // K_GROUP, 2, CHUNKS, 16, dtype=torch.uint8, device=codes.device)
    out_s = torch.empty(E, rows // ROW_GROUP, k // K_GROUP, 32, 8, dtype=torch.uint8, device=codes.device)
    for e0 in range(0, E, per):
        c, s = _pad(codes[e0 : e0 + per], scales[e0 : e0 + per], rows, k)
        out_c[e0 : e0 + per], out_s[e0 : e0 + per] = swizzle_matrix(c, s)
    return out_c, out_s


def prepare(weights: ExpertWeights) -> ExpertWeights:
    """MXFP4 experts (any layout) -> ``ExpertWeights.prepared`` in the ``triton`` layout (``extras["triton"]``).

    Only the re-laid tensors are kept (the returned weights do not reference the checkpoint tensors). Memory while
    converting: the input plus the output plus a bounded chunk of temporaries.
    """
    if weights.fmt != "mxfp4":
        raise ValueError(f"the triton layout is for MXFP4 experts, got fmt={weights.fmt!r}")
    src = weights.to_checkpoint()
    E, K, N, Kout = src.num_experts, src.hidden, src.intermediate, src.out_features
    n_pad, k_pad = _ceil(N, ROW_GROUP), _ceil(K, K_GROUP)
    kout_pad, n2_pad = _ceil(Kout, 2 * ROW_GROUP), _ceil(N, K_GROUP)
    c13, s13 = _gate_up_rows(src.w13, N, n_pad), _gate_up_rows(src.w13_scale, N, n_pad)
    w13, w13_s = _swizzle_in_chunks(c13, s13, 2 * n_pad, k_pad)
    del c13, s13
    w2, w2_s = _swizzle_in_chunks(src.w2, src.w2_scale, kout_pad, n2_pad)
    fold13 = int(src.w13_scale.max()) <= FOLD_MAX_SCALE if src.w13_scale.numel() else True
    fold2 = int(src.w2_scale.max()) <= FOLD_MAX_SCALE if src.w2_scale.numel() else True
    prepared = TritonExperts(w13, w13_s, w2, w2_s, fold13, fold2)
    return ExpertWeights.prepared("mxfp4", LAYOUT, ExpertDims(E, K, N, Kout, src.device), {LAYOUT: prepared})


def _experts(weights: ExpertWeights) -> TritonExperts:
    if weights.layout != LAYOUT or not isinstance(weights.extras.get(LAYOUT), TritonExperts):
        raise ValueError(f"weights are not in the {LAYOUT!r} layout (layout={weights.layout!r})")
    return weights.extras[LAYOUT]


def _restore(t: TritonExperts, dims: ExpertDims, sel: slice) -> tuple[torch.Tensor, ...]:
    """Checkpoint (w13, w13_scale, w2, w2_scale) of experts ``sel``."""
    N, K, Kout = dims.intermediate, dims.hidden, dims.out_features
    c13, s13 = unswizzle_matrix(t.w13[sel], t.w13_s[sel])  # [e, 2 Np, Kp/2]
    e = c13.shape[0]

    def gate_then_up(t: torch.Tensor) -> torch.Tensor:  # [e, 2 Np, C] interleaved per 64 rows -> [e, 2N, C]
        t = t.reshape(e, -1, 2, ROW_GROUP, t.shape[2])  # [e, Np/64, gate|up, 64, C]
        return torch.cat([t[:, :, h].reshape(e, -1, t.shape[-1])[:, :N] for h in (0, 1)], 1)

    w13, w13_s = gate_then_up(c13), gate_then_up(s13)
    c2, s2 = unswizzle_matrix(t.w2[sel], t.w2_s[sel])
    return (w13[:, :, : K // 2].contiguous(), w13_s[:, :, : K // 32].contiguous(),
            c2[:, :Kout, : N // 2].contiguous(), s2[:, :Kout, : N // 32].contiguous())


def checkpoint_expert(weights: ExpertWeights, e: int) -> tuple[torch.Tensor, ...]:
    """(w13 [2N, K/2], w13_scale [2N, K/32], w2 [Kout, N/2], w2_scale [Kout, N/32]) of expert ``e``."""
    return tuple(t[0] for t in _restore(_experts(weights), weights.dims, slice(e, e + 1)))


def to_checkpoint(weights: ExpertWeights) -> ExpertWeights:
    """The checkpoint-layout ``ExpertWeights`` of prepared weights (exact inverse of :func:`prepare`)."""
    return ExpertWeights("mxfp4", *_restore(_experts(weights), weights.dims, slice(None)))
