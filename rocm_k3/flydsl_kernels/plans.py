"""Work decompositions (thread -> element index maps) of the FlyDSL kernels, in plain Python.

The kernels build their index arithmetic from these functions, called with DSL integers while tracing;
the host tests call the very same functions with Python ints and check that every tile is covered
exactly once with the intended vector width. Only ``+ - * // %`` are used, so one definition serves both.
Nothing here imports FlyDSL.
"""

from __future__ import annotations

import dataclasses

WAVE = 64
_BLOCK_THREADS = (256, 128, 64)


@dataclasses.dataclass(frozen=True)
class RowPlan:
    """How a workgroup covers ``rows_per_block`` rows of ``D`` elements with ``vec``-wide accesses.

    Wide rows (D / vec >= 64): one row per workgroup of ``threads`` lanes, each lane loads ``tiles``
    vectors, vector ``i`` of lane ``t`` is row vector ``t + i * threads`` (coalesced per tile).
    Narrow rows (D / vec < 64, e.g. one 128-wide head): ``lanes_per_row`` lanes hold one row in a single
    vector each and a 256-lane workgroup holds ``256 / lanes_per_row`` rows; reductions stay inside the
    aligned lane group.
    """

    D: int
    vec: int
    threads: int
    lanes_per_row: int
    tiles: int
    rows_per_block: int

    def __post_init__(self) -> None:
        if self.threads % WAVE or self.threads > 256:
            raise ValueError(f"threads must be a multiple of {WAVE} up to 256, got {self.threads}")
        if self.lanes_per_row * self.tiles * self.vec != self.D:
            raise ValueError(f"plan does not tile D={self.D}: {self}")
        if self.rows_per_block * self.lanes_per_row != self.threads:
            raise ValueError(f"plan does not fill the workgroup: {self}")

    @property
    def waves(self) -> int:
        return self.threads // WAVE

    def row_of(self, tid):
        """Row (inside the block) handled by lane ``tid``."""
        return tid // self.lanes_per_row

    def vector_of(self, tid, tile):
        """Index of the ``vec``-wide vector of its row that lane ``tid`` handles in ``tile``."""
        return tid % self.lanes_per_row + tile * self.lanes_per_row


