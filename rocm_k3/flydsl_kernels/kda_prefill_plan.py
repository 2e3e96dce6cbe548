"""Index maps and host-side chunk plan of the chunked FlyDSL KDA prefill, in plain Python (no FlyDSL import).

The kernels (:mod:`.kda_chunk_prep`, :mod:`.kda_chunk_intra`, :mod:`.kda_chunk_state`) build their lane ->
element arithmetic from these functions with DSL integers while tracing; the host tests call the same
functions with Python ints and check that every tile element is covered exactly once. Only ``+ - * // %``
are used inside the index maps.

Tiles (C = 64 tokens per chunk, K = V head dims; 256-lane workgroups in the intra kernel):

- intra pairs: wave w (of 4) owns row block I = w of the chunk's 64 x 64 pair matrices and their 16 x 16 tiles
  (I, J), J <= I, on MFMA 16x16x(4 kpl) (kpl = ``state_kpl``: bf16 operands for bf16 activations): lane l supplies
  row 16 I + l % 16 (A) and row 16 J + l % 16 (B) at the key channels ``intra_pair_dim``, and holds C element
  i = pair (16 I + 4 (l // 16) + i, 16 J + l % 16).
- inverses: lane ``tid`` < 64 owns column ``tid % 16`` of the inverse of diagonal block ``tid // 16``
  (``intra_inverse``), its 16 rows in registers.
- state walk: one wave owns a [K, STATE_BV] slice of one head's state as MFMA 16x16 C fragments (fp32);
  contractions step through rows in the order ``mfma_krow`` (below), which makes C fragments B operands. Its
  products run on bf16 MFMA 16x16x16 for bf16 activations (``state_kpl`` = 4 values per lane and step, the Triton
  twin's bf16 dots) and on fp32 MFMA 16x16x4 otherwise (1 value per lane and step).
"""

from __future__ import annotations

CHUNK = 64
LANES = 256  # workgroup of the intra kernel: 4 waves, one per row block (the state kernel is one 64-lane wave)
SUB = 16  # rows of a diagonal block of A (inverted by the intra kernel, substituted by the state walk)
STATE_BV = 16  # value columns per state-walk wave (one MFMA tile wide)


def intra_pair_dim(s, q, j, kpl: int):
    """Key channel of element ``j`` (< kpl) of MFMA step ``s`` of the pair sums for lane group ``q`` (A and B alike):
    each lane's kpl channels of a step are adjacent in a row."""
    return s * 4 * kpl + q * kpl + j


def intra_inverse(tid):
    """(diagonal block, column) of T_II = (I + A_II)^-1 that lane ``tid`` < 64 solves for."""
    return tid // SUB, tid % SUB


# --- state walk on MFMA 16x16x(4 kpl) (one wave per [K, 16] state slice) ---------------------------------
# Lane l supplies kpl values A[l % 16][k] and B[k][l % 16], k the contraction indices of lane group q = l // 16,
# and holds C[16 m + 4 q + i][l % 16] of 16-row output tile m in accumulator element i. Element j of step s of a
# contraction gives lane group q the index ``mfma_krow(s, q, j, kpl)``: then the C fragments of a [rows, 16]
# result (the state S, the corrected values V') are, element for element, the B fragments of the next product
# that contracts over those rows, with no data movement between the two (kpl = 4: C tile s is B step s).
STATE_KPL_BF16 = 4  # values per lane and step of v_mfma_f32_16x16x16_bf16 (both gfx942 and gfx950 have it)


def walk_operands(dtype: str) -> str:
    """Name of the walk's MFMA operand type for activations of ``dtype`` ('bf16' | 'f16' | 'f32'), which is also the
    type phase 2 writes the walk's intermediates in (Aqk, the A band, KB, QG, KD): bf16 for bf16 activations, as
    the Triton twin's dots and its bf16 intermediates; fp32 otherwise (the Triton twin's fp16 path keeps fp32
    dots too, since fp16 cannot hold its sub-block decay factors, but stores most of its intermediates in fp16)."""
    return "bf16" if dtype == "bf16" else "f32"


def state_kpl(dtype: str) -> int:
    """Values per lane and MFMA step of the state walk for activations of ``dtype``: 4 on bf16 operands
    (v_mfma_f32_16x16x16_bf16), 1 on fp32 operands (v_mfma_f32_16x16x4_f32)."""
    return STATE_KPL_BF16 if walk_operands(dtype) == "bf16" else 1


def mfma_krow(s, q, j=0, kpl: int = 1):
    """Contraction index of element ``j`` (< kpl) of MFMA step ``s`` for lane group ``q``: the row of C element
    e % 4 of tile e // 4, e = kpl s + j."""
    if kpl == 4:  # one step per 16-row tile (kept free of divisions: s may be a runtime value in the kernel)
        return 16 * s + 4 * q + j
    e = s * kpl + j
    return 16 * (e // 4) + 4 * q + e % 4


# --- host plan -------------------------------------------------------------------------------------------


def chunk_plan(bounds: list[int]) -> tuple[list[int], list[int], list[int]]:
    """(chunk_seq, chunk_start, seq_first_chunk) for cumulative sequence bounds ``bounds`` ([N+1] ints).

    Sequence i is cut into ceil(len_i / 64) chunks starting at bounds[i] + 64 c; chunk_seq / chunk_start
    list every chunk of the batch in order, seq_first_chunk [N+1] the index of each sequence's first chunk.
    Empty sequences own no chunk.
    """
    chunk_seq, chunk_start, first = [], [], [0]
    for i in range(len(bounds) - 1):
        for t0 in range(bounds[i], bounds[i + 1], CHUNK):
            chunk_seq.append(i)
            chunk_start.append(t0)
        first.append(len(chunk_seq))
    return chunk_seq, chunk_start, first


def off_grid_positions(bounds: list[int], positions: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Requested (i, p) whose state is not at a chunk end of sequence i: p % 64 != 0 and p != len_i."""
    return [(i, p) for i, p in positions if p % CHUNK and p != bounds[i + 1] - bounds[i]]


def inter_map(seq_first_chunk: list[int], positions: list[tuple[int, int]], num_chunks: int):
    """(map [num_chunks], source [M]): map[c] = the intermediate row written after chunk c (-1: none);
    a row that asks for the same state as an earlier one copies it from ``source[row]`` afterwards."""
    out = [-1] * num_chunks
    source = []
    for row, (i, p) in enumerate(positions):
        c = seq_first_chunk[i] + (p + CHUNK - 1) // CHUNK - 1  # the chunk that ends at p
        if out[c] < 0:
            out[c] = row
        source.append(out[c])
    return out, source
