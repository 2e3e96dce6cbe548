"""Index maps of the FlyDSL expanded-heads MLA prefill (:mod:`.mla_prefill`), in plain Python (no FlyDSL import).

One wave owns BM = 16 query rows of one head and walks the segment's keys in blocks of BN = 4 kpl keys (kpl: the
K values one lane supplies per bf16 MFMA step: 4 for ``v_mfma_f32_16x16x16_bf16`` on gfx942, 8 for
``v_mfma_f32_16x16x32_bf16`` on gfx950). Lane l, lane group g = l // 16, column c = l % 16:

- scores are computed TRANSPOSED, S^T = K Q^T, as BN / 16 MFMA tiles of [16 keys, 16 queries]: the A operand is
  a key row (``qk_a_key``), the B operand a query row (c), both with the head-dim elements ``qk_dim``; C element
  i of tile t is key ``s_key(l, t, i)`` of the block for query c;
- the output is computed transposed too, O^T += V^T P^T, Dv / 16 tiles of [16 values, 16 queries], one MFMA
  step of BN keys per block: element j of the lane's B fragment is P^T[``pv_key(l, j)``, c], which is C element
  j % 4 of S^T tile j // 4 of the same lane, so the probabilities never leave the registers; the A fragment
  is V[``pv_key(l, j)``, 16 vt + c];
- C element i of output tile vt is value column ``16 vt + 4 g + i`` of query c.

Only ``+ - * // %`` are used, so the kernel (DSL integers) and the host tests (Python ints) share them.
"""

from __future__ import annotations

BM = 16  # query rows per wave (one MFMA tile)
TILE = 16
WAVE = 64
ARCH_KPL = {"gfx942": 4, "gfx950": 8}


def block_keys(kpl: int) -> int:
    """Keys per block: one MFMA step of the P^T V^T contraction (4 lane groups x kpl)."""
    return 4 * kpl


def qk_dim(lane, step, j, kpl: int):
    """Head-dim element of operand element ``j`` in MFMA step ``step`` of the Q K^T contraction (both operands)."""
    return step * 4 * kpl + (lane // TILE) * kpl + j


def qk_a_key(lane, tile):
    """Key (inside the block) whose row lane ``lane`` supplies as the A operand of S^T tile ``tile``."""
    return tile * TILE + lane % TILE


def s_key(lane, tile, i):
    """Key (inside the block) of C element ``i`` (0..3) of S^T tile ``tile`` held by ``lane`` (query lane % 16)."""
    return tile * TILE + (lane // TILE) * 4 + i


def pv_key(lane, j):
    """Key (inside the block) of element ``j`` (< kpl) of the lane's P^T / V^T fragments: S^T tile j // 4,
    element j % 4 (so a lane's S^T C fragments are its B fragment)."""
    return s_key(lane, j // 4, j % 4)


def out_col(lane, vtile, i):
    """Value column of C element ``i`` of output tile ``vtile`` held by ``lane`` (query lane % 16)."""
    return vtile * TILE + (lane // TILE) * 4 + i