def row_plan(D: int, vec: int) -> RowPlan:
    """The RowPlan the norm / attn-res kernels use for rows of D elements and vec-wide accesses."""
    if D <= 0 or D % vec:
        raise ValueError(f"row length D={D} must be a positive multiple of the vector width {vec}")
    vectors = D // vec
    if vectors >= WAVE:
        for threads in _BLOCK_THREADS:
            if vectors % threads == 0:
                return RowPlan(D, vec, threads, threads, vectors // threads, 1)
        raise ValueError(f"D={D}: {vectors} vectors of {vec} are not a multiple of 64 lanes")
    if WAVE % vectors:
        raise ValueError(f"D={D}: {vectors} vectors of {vec} per row must divide a 64-lane wave")
    return RowPlan(D, vec, 256, vectors, 1, 256 // vectors)


def flat_vector_coord(idx, vectors_per_row, vec: int):
    """(row, first column) of flat vector ``idx`` when rows of ``vectors_per_row * vec`` elements are cut into
    ``vec``-wide vectors and numbered row-major (the element-wise kernels: one vector per lane)."""
    return idx // vectors_per_row, (idx % vectors_per_row) * vec


# --- KDA decode: one workgroup per (sequence, head) ------------------------------------------------------


KDA_LANES_PER_COLUMN = 2
KDA_HEAD_DIMS = (32, 64, 128)  # 2K lanes per workgroup: one to four waves


def kda_decode_lane(tid):
    """(channel c, half) of lane ``tid`` in the 2*K-lane KDA decode workgroup.

    The lane pair (2c, 2c+1) owns key channel c (both compute its conv/gate; the even lane writes) and
    value column c of the [K, V] state; lane ``half`` holds rows ``kda_decode_row(half, i, K)``, i < K/2.
    """
    return tid // KDA_LANES_PER_COLUMN, tid % KDA_LANES_PER_COLUMN


def kda_decode_row(half, i, K: int):
    """State row held in register ``i`` by the lane of the given half (rows split in two contiguous halves)."""
    return half * (K // KDA_LANES_PER_COLUMN) + i


# --- MoE GEMM tiles -------------------------------------------------------------------------------------
# MFMA 16x16 output tiles; a wave computes NT such tiles along N for one 16-row block of sorted tokens.
MOE_BLOCK_M = 16
MOE_K_GROUP = 128  # K elements one lane group consumes per pre-shuffled weight load (4 MX blocks of 32)
# "step" layout (gfx942): nibble p of a lane's dword holds the lane's K offset STEP_NIBBLE_K[p] (0..7 inside its
# 8 values of the MX block). The byte-lookup decode (bitcodes.e2m1x8_to_bf16_pairs) returns the bf16 pairs
# (n0, n2), (n4, n6), (n1, n3), (n5, n7), so with this order (n0, n2, n1, n3) and (n4, n6, n5, n7) are K offsets
# 0..3 and 4..7: the two MFMA 16x16x16 fragments of the block, as decoded. Self-inverse.
STEP_NIBBLE_K = (0, 2, 1, 3, 4, 6, 5, 7)
# gfx942 FP8 "step" fragments (kpl 8): byte j of the MFMA fragment is nibble STEP_FP8_NIBBLE[j] of the dword, the
# order bitcodes.e2m1x8_to_fnuz_words returns (even nibbles, then odd).
STEP_FP8_NIBBLE = (0, 2, 4, 6, 1, 3, 5, 7)


def mfma_c_coord(lane, i):
    """(row, col) of accumulator element ``i`` (0..3) held by ``lane`` in a 16x16 fp32 MFMA tile."""
    return (lane // 16) * 4 + i, lane % 16


def mfma_ab_row(lane):
    """Row of A (token) / column of B (output feature) whose operand values ``lane`` supplies."""
    return lane % 16


def moe_k_index(lane, group, step, j, layout: str, kpl: int):
    """K index of element ``j`` of the MFMA operand fragment of ``lane`` in MFMA step ``step`` of K group ``group``.

    A K group is 128 values = 4 MX blocks of 32; lane group ``q = lane // 16`` holds 32 of them, as 4
    dwords of 8 FP4 codes in the pre-shuffled weights. ``kpl`` is the per-lane K of one MFMA step:
    4 (16x16x16 bf16, gfx942), 8 (16x16x32 bf16 on gfx950, 16x16x32 fp8) or 32 (scaled 16x16x128).
    - layout "step": each MX block is consumed by whole MFMA steps (block = step // (8 // kpl)), lane
      group q taking 8 values of it: k = block*32 + q*8 + sub*kpl + j (kpl 4, bf16), or for kpl 8 (fp8, the
      fragment in decode order) k = block*32 + q*8 + STEP_NIBBLE_K[STEP_FP8_NIBBLE[j]]. One step never mixes
      MX blocks, so per-block scales can be applied to the fp32 result of the step (gfx942: weights for bf16 and fp8,
      activations for fp8).
    - layout "lane": lane group q owns MX block q: k = q*32 + step*kpl + j. A lane's fragment never
      mixes MX blocks, which is what the scaled MFMA (one E8M0 scale per lane and operand) expects.
    """
    q = lane // 16
    if layout == "step":
        if kpl not in (4, 8):
            raise ValueError(f"layout 'step' takes kpl 4 or 8, got {kpl}")
        if kpl == 8:
            return group * MOE_K_GROUP + step * 32 + q * 8 + STEP_NIBBLE_K[STEP_FP8_NIBBLE[j]]
        return group * MOE_K_GROUP + (step // 2) * 32 + q * 8 + (step % 2) * 4 + j
    if layout == "lane":
        if kpl not in (4, 8, 32):
            raise ValueError(f"layout 'lane' takes kpl 4, 8 or 32, got {kpl}")
        return group * MOE_K_GROUP + q * 32 + step * kpl + j
    raise ValueError(f"unknown K layout {layout!r}")


def moe_steps(kpl: int) -> int:
    """MFMA steps per 128-wide K group."""
    return MOE_K_GROUP // (4 * kpl)


def moe_dword_pos(step, j, layout: str, kpl: int):
    """(dword 0..3, nibble 0..7) of the lane's pre-shuffled weights holding fragment element ``j`` of ``step``.

    "lane": the lane's 32 values in fragment order (nibble = position). "step": dword = the step's MX block; kpl 8
    (fp8) fragments in decode order (STEP_FP8_NIBBLE), kpl 4 (bf16) fragments in K order (nibble STEP_NIBBLE_K of
    the offset).
    """
    flat = step * kpl + j  # position among the lane's 32 values of this group
    if layout == "step" and kpl == 4:
        return flat // 8, STEP_NIBBLE_K[flat % 8]
    if layout == "step":
        return flat // 8, STEP_FP8_NIBBLE[flat % 8]
    return flat // 8, flat % 8


def moe_dword_k(lane, group, d, p, layout: str):
    """K index stored in dword ``d`` nibble ``p`` of ``lane``'s pre-shuffled weights for K group ``group``."""
    if layout == "step":
        return group * MOE_K_GROUP + d * 32 + (lane // 16) * 8 + STEP_NIBBLE_K[p]
    return group * MOE_K_GROUP + (lane // 16) * 32 + d * 8 + p


def moe_scale_slot(lane, step, layout: str, kpl: int):
    """Which of the 4 scale bytes of a (row, K group) — MX blocks g*4 + 0..3 — applies to ``lane``'s fragment
    in ``step``: the step's block in layout "step" (a compile-time int), the lane group's block in "lane"."""
    if layout == "step":
        return moe_dword_pos(step, 0, layout, kpl)[0]
    return lane // 16


def route_expert(lane, slot, lanes: int):
    """Expert held by ``lane`` in register ``slot`` of the routing kernel (experts strided over the lanes)."""
    return lane + slot * lanes
