"""Triton KDA kernels (rocm_k3/triton_kernels/kda) against the reference ops and the naive recurrence.

Tiers:
- ``interpret``: small fp32/fp16 shapes (T <= 150, H = 2, D = 32) under ``TRITON_INTERPRET=1`` on the CPU.
  Triton 3.6-3.9 read that variable at decoration time, and triton's own standard library is decorated when
  triton is first imported, so this module sets it before importing triton (a monkeypatch fixture would come
  too late). If triton was already imported in this process without it, the tier re-runs this module in a
  subprocess (``test_kda_interpret_tier_in_subprocess``) and the in-process copies skip.
- ``compile``: every KDA kernel cross-compiled for sm_90, gfx942 and gfx950 at K3 shapes in bf16
  (tests/triton_kda_compile_driver.py, fresh interpreter), asserting the matrix instructions of the dot kernels.
- ``cuda``: K3 shapes (H = 96 and the TP-8 shard H = 12, D = 128, bf16, T = 4096) on an NVIDIA GPU.

Tolerances (relative L2 error, tests/helpers.rel_err):
- fp32 kernels: 1e-5 (fp32 arithmetic, different summation order; measured ~1e-6).
- fp16 prefill in the interpreter: 5e-3 (q', k', W, U, QG, KD, Aqk travel in fp16: a few 2^-11 roundings).
- bf16 on the GPU: outputs 2e-2 and states 1e-2 for prefill (bf16 operands in the chunk dots, 2^-9 per rounding,
  several in a chain); decode y 1e-2 (one bf16 rounding of the output, fp32 math), decode state 1e-5 (fp32
  throughout); short conv 1e-2 (bf16 output), its conv state copied exactly (0).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

_GPU = torch.cuda.is_available() and torch.version.hip is None
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's import: see the module docstring

triton = pytest.importorskip("triton")

from rocm_k3.ops.kda import reference as ref  # noqa: E402
from rocm_k3.ops.kda.datatypes import KDAGateParams  # noqa: E402
from rocm_k3.ops.kda.naive import kda_recurrent_naive  # noqa: E402
from rocm_k3.triton_kernels.kda import KERNELS  # noqa: E402
from rocm_k3.triton_kernels.kda.gate import kda_gate_kernel  # noqa: E402
from rocm_k3.triton_kernels.runtime import interpreted  # noqa: E402
from tests.helpers import assert_rel, run_compile_driver, seeded  # noqa: E402

# in-process only when triton itself (its standard library) was imported under the interpreter too
_INTERPRETED = interpreted(kda_gate_kernel) and interpreted(triton.language.standard.zeros_like)
needs_interp = pytest.mark.skipif(
    not _INTERPRETED, reason="kernels are compiled in this process (GPU host, or triton imported before "
                             "TRITON_INTERPRET=1); the tier runs in test_kda_interpret_tier_in_subprocess")


def _randn(*shape: int, gen: torch.Generator, scale: float = 1.0, dtype: torch.dtype = torch.float32,
           device: str = "cpu") -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)


def _fn(op: str):
    return KERNELS[op][0]


def _supports(op: str):
    return KERNELS[op][1]


# ----------------------------------------------------------------------------------------------- shared checks
def _naive_per_sequence(q, k, v, g, beta, cu, state0, idx, has_init, scale):
    """Independent twin: the token-by-token recurrence (fp64) per sequence on activated inputs.
    Returns (o [T, H, V], {slot: final state}, list of per-sequence callables for prefix states)."""
    o = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    finals = {}
    for i in range(cu.numel() - 1):
        s, e = int(cu[i]), int(cu[i + 1])
        init = state0[int(idx[i])].double() if bool(has_init[i]) else None
        oi, fi = kda_recurrent_naive(q[s:e].double(), k[s:e].double(), v[s:e].double(), g[s:e].double(),
                                     beta[s:e].double(), scale, init)
        o[s:e] = oi
        finals[int(idx[i])] = fi
    return o, finals


def _prefix_state(q, k, v, g, beta, cu, state0, idx, has_init, scale, seq: int, p: int) -> torch.Tensor:
    s = int(cu[seq])
    init = state0[int(idx[seq])].double() if bool(has_init[seq]) else None
    sl = slice(s, s + p)
    return kda_recurrent_naive(q[sl].double(), k[sl].double(), v[sl].double(), g[sl].double(),
                               beta[sl].double(), scale, init)[1]


def _activated(q, k, beta, f, gate_params, qk_l2norm, beta_logits):
    """The inputs of the recurrence after the prefill's fused prologue, computed by the reference ops."""
    qf, kf = q.float(), k.float()
    if qk_l2norm:
        qf, kf = ref.l2norm(qf), ref.l2norm(kf)
    b = torch.sigmoid(beta.float()) if beta_logits else beta.float()
    g = f.float() if gate_params is None else ref.kda_gate(f, *gate_params)
    return qf, kf, g, b


# ------------------------------------------------------------------------------------------------ interpret tier
@pytest.mark.interpret
@needs_interp
def test_chunk_plan_without_sequences_interpret() -> None:
    """No sequence (cu_seqlens = [0]) plans no chunk even when rows are passed (nothing may read cu[-1])."""
    from rocm_k3.triton_kernels.kda.common import plan_chunks

    plan = plan_chunks(torch.zeros(1, dtype=torch.int32), 100, 32)
    assert plan.num_chunks == 0 and plan.seq_first_chunk.tolist() == [0]


def _host_plan(bounds: list[int], chunk: int) -> tuple[list[int], list[int], list[int]]:
    """(chunk_seq, chunk_start, seq_first_chunk) of the chunks in use, built on the host for comparison."""
    seqs, starts, first = [], [], [0]
    for i in range(len(bounds) - 1):
        n = -(-(bounds[i + 1] - bounds[i]) // chunk)
        seqs += [i] * n
        starts += [bounds[i] + j * chunk for j in range(n)]
        first.append(first[-1] + n)
    return seqs, starts, first


@pytest.mark.interpret
@needs_interp
@pytest.mark.parametrize("lengths,chunk", [
    ([4096], 64), ([37, 64, 49, 5], 64), ([0, 70, 0, 13], 64), ([0, 2, 0, 1, 5, 40], 32), ([65, 0, 0], 64),
    ([1] * 300 + [130, 0, 64], 64), ([64, 64, 64], 64)],
    ids=["one-full", "varlen", "empty-inside", "conv-block-32", "empty-tail", "300-seqs", "whole-chunks"])
def test_chunk_plan_interpret(lengths: list[int], chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """common.plan_chunks (on the device, no host read) against the plan built on the host: the chunks in use in
    order, seq_first_chunk exact, every other slot with no rows (sequence N - 1 from cu[N]); the slot count is the
    bound chunk_slots (exact for one sequence of whole chunks). 300 sequences take the kernel's narrow-block path
    ([BLOCK, NP] = [16, 512]). Outputs start poisoned (-7), so a slot not written fails."""
    from rocm_k3.triton_kernels.kda.common import chunk_slots, plan_chunks

    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    cu = torch.tensor(bounds, dtype=torch.int32)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *shape, **kw: empty(*shape, **kw).fill_(-7))
    plan = plan_chunks(cu, bounds[-1], chunk)
    monkeypatch.setattr(torch, "empty", empty)
    seqs, starts, first = _host_plan(bounds, chunk)
    used = len(seqs)
    bound = min(bounds[-1], (bounds[-1] + len(lengths) * (chunk - 1)) // chunk)  # sum ceil(l / c) <= this
    assert plan.num_chunks == chunk_slots(bounds[-1], len(lengths), chunk) == bound >= used
    if lengths == [4096]:
        assert plan.num_chunks == used == 64
    assert plan.chunk_seq[:used].tolist() == seqs
    assert plan.chunk_start[:used].tolist() == starts
    assert plan.seq_first_chunk.tolist() == first
    assert plan.chunk_seq[used:].tolist() == [len(lengths) - 1] * (plan.num_chunks - used)
    assert plan.chunk_start[used:].tolist() == [bounds[-1]] * (plan.num_chunks - used)


@pytest.mark.interpret
@needs_interp
@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["safe", "softplus"])
def test_kda_gate_interpret(lower_bound: float | None) -> None:
    gen = seeded(1)
    f, a_log, dt_bias = _randn(37, 2, 32, gen=gen), _randn(2, gen=gen, scale=0.5), _randn(64, gen=gen)
    assert_rel(_fn("kda_gate")(f, a_log, dt_bias, lower_bound), ref.kda_gate(f, a_log, dt_bias, lower_bound), 1e-5, "g")


@pytest.mark.interpret
@needs_interp
@pytest.mark.parametrize("with_state", [True, False], ids=["state", "nostate"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)], ids=["fp32", "fp16"])
@pytest.mark.parametrize("in_place", [False, True], ids=["contiguous", "column-slice"])
def test_short_conv_interpret(with_state: bool, dtype: torch.dtype, tol: float, in_place: bool) -> None:
    """column-slice: x is the middle columns of a wider projection output (rows 150 + 40 apart), read in place."""
    gen = seeded(2)
    C = 96
    cu = torch.tensor([0, 2, 70, 150], dtype=torch.int32)
    x, w = _randn(150, C, gen=gen, dtype=dtype), _randn(C, 4, gen=gen, scale=0.5, dtype=dtype)
    if in_place:
        wide = torch.full((150, C + 40), float("nan"), dtype=dtype)  # poison: a read outside the slice shows
        wide[:, 16:16 + C] = x
        x = wide[:, 16:16 + C]
    kw = {}
    if with_state:
        pool = _randn(5, C, 3, gen=gen, dtype=dtype)
        kw = dict(state_indices=torch.tensor([4, 1, 2], dtype=torch.int32),
                  has_initial_state=torch.tensor([True, False, True]))
        pool_tri, pool_ref = pool.clone(), pool.clone()
    y = _fn("short_conv")(x, w, cu, conv_state=pool_tri if with_state else None, **kw)
    y_ref = ref.short_conv(x, w, cu, conv_state=pool_ref if with_state else None, **kw)
    assert y.dtype == dtype
    assert_rel(y, y_ref, tol, "y")
    if with_state:
        assert torch.equal(pool_tri, pool_ref), "conv state slots differ (they are plain copies of inputs)"


@pytest.mark.interpret
@needs_interp
@pytest.mark.parametrize("width", [2, 4])
def test_short_conv_edge_sequences_interpret(width: int) -> None:
    """Empty sequences (with and without a history: the slot keeps its history / becomes zeros), sequences shorter
    than W-1 (the state shifts old history), a history on some sequences only; x a NaN-padded column slice."""
    gen = seeded(12)
    C, lens = 130, [0, 2, 0, 1, 5, 40]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    wide = torch.full((sum(lens), C + 7), float("nan"))
    wide[:, 3:3 + C] = _randn(sum(lens), C, gen=gen)
    x, w = wide[:, 3:3 + C], _randn(C, width, gen=gen, scale=0.5)
    pool = _randn(8, C, width - 1, gen=gen)
    kw = dict(state_indices=torch.tensor([6, 0, 3, 7, 1, 4], dtype=torch.int32),
              has_initial_state=torch.tensor([True, True, False, True, False, True]))
    pool_tri, pool_ref = pool.clone(), pool.clone()
    y = _fn("short_conv")(x, w, cu, conv_state=pool_tri, **kw)
    assert not y.isnan().any()
    assert_rel(y, ref.short_conv(x, w, cu, conv_state=pool_ref, **kw), 1e-5, "y")
    assert torch.equal(pool_tri, pool_ref), "conv state slots differ (they are plain copies of inputs)"


@pytest.mark.interpret
@needs_interp
@pytest.mark.parametrize("activation", ["silu", None], ids=["silu", "identity"])
def test_short_conv_update_interpret(activation: str | None) -> None:
    gen = seeded(3)
    C = 96
    x, w, pool = _randn(3, C, gen=gen), _randn(C, 4, gen=gen), _randn(6, C, 3, gen=gen)
    idx = torch.tensor([5, 0, 3], dtype=torch.int32)
    pool_tri, pool_ref = pool.clone(), pool.clone()
    y = _fn("short_conv_update")(x, w, pool_tri, idx, activation)
    assert_rel(y, ref.short_conv_update(x, w, pool_ref, idx, activation), 1e-5, "y")
    assert torch.equal(pool_tri, pool_ref)


# (id, lengths, dtype, gate, qk_l2norm, beta_logits, has_init, intermediate rows, o tol, state tol)
_PREFILL_CASES = [
    ("T150-H2-D32-fp32-safe-init", [150], torch.float32, -5.0, True, True, [True],
     [[0, 64], [0, 128], [0, 64]], 1e-5, 1e-5),  # a repeated row gets the same state
    ("T37+64+49-H2-D32-fp16-softplus", [37, 64, 49], torch.float16, None, True, True, [False, True, True],
     [[1, 64]], 5e-3, 5e-3),
    ("T100-H2-D32-fp32-rawg-probs", [100], torch.float32, "raw", False, False, [True], [], 1e-5, 1e-5),
    # empty sequences in the batch (no chunk of theirs; an empty one with an initial state keeps it)
    ("T0+70+0+13-H2-D32-fp32-safe-empty", [0, 70, 0, 13], torch.float32, -5.0, True, True,
     [True, False, False, True], [[1, 64]], 1e-5, 1e-5),
]


# Phase-1-3 paths of the Triton prefill: the prefill module settings each one sets ("4-launch": the column-split prep
# and a separate solve reading intra's KB, the default before session 19; "4-launch-unsplit": the prep walking its
# column slices and the solve reading k' and G; "-inverts": with INTRA_INVERTS, the diagonal blocks' inverses computed
# by the intra kernel for the solve; "solve-in-walk": SOLVE_IN_WALK, no solve launch (SOLVE_KB / INTRA_INVERTS off
# there: the setting overrides them); "-products": INVERT_BY_PRODUCTS; "-norms-in-intra": NORMS_IN_INTRA (the prep
# only gates and sums; the intra kernel normalises q, k itself and writes QG, KD); "-lean": with NORMS_IN_INTRA and
# BAND_IN_DOT_DTYPE (whose bf16 band only bf16 activations get: test_kda_prefill_bf16_band_interpret and the cuda
# tier); "-gate-factors": with GATE_FACTORS (bf16 activations only, forced at every dtype here). The default is
# "3-launch-lean-gate-factors" for bf16 activations (session 29; "3-launch-lean" from session 21, which fp16 / fp32
# activations still take; "3-launch-solve-in-walk-products" before))
# the four launches, every option named (off)
_FOUR = dict(PREP_SPLIT=True, SOLVE_KB=True, INTRA_INVERTS=False, SOLVE_IN_WALK=False, INVERT_BY_PRODUCTS=False,
             BAND_IN_DOT_DTYPE=False, NORMS_IN_INTRA=False, GATE_FACTORS=False, WALK_HORNER=False)
_PATHS = {
    "4-launch": _FOUR,
    "4-launch-intra-inverts": {**_FOUR, "INTRA_INVERTS": True},
    "4-launch-unsplit": {**_FOUR, "PREP_SPLIT": False, "SOLVE_KB": False},
    "3-launch-solve-in-walk": {**_FOUR, "SOLVE_KB": False, "SOLVE_IN_WALK": True},
    # prefill.INVERT_BY_PRODUCTS: the solve's and the intra kernel's diagonal inverses by products
    "4-launch-products": {**_FOUR, "INVERT_BY_PRODUCTS": True},
    "3-launch-solve-in-walk-products": {**_FOUR, "SOLVE_IN_WALK": True, "INVERT_BY_PRODUCTS": True},
    "3-launch-norms-in-intra": {**_FOUR, "SOLVE_IN_WALK": True, "INVERT_BY_PRODUCTS": True, "NORMS_IN_INTRA": True},
    "3-launch-lean": {**_FOUR, "SOLVE_IN_WALK": True, "INVERT_BY_PRODUCTS": True, "NORMS_IN_INTRA": True,
                      "BAND_IN_DOT_DTYPE": True},
    # the default without prefill.INTRA_MAXNREG's register cap on the intra kernel (before session 25)
    "3-launch-lean-uncapped": {**_FOUR, "SOLVE_IN_WALK": True, "INVERT_BY_PRODUCTS": True,
                               "NORMS_IN_INTRA": True, "BAND_IN_DOT_DTYPE": True, "INTRA_MAXNREG": None},
    # the default with tl.exp for every exponential (prefill.FAST_EXP off, before session 27)
    "3-launch-lean-exact-exp": {**_FOUR, "SOLVE_IN_WALK": True, "INVERT_BY_PRODUCTS": True, "NORMS_IN_INTRA": True,
                                "BAND_IN_DOT_DTYPE": True, "FAST_EXP": False},
    # prefill.GATE_FACTORS: the prep writes bf16 sub-block factors E and G_m instead of fp32 G (forced at every dtype
    # by _set_path: E then in the dot dtype, fp32 here)
    "3-launch-lean-gate-factors": {**_FOUR, "SOLVE_IN_WALK": True, "INVERT_BY_PRODUCTS": True, "NORMS_IN_INTRA": True,
                                   "BAND_IN_DOT_DTYPE": True, "GATE_FACTORS": True},
    # prefill.WALK_HORNER: the walk solves each chunk by whole-chunk products (forced at every dtype by _set_path)
    "3-launch-lean-horner": {**_FOUR, "SOLVE_IN_WALK": True, "INVERT_BY_PRODUCTS": True, "NORMS_IN_INTRA": True,
                             "BAND_IN_DOT_DTYPE": True, "GATE_FACTORS": True, "WALK_HORNER": True},
}
# the interpreter ignores the register cap (a launch option): paths that set INTRA_MAXNREG run on the GPU alone
_INTERP_PATHS = [p for p in _PATHS if "INTRA_MAXNREG" not in _PATHS[p]]


def _set_path(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """The path's prefill settings; a "-products" path inverts by products at every dtype here (the prefill does so
    for bf16 dots only, which the interpreter cannot run: test_fp32_inverses_row_by_row_for_correlated_keys_interpret
    checks that gate)."""
    from rocm_k3.triton_kernels.kda import prefill as tri_prefill

    for name, value in _PATHS[path].items():
        monkeypatch.setattr(tri_prefill, name, value)
    if _PATHS[path]["INVERT_BY_PRODUCTS"]:
        monkeypatch.setattr(tri_prefill, "invert_by_products", lambda dot_t: True)
    if _PATHS[path]["GATE_FACTORS"]:
        monkeypatch.setattr(tri_prefill, "gate_factors", lambda dot_t, norms_in, solve_in: norms_in and solve_in)
    if _PATHS[path]["WALK_HORNER"]:
        monkeypatch.setattr(tri_prefill, "walk_horner", lambda dot_t, solve_in: solve_in)


@contextlib.contextmanager
def _poisoned_buffers(monkeypatch: pytest.MonkeyPatch):
    """Every floating-point buffer torch.empty allocates inside the block starts as NaN (the prefill's scratch and
    outputs), so an element a kernel does not write fails; torch.empty is restored on leaving."""
    from tests.helpers import poisoned_like

    empty = torch.empty

    def nan_empty(*shape, **kw):
        t = empty(*shape, **kw)
        return poisoned_like(t) if t.dtype.is_floating_point else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    try:
        yield
    finally:
        monkeypatch.setattr(torch, "empty", empty)


def _prefill_inputs(lengths, dtype, gate, qk_l2norm, beta_logits, gen, device="cpu", H=2, D=32):
    T = sum(lengths)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=device)
    qk_scale = 1.0 if qk_l2norm else D**-0.5  # unnormalised q, k must stay small for a stable recurrence
    q = _randn(T, H, D, gen=gen, scale=qk_scale, dtype=dtype, device=device)
    k = _randn(T, H, D, gen=gen, scale=qk_scale, dtype=dtype, device=device)
    v = _randn(T, H, D, gen=gen, dtype=dtype, device=device)
    beta = _randn(T, H, gen=gen, dtype=dtype, device=device)
    if not beta_logits:
        beta = torch.sigmoid(beta.float()).to(dtype)
    if gate == "raw":  # the fp32 log-decay itself over K3's whole safe-gate range (-5, 0): the sub-block
        f = -torch.rand(T, H, D, generator=gen).mul(5.0).to(device)  # decay factors reach exp(+-40)
        params = None
    else:
        f = _randn(T, H, D, gen=gen, dtype=dtype, device=device)
        params = KDAGateParams(_randn(H, gen=gen, scale=0.5, device=device),
                               _randn(H * D, gen=gen, scale=0.5, device=device), gate)
    return q, k, v, f, beta, cu, params


@pytest.mark.interpret
@needs_interp
@pytest.mark.parametrize("case,path", [
    pytest.param(c, p, id=f"{c[0]}-{p}") for c in _PREFILL_CASES for p in _INTERP_PATHS])
def test_kda_prefill_interpret(case, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _set_path(monkeypatch, path)
    _, lengths, dtype, gate, qk_l2norm, beta_logits, has_init_l, inter_rows, o_tol, s_tol = case
    gen = seeded(4)
    q, k, v, f, beta, cu, params = _prefill_inputs(lengths, dtype, gate, qk_l2norm, beta_logits, gen)
    N, H, D = len(lengths), 2, 32
    pool = _randn(N + 2, H, D, D, gen=gen, scale=0.3)
    idx = torch.arange(N + 1, 0, -1, dtype=torch.int32)[:N]  # slots N+1, N, ...: never 0
    has_init = torch.tensor(has_init_l)
    positions = torch.tensor(inter_rows, dtype=torch.int32).view(-1, 2) if inter_rows else None
    assert _supports("kda_prefill")(q, k, v, f, beta, cu, pool, idx, has_init, gate_params=params,
                                    qk_l2norm=qk_l2norm, beta_logits=beta_logits,
                                    intermediate_positions=positions)[0]
    pool_tri = pool.clone()
    out = _fn("kda_prefill")(q, k, v, f, beta, cu, pool_tri, idx, has_init, gate_params=params,
                             qk_l2norm=qk_l2norm, beta_logits=beta_logits, intermediate_positions=positions)
    qa, ka, ga, ba = _activated(q, k, beta, f, params, qk_l2norm, beta_logits)
    scale = D**-0.5
    o_ref, finals = _naive_per_sequence(qa, ka, v.float(), ga, ba, cu, pool, idx, has_init, scale)
    assert out.o.dtype == dtype
    assert_rel(out.o, o_ref, o_tol, "o")
    for slot, fin in finals.items():
        assert_rel(pool_tri[slot], fin, s_tol, f"final state of slot {slot}")
    untouched = [s for s in range(pool.shape[0]) if s not in finals]
    assert torch.equal(pool_tri[untouched], pool[untouched]), "slots not in state_indices were modified"
    if positions is None:
        assert out.intermediate_states is None
    else:
        for r, (seq, p) in enumerate(inter_rows):
            want = _prefix_state(qa, ka, v.float(), ga, ba, cu, pool, idx, has_init, scale, seq, p)
            assert_rel(out.intermediate_states[r], want, s_tol, f"intermediate state ({seq}, {p})")


@pytest.mark.interpret
@needs_interp
@pytest.mark.parametrize("split_output,path", [(False, "4-launch"), (True, "4-launch"),
                                               (True, "3-launch-solve-in-walk"), (True, "3-launch-lean"),
                                               (True, "3-launch-lean-horner")],
                         ids=["fused-output", "split-output", "solve-in-walk-split-output", "lean-split-output",
                              "horner-split-output"])
def test_kda_prefill_matches_chunked_reference_interpret(split_output: bool, path: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Second twin: the reference backend's chunked kda_prefill on the same call (fp32, two sequences), with the
    output computed inside the state walk or by the separate output launch."""
    from rocm_k3.triton_kernels.kda import prefill as tri_prefill

    monkeypatch.setattr(tri_prefill, "SPLIT_OUTPUT", split_output)
    _set_path(monkeypatch, path)
    gen = seeded(5)
    q, k, v, f, beta, cu, params = _prefill_inputs([90, 41], torch.float32, -5.0, True, True, gen)
    pool = _randn(3, 2, 32, 32, gen=gen, scale=0.3)
    idx, has_init = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([True, False])
    pos = torch.tensor([[0, 64]], dtype=torch.int32)
    pool_tri, pool_ref = pool.clone(), pool.clone()
    out = _fn("kda_prefill")(q, k, v, f, beta, cu, pool_tri, idx, has_init, gate_params=params,
                             intermediate_positions=pos)
    want = ref.kda_prefill(q, k, v, f, beta, cu, pool_ref, idx, has_init, gate_params=params,
                           intermediate_positions=pos)
    assert_rel(out.o, want.o, 1e-5, "o")
    assert_rel(pool_tri, pool_ref, 1e-5, "state pool")
    assert_rel(out.intermediate_states, want.intermediate_states, 1e-5, "intermediate state")


def _check_poisoned_prefill(qkv, qkv_ref, f, beta, cu, params, gen, monkeypatch: pytest.MonkeyPatch,
                            tol: float = 1e-5) -> tuple:
    """The Triton prefill on q, k, v = ``qkv`` (three sequences, H = 2, D = 32, fp32), its buffers NaN-poisoned,
    against the reference op on ``qkv_ref``: initial states present and absent, a prefix state at (1, 64);
    tolerance ``tol`` (1e-5: fp32, as the other fp32 prefill twins). Returns (the prefill's output, the initial
    state pool)."""
    H, D = qkv[0].shape[1:]
    pool = _randn(4, H, D, D, gen=gen, scale=0.3)
    idx, has_init = torch.tensor([3, 0, 2], dtype=torch.int32), torch.tensor([True, False, True])
    pos = torch.tensor([[1, 64]], dtype=torch.int32)
    pool_tri, pool_ref = pool.clone(), pool.clone()
    with _poisoned_buffers(monkeypatch):
        out = _fn("kda_prefill")(*qkv, f, beta, cu, pool_tri, idx, has_init, gate_params=params,
                                 intermediate_positions=pos)
    want = ref.kda_prefill(*qkv_ref, f, beta, cu, pool_ref, idx, has_init, gate_params=params,
                           intermediate_positions=pos)
    assert_rel(out.o, want.o, tol, "o")
    assert_rel(pool_tri, pool_ref, tol, "state pool")
    assert_rel(out.intermediate_states, want.intermediate_states, tol, "intermediate states")
    return out, pool


@pytest.mark.interpret
@needs_interp
@pytest.mark.parametrize("path", _INTERP_PATHS)
def test_kda_prefill_strided_qkv_interpret(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """q, k, v as column slices of one NaN-padded [T, 3HD + 8] tensor (the model's short-conv output) and v of
    another row stride ([T, HD + 24]): every path reads them in place (no copy); every buffer the prefill
    allocates starts as NaN, so a stride bug or an unwritten element fails. Twin: the reference op on contiguous
    copies (_check_poisoned_prefill)."""
    from rocm_k3.triton_kernels.kda import prefill as tri_prefill

    _set_path(monkeypatch, path)
    gen = seeded(7)
    q0, k0, v0, f, beta, cu, params = _prefill_inputs([37, 64, 49], torch.float32, -5.0, True, True, gen)
    T, H, D = q0.shape
    qkv = torch.full((T, 3 * H * D + 8), float("nan"))
    qkv[:, : H * D], qkv[:, H * D: 2 * H * D] = q0.reshape(T, H * D), k0.reshape(T, H * D)  # v's slot stays NaN
    q, k = (part.reshape(T, H, D) for part in qkv[:, : 2 * H * D].split(H * D, dim=-1))
    vbuf = torch.full((T, H * D + 24), float("nan"))
    vbuf[:, 8: 8 + H * D] = v0.reshape(T, H * D)
    v = vbuf[:, 8: 8 + H * D].reshape(T, H, D)
    assert q.stride(0) == 3 * H * D + 8 and v.stride(0) == H * D + 24 and not q.is_contiguous()
    assert all(tri_prefill._row_strided(t) is t for t in (q, k, v)), "row-strided views must not be copied"
    _check_poisoned_prefill((q, k, v), (q0, k0, v0), f, beta, cu, params, gen, monkeypatch)


@pytest.mark.interpret
@needs_interp
@pytest.mark.parametrize("path", ["4-launch", "4-launch-unsplit"])
def test_kda_prefill_prep_column_slices_interpret(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """chunk_prep over several column slices per head, as at K3's K = 128 / PREP_BK = 32 (the other interpreter
    tests have K = PREP_BK = 32: one slice, so a slice index, a per-slice gate-bias or G_last offset, or a slice
    that no program does would pass them): PREP_BK = 8 gives 4 slices at D = 32, split into 4 programs per
    (chunk, head) ("4-launch") or walked by one ("4-launch-unsplit"). Varlen with short chunks, fused safe gate,
    initial states present and absent, a prefix state; every buffer the prefill allocates starts as NaN
    (_check_poisoned_prefill)."""
    from rocm_k3.triton_kernels.kda import prefill as tri_prefill

    _set_path(monkeypatch, path)
    monkeypatch.setattr(tri_prefill, "PREP_BK", 8)
    gen = seeded(8)
    q, k, v, f, beta, cu, params = _prefill_inputs([37, 64, 49], torch.float32, -5.0, True, True, gen)
    _check_poisoned_prefill((q, k, v), (q, k, v), f, beta, cu, params, gen, monkeypatch)


@pytest.mark.interpret
@needs_interp
@pytest.mark.parametrize("path", ["3-launch-lean", "3-launch-solve-in-walk-products", "3-launch-lean-horner"])
def test_kda_prefill_bf16_band_interpret(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """BAND_IN_DOT_DTYPE's bf16 A band on the interpreter (whose bf16 dots are wrong, so no bf16-activation case
    runs here): ``band_dtype`` patched to bf16 for fp32 activations, the intra kernel stores
    the band and its diagonal inverses in bf16 and the solving walk reads them into fp32 dots. Every buffer the
    prefill allocates starts as NaN. Against the reference op: o and states within 2e-2 relative (the band's 8
    mantissa bits, rounding 2^-9 per entry, the level the cuda tier's bf16 cases allow), and the fp32-band run's o
    must differ from it (the band really went through bf16)."""
    from rocm_k3.triton_kernels.kda import prefill as tri_prefill

    _set_path(monkeypatch, path)
    gen = seeded(9)
    q, k, v, f, beta, cu, params = _prefill_inputs([37, 64, 49], torch.float32, -5.0, True, True, gen)
    fp32_band_dtype = tri_prefill.band_dtype
    monkeypatch.setattr(tri_prefill, "band_dtype", lambda dot_t, solve_in: torch.bfloat16)
    out, pool = _check_poisoned_prefill((q, k, v), (q, k, v), f, beta, cu, params, gen, monkeypatch, tol=2e-2)
    monkeypatch.setattr(tri_prefill, "band_dtype", fp32_band_dtype)
    fp32_band = _fn("kda_prefill")(q, k, v, f, beta, cu, pool.clone(), torch.tensor([3, 0, 2], dtype=torch.int32),
                                   torch.tensor([True, False, True]), gate_params=params,
                                   intermediate_positions=torch.tensor([[1, 64]], dtype=torch.int32))
    assert not torch.equal(out.o, fp32_band.o), "the bf16 band changed nothing: was it stored in bf16?"


@pytest.mark.interpret
@needs_interp
@pytest.mark.parametrize("products", [False, True], ids=["default", "products-forced"])
def test_fp32_inverses_row_by_row_for_correlated_keys_interpret(products: bool,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Near-identical keys, weak decay (raw log-decay ~ -1e-3) and b ~ 0.99 (beta given as probabilities): A's
    diagonal blocks have entries ~0.99 and their powers A^2 .. A^8 reach ~3e3 before cancelling. The default settings
    (SOLVE_IN_WALK, INVERT_BY_PRODUCTS) invert row by row for fp32 activations (prefill.invert_by_products): o and the
    final state within 1e-5 of the reference op (fp32; measured 1.1e-6). Forcing the products at fp32 leaves 2.8e-4
    here, so "products-forced" must exceed the tolerance: the dtype gate is what keeps fp32 exact."""
    from rocm_k3.triton_kernels.kda import prefill as tri_prefill

    gen = seeded(11)
    T, H, D = 80, 2, 32
    base = torch.randn(1, H, D, generator=gen)
    k = base + 1e-3 * torch.randn(T, H, D, generator=gen)
    q, v = torch.randn(T, H, D, generator=gen), torch.randn(T, H, D, generator=gen)
    f = -1e-3 * torch.rand(T, H, D, generator=gen)  # the raw log-decay itself (no gate)
    beta = torch.full((T, H), 0.99)
    cu = torch.tensor([0, T], dtype=torch.int32)
    pool = torch.zeros(1, H, D, D)
    idx, has_init = torch.zeros(1, dtype=torch.int32), torch.tensor([False])
    if products:
        monkeypatch.setattr(tri_prefill, "invert_by_products", lambda dot_t: True)
    pool_tri, pool_ref = pool.clone(), pool.clone()
    out = _fn("kda_prefill")(q, k, v, f, beta, cu, pool_tri, idx, has_init, beta_logits=False)
    want = ref.kda_prefill(q, k, v, f, beta, cu, pool_ref, idx, has_init, beta_logits=False)
    err = max(((out.o - want.o).norm() / want.o.norm()).item(), ((pool_tri - pool_ref).norm() / pool_ref.norm()).item())
    if products:
        assert err > 1e-5, f"products at fp32 within 1e-5 ({err:.1e}): this case no longer tells the two apart"
    else:
        assert err <= 1e-5, f"fp32 prefill {err:.1e} from the reference with correlated keys"


@pytest.mark.interpret
@needs_interp
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 5e-3)], ids=["fp32", "fp16"])
def test_chunk_intra_inverses_feed_the_solve_interpret(dtype: torch.dtype, tol: float) -> None:
    """INVERT_DIAG / DIAG_INVERTED (prefill.INTRA_INVERTS) on chunk_prep's outputs for a varlen batch with short
    chunks: chunk_intra's band against _invert_band_diagonal of its plain band (fp32 row substitution or products vs
    fp64 inverse, 1e-5; measured ~3e-10 row by row), its Aqk unchanged, and chunk_solve from it against the solve
    that inverts itself (W, U at tol: fp32 1e-5, summation order; fp16 5e-3, W and U stored in fp16). Outputs of
    the runs under test start as NaN, so an element not written fails."""
    from rocm_k3.triton_kernels.kda import prefill as tri_prefill
    from rocm_k3.triton_kernels.kda.chunk_intra import chunk_intra_kernel
    from rocm_k3.triton_kernels.kda.chunk_prep import chunk_prep_kernel
    from rocm_k3.triton_kernels.kda.chunk_solve import chunk_solve_kernel
    from rocm_k3.triton_kernels.kda.common import plan_chunks
    from tests.helpers import poisoned_like

    gen = seeded(6)
    q, k, v, f, beta, cu, params = _prefill_inputs([37, 64, 49, 5], dtype, -5.0, True, True, gen)
    T, H, D = q.shape
    plan = plan_chunks(cu, T)
    dot_t, prec = tri_prefill.dot_config(dtype)

    def empty(*shape, dt=dtype):
        return torch.zeros(*shape, dtype=dt)

    qn, kn, qg, kd = empty(T, H, D), empty(T, H, D), empty(T, H, D), empty(T, H, D)
    gcum, b, glast = empty(T, H, D, dt=torch.float32), empty(T, H, dt=torch.float32), empty(
        plan.num_chunks, H, D, dt=torch.float32)
    grid = (plan.num_chunks, H)
    chunk_prep_kernel[grid](q, k, f, beta, params.A_log, params.dt_bias, plan.chunk_seq, plan.chunk_start, cu,
                            qn, kn, gcum, b, qg, kd, glast, glast, D**-0.5, -5.0, H * D, H * D, H=H, K=D, BT=64,
                            BK=D,
                            HAS_GATE=True, SAFE_GATE=True, QK_NORM=True, BETA_LOGITS=True, COL_SPLIT=False)
    def intra(a_out, aqk_out, invert: bool, products: bool) -> None:
        chunk_intra_kernel[(plan.num_chunks * 4, H)](qn, kn, gcum, b, H * D, H * D, 1.0, plan.chunk_seq,
                                                     plan.chunk_start, cu, a_out, aqk_out, kn, kn, kn, kn, H=H,
                                                     K=D,
                                                     DOT_T=dot_t,
                                                     PREC=prec, WRITE_KB=False, INVERT_DIAG=invert,
                                                     INVERT_PRODUCTS=products, RAW_QK=False)

    def solve(a_in, w_out, u_out, inverted: bool, products: bool) -> None:
        chunk_solve_kernel[(plan.num_chunks, H, 4)](a_in, kn, v, gcum, b, plan.chunk_seq, plan.chunk_start, cu,
                                                    w_out, u_out, H * D, H=H, K=D, V=D, BD=D // 2, DOT_T=dot_t,
                                                    PREC=prec, KB=False, DIAG_INVERTED=inverted,
                                                    INVERT_PRODUCTS=products)

    a, aqk, w, u = empty(T, H, 64, dt=torch.float32), empty(T, H, 64), empty(T, H, D), empty(T, H, D)
    intra(a, aqk, False, False)
    solve(a, w, u, False, False)
    inverse = _invert_band_diagonal(a.double(), cu)
    # prefill.INTRA_INVERTS: chunk_intra's INVERT_DIAG band holds (I + A_II)^-1 in its diagonal blocks (over each
    # block's rows inside its chunk; the other blocks as without it), row by row or (prefill.INVERT_BY_PRODUCTS) as
    # (I - A)(I + A^2)(I + A^4)(I + A^8), both against the fp64 inverse (1e-5); chunk_solve's DIAG_INVERTED reads
    # them, and chunk_solve inverting by products (from A) matches the row-by-row solve (W and U at tol)
    for products in (False, True):
        a3, aqk3, w3, u3 = poisoned_like(a), poisoned_like(aqk), poisoned_like(w), poisoned_like(u)
        intra(a3, aqk3, True, products)
        assert torch.equal(aqk3, aqk), "Aqk does not depend on INVERT_DIAG"
        assert_rel(a3, inverse, 1e-5, f"A band with T_II diagonal blocks (products {products})")
        solve(a3 if not products else a, w3, u3, not products, products)
        assert_rel(w3, w, tol, f"W from T_II (intra's: {not products}, by products: {products})")
        assert_rel(u3, u, tol, f"U from T_II (intra's: {not products}, by products: {products})")


def _invert_band_diagonal(a: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """A [T, H, 64] row band with each chunk's diagonal 16 x 16 blocks A_II replaced by (I + A_II)^-1 over the
    block's rows inside the chunk (fp64; a short block's columns past the chunk's end stay 0): what chunk_intra
    stores with INVERT_DIAG."""
    out = a.clone()
    bounds = cu.tolist()
    for s in range(len(bounds) - 1):
        for t0 in range(bounds[s], bounds[s + 1], 64):
            n = min(64, bounds[s + 1] - t0)
            for i0 in range(0, n, 16):
                i1 = min(i0 + 16, n)
                blk = a[t0 + i0:t0 + i1, :, i0:i1].transpose(0, 1)  # [H, rows, cols]
                eye = torch.eye(i1 - i0, dtype=a.dtype)
                out[t0 + i0:t0 + i1, :, i0:i1] = torch.linalg.inv(eye + blk).transpose(0, 1)
    return out


def _prep_intra_oracle(q, k, f, beta, cu, params, scale: float, l2norm: bool = True) -> dict:
    """fp64 twin of chunk_prep's and chunk_intra's outputs (safe gate, or the raw log-decay when params is None; q/k
    L2 norm unless l2norm is false; beta logits): per 64-token chunk G = cumsum(g), q', k', b, then QG = q' exp(G),
    KD = k' exp(G_last - G), KB = b exp(G) k', GL = exp(G_last) [NC, H, K], and the row bands A / Aqk [T, H, 64] (A
    strictly lower times b, Aqk lower, zeros above), each decay factor exp(G_i - G_j) taken from the fp64
    difference."""
    T, H, K = q.shape
    g = f.double()
    if params is not None:
        x = g + params.dt_bias.double().view(H, K)
        g = params.lower_bound * torch.sigmoid(params.A_log.double().exp().view(H, 1) * x)
    qn, kn = (ref.l2norm(q.double()), ref.l2norm(k.double())) if l2norm else (q.double(), k.double())
    qn = qn * scale
    b = torch.sigmoid(beta.double())
    out = {name: torch.zeros(T, H, K, dtype=torch.float64) for name in ("QG", "KD", "KB")}
    out["A"], out["Aqk"] = torch.zeros(T, H, 64, dtype=torch.float64), torch.zeros(T, H, 64, dtype=torch.float64)
    gl, gm = [], []
    out["E"] = torch.zeros(T, H, K, dtype=torch.float64)
    bounds = cu.tolist()
    for s in range(len(bounds) - 1):
        for t0 in range(bounds[s], bounds[s + 1], 64):
            t1 = min(t0 + 64, bounds[s + 1])
            n = t1 - t0
            G = g[t0:t1].cumsum(0)  # [n, H, K]
            gl.append(G[-1].exp())
            # GATE_FACTORS: G_m the midpoint of each 16-row sub-block's G range (G before its first row plus half
            # the sub-block's sum over its rows in the chunk; G_last past the chunk's end) and E = exp(G - G_m);
            # [5, H, K] per chunk: the four G_m and G_last
            before = [G[i - 1] if 0 < i < n else (G[-1] if i else torch.zeros_like(G[0])) for i in range(0, 64, 16)]
            refs = [(s0 + G[min(i + 15, n - 1)]) / 2 if i < n else G[-1] for s0, i in zip(before, range(0, 64, 16))]
            refs.append(G[-1])
            gm.append(torch.stack(refs).transpose(0, 1))  # [H, 5, K]
            for i in range(0, n, 16):
                out["E"][t0 + i:t0 + min(i + 16, n)] = (G[i:i + 16] - refs[i // 16]).exp()
            out["QG"][t0:t1] = qn[t0:t1] * G.exp()
            out["KD"][t0:t1] = kn[t0:t1] * (G[-1] - G).exp()
            out["KB"][t0:t1] = kn[t0:t1] * G.exp() * b[t0:t1, :, None]
            kj = kn[None, t0:t1] * (G[:, None] - G[None, :]).exp()  # [i, j, H, K]: k'_j exp(G_i - G_j)
            kk = (kn[t0:t1, None] * kj).sum(-1) * b[t0:t1, None]  # [i, j, H]
            qk = (qn[t0:t1, None] * kj).sum(-1)
            tril = torch.ones(n, n, dtype=torch.bool).tril()[:, :, None]
            strict = tril & ~torch.eye(n, dtype=torch.bool)[:, :, None]
            out["A"][t0:t1, :, :n] = torch.where(strict, kk, 0.0).transpose(1, 2)
            out["Aqk"][t0:t1, :, :n] = torch.where(tril, qk, 0.0).transpose(1, 2)
    out["GL"], out["b"], out["qn"], out["kn"], out["GM"] = torch.stack(gl), b, qn, kn, torch.stack(gm)
    return out


def _strided_prep_inputs(gate: str, dtype: torch.dtype, l2norm: bool, gen: torch.Generator) -> tuple:
    """(q0, k0 contiguous; q, k the same values as column slices of one NaN-padded [T, 2 H D + 8] tensor; f, beta, cu,
    params) of the prep / intra output tests: lengths 37, 64, 49, 5, 70; "safe": K3's safe gate, "mild": a raw
    log-decay in (-0.2, 0)."""
    q0, k0, _, f, beta, cu, params = _prefill_inputs([37, 64, 49, 5, 70], dtype, -5.0 if gate == "safe" else "raw",
                                                     l2norm, True, gen)
    T, H, D = q0.shape
    if gate == "mild":
        f = f * 0.04
    qk = torch.full((T, 2 * H * D + 8), float("nan"), dtype=dtype)
    qk[:, : H * D], qk[:, H * D: 2 * H * D] = q0.reshape(T, H * D), k0.reshape(T, H * D)
    q, k = (part.reshape(T, H, D) for part in qk[:, : 2 * H * D].split(H * D, dim=-1))
    return q0, k0, q, k, f, beta, cu, params


def _check_prep_outputs(got: dict, want: dict, cu: torch.Tensor, plan, tol: float, names: tuple) -> None:
    """``names`` whole, then QG, KD and KB per 16-row block of each chunk (a later block's values can be ~exp(-40) of
    the first's under the safe gate)."""
    for name in names:  # GL has one row per chunk slot: the slots past the chunks in use are not compared
        assert_rel(got[name][: want[name].shape[0]], want[name], tol, name)
    bounds = cu.tolist()
    blocks = [(t0 + 16 * i, min(t0 + 16 * i + 16, bounds[s + 1]))
              for s, t0 in zip(plan.chunk_seq.tolist(), plan.chunk_start.tolist()) for i in range(4)]
    for name in ("QG", "KD", "KB"):
        for r0, r1 in blocks:
            if r0 < r1:
                assert_rel(got[name][r0:r1], want[name][r0:r1], tol, f"{name} rows {r0}..{r1 - 1}")


@pytest.mark.interpret
@needs_interp
@pytest.mark.parametrize("gate,dtype,tol,inverts,raw,factors", [
    ("safe", torch.float32, 2e-5, False, False, False), ("mild", torch.float32, 1e-5, False, False, False),
    ("mild", torch.float16, 1e-3, False, False, False), ("safe", torch.float32, 2e-5, True, True, False),
    ("mild", torch.float16, 1e-3, True, True, False), ("safe", torch.float32, 2e-5, True, True, True),
    ("mild", torch.float32, 1e-5, True, True, True)],
    ids=["safe-fp32", "mild-fp32", "mild-fp16", "safe-fp32-inverts-norms-in-intra",
         "mild-fp16-inverts-norms-in-intra", "safe-fp32-gate-factors", "mild-fp32-gate-factors"])
def test_chunk_prep_and_intra_outputs_interpret(gate: str, dtype: torch.dtype, tol: float, inverts: bool,
                                                raw: bool, factors: bool) -> None:
    """chunk_prep (two column slices per (chunk, head), COL_SPLIT) then chunk_intra, tensor by tensor against their fp64
    twin (_prep_intra_oracle): q', k' (or, raw: NORMS_IN_INTRA, nothing written to q' / k', the prep writes G, GL, b
    alone and the intra kernel QG and KD), b, QG, KD, GL,
    then A, Aqk, KB, on a varlen batch with short chunks and strided q, k (column slices of one NaN-padded tensor).
    Every output starts as NaN, so an element not written fails. "safe": K3's safe gate (|g| < 5: decay factors up to
    exp(+-40) in A, |G| up to 320); "mild": a raw log-decay in (-0.2, 0), so every row's QG, KD, KB is O(1) and a wrong
    G_last or cumsum shows in every 16-row block (under the safe gate a later block's QG is ~exp(-40) of the first's).
    QG, KD, KB are checked per 16-row block of each chunk. Tolerances: "mild" fp32 1e-5 (fp32 arithmetic, |G| < 13);
    "safe" fp32 2e-5 (exp of an fp32 exponent of magnitude up to 320: 2^-24 * 320 ~ 2e-5 per rounding of it; the
    four-launch pair measured 1.2e-5 when this test covered the fused prep); fp16 1e-3 (outputs rounded to fp16, 2^-11,
    with fp32 dot operands; under the safe gate the later blocks' QG, ~exp(-40), are below fp16's range, hence the mild
    gate). "inverts": INVERT_DIAG by products (prefill.INTRA_INVERTS / SOLVE_IN_WALK), A's diagonal blocks then hold (I
    + A_II)^-1 (_invert_band_diagonal of the twin's A). "factors": prefill.GATE_FACTORS, the prep writes E = exp(G -
    G_m) per 16-row sub-block (here in fp32, the activations' dot dtype; bf16 on the GPU) and G_m / G_last per chunk
    instead of G, and the intra kernel forms its factors from them: E and G_m are checked too, E per sub-block."""
    from rocm_k3.triton_kernels.kda import prefill as tri_prefill
    from rocm_k3.triton_kernels.kda.chunk_intra import chunk_intra_kernel
    from rocm_k3.triton_kernels.kda.chunk_prep import chunk_prep_kernel
    from rocm_k3.triton_kernels.kda.common import plan_chunks
    from tests.helpers import poisoned_like

    q0, k0, q, k, f, beta, cu, params = _strided_prep_inputs(gate, dtype, True, seeded(9))
    T, H, D = q0.shape
    plan = plan_chunks(cu, T)
    dot_t, prec = tri_prefill.dot_config(dtype)
    want = _prep_intra_oracle(q0, k0, f, beta, cu, params, D**-0.5)
    if inverts:
        want["A"] = _invert_band_diagonal(want["A"], cu)
    shapes = {"A": (T, H, 64), "Aqk": (T, H, 64), "KB": (T, H, D), "b": (T, H), "QG": (T, H, D), "KD": (T, H, D),
              "GL": (plan.num_chunks, H, D), "qn": (T, H, D), "kn": (T, H, D), "G": (T, H, D),
              "GM": (plan.num_chunks, H, 5, D)}
    fp32 = ("A", "b", "GL", "G", "GM")
    got = {name: poisoned_like(torch.empty(*shape, dtype=torch.float32 if name in fp32 else dtype))
           for name, shape in shapes.items()}
    a_log, dt_bias = (params.A_log, params.dt_bias) if params is not None else (f, f)  # f: unread placeholders
    bk = D // 2
    chunk_prep_kernel[(plan.num_chunks * (D // bk), H)](
        q, k, f, beta, a_log, dt_bias, plan.chunk_seq, plan.chunk_start, cu, got["qn"], got["kn"], got["G"],
        got["b"], got["QG"], got["KD"], got["GL"], got["GM"], D**-0.5, -5.0, q.stride(0), k.stride(0), H=H, K=D,
        BT=64, BK=bk, HAS_GATE=params is not None, SAFE_GATE=params is not None, QK_NORM=True, BETA_LOGITS=True,
        COL_SPLIT=True, GATE_ONLY=raw, FACTORS=factors)
    if factors:  # G holds E; G_m per sub-block (rows past a short chunk's end: G_last, as the twin has it)
        assert_rel(got["GM"][: want["GM"].shape[0]], want["GM"], tol, "G_m, G_last")
        for s, t0 in zip(plan.chunk_seq.tolist(), plan.chunk_start.tolist()):
            for r0 in range(t0, min(t0 + 64, cu[s + 1].item()), 16):
                r1 = min(r0 + 16, cu[s + 1].item())
                assert_rel(got["G"][r0:r1], want["E"][r0:r1], tol, f"E rows {r0}..{r1 - 1}")
    else:
        assert got["GM"].isnan().all(), "G_m written without FACTORS"
    if raw:
        assert all(got[n].isnan().all() for n in ("qn", "kn", "QG", "KD")), "the prep wrote more than G, GL, b"
    qa, ka = (q, k) if raw else (got["qn"], got["kn"])
    chunk_intra_kernel[(plan.num_chunks * 4, H)](
        qa, ka, got["G"], got["b"], qa.stride(0), ka.stride(0), D**-0.5, plan.chunk_seq, plan.chunk_start,
        cu, got["A"], got["Aqk"], got["KB"], got["QG"], got["KD"], got["GM"], H=H, K=D, DOT_T=dot_t, PREC=prec,
        WRITE_KB=True, INVERT_DIAG=inverts, INVERT_PRODUCTS=True, RAW_QK=raw, QK_NORM=True, FACTORS=factors)
    if raw:
        assert got["qn"].isnan().all() and got["kn"].isnan().all(), "q' / k' written although the intra reads q, k"
    _check_prep_outputs(got, want, cu, plan, tol, ("A", "Aqk", "b", "GL") + (() if raw else ("qn", "kn")))


@pytest.mark.parametrize("op", sorted(KERNELS))
def test_kernel_signatures_match_the_contract(op: str) -> None:
    """Implementation and supports() take exactly the reference op's parameters (names, kinds, defaults)."""
    import inspect

    from rocm_k3.ops.kda import REFERENCE_IMPLS

    def params(fn) -> list[tuple]:
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    fn, supports = KERNELS[op]
    assert params(fn) == params(REFERENCE_IMPLS[op])
    assert params(supports) == params(REFERENCE_IMPLS[op])


def test_register_cap_launch_options() -> None:
    from rocm_k3.triton_kernels.kda.prefill import register_cap

    assert register_cap(None) == {}
    assert register_cap(128) == ({} if torch.version.hip else {"maxnreg": 128})
    for bad in (8, 300):
        with pytest.raises(ValueError, match="register cap"):
            register_cap(bad)
    with pytest.raises(TypeError, match="register cap"):
        register_cap(128.0)


def test_kda_prefill_supports_reasons() -> None:
    gen = seeded(6)
    q, k, v, f, beta, cu, params = _prefill_inputs([70], torch.float32, -5.0, True, True, gen)
    pool, idx, has_init = torch.zeros(1, 2, 32, 32), torch.zeros(1, dtype=torch.int32), torch.tensor([False])
    ok, reason = _supports("kda_prefill")(q, k, v, f, beta, cu, pool, idx, has_init, gate_params=params,
                                          intermediate_positions=torch.tensor([[0, 50]], dtype=torch.int32))
    assert not ok and "p % 64 == 0" in reason and "50" in reason
    q48 = torch.zeros(70, 2, 48)
    ok, reason = _supports("kda_prefill")(q48, q48, v, f, beta, cu, pool, idx, has_init)
    assert not ok and "power of two" in reason and "48" in reason
    ok, reason = _supports("kda_prefill")(q, k, v, f, beta, cu, pool.double(), idx, has_init)
    assert not ok and "fp32" in reason


@pytest.mark.interpret
@needs_interp
@pytest.mark.parametrize("lower_bound,prefetch", [(-5.0, True), (None, True), (-5.0, False)],
                         ids=["safe", "softplus", "safe-late-state-load"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)], ids=["fp32", "fp16"])
def test_kda_decode_interpret(lower_bound: float | None, prefetch: bool, dtype: torch.dtype, tol: float,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    from rocm_k3.triton_kernels.kda import decode as tri_decode

    monkeypatch.setattr(tri_decode, "DECODE_PREFETCH", prefetch)
    gen = seeded(7)
    N, H, K, S = 3, 2, 32, 5
    args = [_randn(N, 3 * H * K, gen=gen, dtype=dtype), _randn(N, H * K, gen=gen, dtype=dtype),
            _randn(N, H, gen=gen, dtype=dtype), _randn(N, H * K, gen=gen, dtype=dtype),
            _randn(3 * H * K, 4, gen=gen, scale=0.5, dtype=dtype), _randn(S, 3 * H * K, 3, gen=gen, dtype=dtype),
            _randn(H, gen=gen, scale=0.3), _randn(H * K, gen=gen, scale=0.3), _randn(K, gen=gen, dtype=dtype),
            _randn(S, H, K, K, gen=gen, scale=0.3), torch.tensor([4, 0, 2], dtype=torch.int32)]
    tri, refa = list(args), list(args)
    for i in (5, 9):  # conv state and recurrent state are updated in place
        tri[i], refa[i] = args[i].clone(), args[i].clone()
    y = _fn("kda_decode")(*tri, num_heads=H, lower_bound=lower_bound)
    y_ref = ref.kda_decode(*refa, num_heads=H, lower_bound=lower_bound)
    assert y.dtype == dtype and y.shape == (N, H * K)
    assert_rel(y, y_ref, tol, "y")
    assert_rel(tri[9], refa[9], 1e-5, "state pool")
    assert torch.equal(tri[5], refa[5]), "conv state slots differ (they are plain copies of inputs)"
    assert torch.equal(tri[9][[1, 3]], args[9][[1, 3]]), "unused state slots were modified"


@pytest.mark.interpret
@pytest.mark.skipif(_INTERPRETED or _GPU, reason="the interpreter tier ran in this process (or a GPU is present)")
def test_kda_interpret_tier_in_subprocess() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-m", "interpret", "-p", "no:cacheprovider"],
                          capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[3])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


# -------------------------------------------------------------------------------------------------- compile tier
_KDA_KERNELS = ("kda_gate", "chunk_plan", "short_conv", "conv_history", "conv_state", "short_conv_update", "chunk_prep",
                "chunk_prep_split", "chunk_intra", "chunk_intra_kb", "chunk_intra_inv", "chunk_solve",
                "chunk_solve_kb", "chunk_solve_inv", "chunk_solve_kb_prod", "chunk_intra_inv_prod", "chunk_state",
                "chunk_state_split", "chunk_state_solve", "chunk_output", "kda_decode",
                # "3-launch-lean" (the default of sessions 21-28): NORMS_IN_INTRA and BAND_IN_DOT_DTYPE
                "chunk_prep_split_gate", "chunk_intra_inv_prod_norms", "chunk_state_solve_band16",
                "chunk_intra_inv_prod_norms_capped",
                # the default since session 29, prefill.GATE_FACTORS: bf16 E and G_m from the prep, the intra
                # kernel's factors by products (uncapped, and as launched on NVIDIA under the register cap)
                "chunk_prep_split_gate_factors", "chunk_intra_factors", "chunk_intra_factors_capped",
                # prefill.WALK_HORNER: the intra kernel storing -L below the diagonal, the walk's whole-chunk products
                "chunk_intra_negl_capped", "chunk_state_horner")
# The dot kernels and the matrix instructions they must become (checked in the sm_90 PTX / AMDGCN):
# chunk_intra's and chunk_solve's 16-row tiles are too small for wgmma (M = 64) and become mma.sync on sm_90.
_MMA = {"chunk_intra": ("mma.sync.aligned", "v_mfma"), "chunk_solve": ("mma.sync.aligned", "v_mfma"),
        "chunk_intra_kb": ("mma.sync.aligned", "v_mfma"), "chunk_solve_kb": ("mma.sync.aligned", "v_mfma"),
        "chunk_intra_inv": ("mma.sync.aligned", "v_mfma"), "chunk_solve_inv": ("mma.sync.aligned", "v_mfma"),
        # prefill.INVERT_BY_PRODUCTS: the bf16 products stay on the matrix units (the inverses' fp32 ones are FMAs)
        "chunk_solve_kb_prod": ("mma.sync.aligned", "v_mfma"), "chunk_intra_inv_prod": ("mma.sync.aligned", "v_mfma"),
        "chunk_state": ("wgmma.mma_async", "v_mfma"), "chunk_state_split": ("wgmma.mma_async", "v_mfma"),
        "chunk_state_solve": ("mma.sync.aligned", "v_mfma"),
        "chunk_state_solve_band16": ("mma.sync.aligned", "v_mfma"),
        "chunk_intra_inv_prod_norms": ("mma.sync.aligned", "v_mfma"),
        "chunk_intra_inv_prod_norms_capped": ("mma.sync.aligned", "v_mfma"),
        "chunk_intra_factors": ("mma.sync.aligned", "v_mfma"),
        "chunk_intra_factors_capped": ("mma.sync.aligned", "v_mfma"),
        "chunk_intra_negl_capped": ("mma.sync.aligned", "v_mfma"),
        # HORNER's [64, 64] x [64, BV] products fill a warpgroup's M = 64
        "chunk_state_horner": ("wgmma.mma_async", "v_mfma"),
        "chunk_output": ("wgmma.mma_async", "v_mfma")}

# Dot kernels that fit their registers on every target (the inverting intra kernel, reading q', k' and, the default,
# normalising the raw q, k itself): a spill there is a regression.
_NO_SPILLS = ("chunk_intra_inv_prod", "chunk_intra_inv_prod_norms", "chunk_intra_factors", "chunk_prep_split_gate",
              "chunk_prep_split_gate_factors")


@pytest.fixture(scope="module")
def kda_compiled() -> dict:
    return run_compile_driver("triton_kda_compile_driver.py")


@pytest.mark.compile
@pytest.mark.parametrize("target", ["sm_90", "gfx942", "gfx950"])
@pytest.mark.parametrize("kernel", _KDA_KERNELS)
def test_kda_kernels_compile(kda_compiled: dict, kernel: str, target: str) -> None:
    res = kda_compiled[f"{kernel}/{target}"]
    assert res["ok"], res["error"]
    if kernel in _MMA:
        want = _MMA[kernel][0 if target == "sm_90" else 1]
        assert any(m.startswith(want) for m in res["mnemonics"]), (
            f"{kernel} on {target}: no {want}; matrix ops {[m for m in res['mnemonics'] if 'mma' in m or 'mfma' in m]}")
    elif target != "sm_90":
        assert res["scratch"] == 0, f"{kernel} on {target} uses {res['scratch']} B of scratch (register spills)"
    if kernel in _NO_SPILLS:
        assert res["spills"] == 0 and res["scratch"] == 0, (
            f"{kernel} on {target} spills ({res['spills']} / {res['scratch']} B, {res['registers']} registers)")


# The capped intra kernel on sm_90 (prefill.INTRA_MAXNREG = 128): four programs per SM by registers, at most this many
# bytes spilled (24 at session 25's cross-compile; a growth beyond it would eat the occupancy it buys).
_CAPPED_SPILL_BUDGET = 64


@pytest.mark.compile
def test_kda_capped_intra_fits_its_register_cap(kda_compiled: dict) -> None:
    from rocm_k3.triton_kernels.kda.prefill import INTRA_MAXNREG

    for kernel in ("chunk_intra_inv_prod_norms_capped", "chunk_intra_factors_capped"):  # GATE_FACTORS off / on
        res = kda_compiled[f"{kernel}/sm_90"]
        assert res["ok"], res["error"]
        assert INTRA_MAXNREG is not None and res["registers"] <= INTRA_MAXNREG, (kernel, res["registers"])
        assert res["spills"] <= _CAPPED_SPILL_BUDGET, f"{kernel}: {res['spills']} B spilled under the cap"


# ----------------------------------------------------------------------------------------------------- cuda tier
_K3_PREFILL = [
    pytest.param(96, [4096], [[0, 1024], [0, 4096]], id="T4096-H96-D128-bf16"),
    pytest.param(12, [1000, 3096], [[1, 2048]], id="T1000+3096-H12-D128-bf16-tp8"),
]


@pytest.mark.cuda
@pytest.mark.parametrize("path", list(_PATHS))
@pytest.mark.parametrize("H,lengths,inter_rows", _K3_PREFILL)
def test_kda_prefill_k3_cuda(H: int, lengths: list[int], inter_rows: list[list[int]], path: str,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    _set_path(monkeypatch, path)
    gen = seeded(20)
    q, k, v, f, beta, cu, params = _prefill_inputs(lengths, torch.bfloat16, -5.0, True, True, gen,
                                                   device="cuda", H=H, D=128)
    N = len(lengths)
    pool = _randn(N + 1, H, 128, 128, gen=gen, scale=0.05, device="cuda")
    idx = torch.arange(1, N + 1, dtype=torch.int32, device="cuda")
    has_init = torch.tensor([True] + [False] * (N - 1), device="cuda")
    pos = torch.tensor(inter_rows, dtype=torch.int32, device="cuda")
    pool_tri, pool_ref = pool.clone(), pool.clone()
    out = _fn("kda_prefill")(q, k, v, f, beta, cu, pool_tri, idx, has_init, gate_params=params,
                             intermediate_positions=pos)
    want = ref.kda_prefill(q, k, v, f, beta, cu, pool_ref, idx, has_init, gate_params=params,
                           intermediate_positions=pos)
    assert_rel(out.o, want.o, 2e-2, "o")
    assert_rel(pool_tri, pool_ref, 1e-2, "state pool")
    assert_rel(out.intermediate_states, want.intermediate_states, 1e-2, "intermediate states")


@pytest.mark.cuda
@pytest.mark.parametrize("N,H", [(64, 96), (256, 12)], ids=["N64-H96-D128-bf16", "N256-H12-D128-bf16-tp8"])
def test_kda_decode_k3_cuda(N: int, H: int) -> None:
    gen = seeded(21)
    K, S = 128, N + 3
    bf = torch.bfloat16
    args = [_randn(N, 3 * H * K, gen=gen, dtype=bf, device="cuda"), _randn(N, H * K, gen=gen, dtype=bf, device="cuda"),
            _randn(N, H, gen=gen, dtype=bf, device="cuda"), _randn(N, H * K, gen=gen, dtype=bf, device="cuda"),
            _randn(3 * H * K, 4, gen=gen, scale=0.5, dtype=bf, device="cuda"),
            _randn(S, 3 * H * K, 3, gen=gen, dtype=bf, device="cuda"),
            _randn(H, gen=gen, scale=0.3, device="cuda"), _randn(H * K, gen=gen, scale=0.3, device="cuda"),
            _randn(K, gen=gen, dtype=bf, device="cuda"), _randn(S, H, K, K, gen=gen, scale=0.05, device="cuda"),
            torch.randperm(S, generator=gen)[:N].to(device="cuda", dtype=torch.int32)]
    tri, refa = list(args), list(args)
    for i in (5, 9):
        tri[i], refa[i] = args[i].clone(), args[i].clone()
    y = _fn("kda_decode")(*tri, num_heads=H, lower_bound=-5.0)
    assert_rel(y, ref.kda_decode(*refa, num_heads=H, lower_bound=-5.0), 1e-2, "y")
    assert_rel(tri[9], refa[9], 1e-5, "state pool")
    assert torch.equal(tri[5], refa[5])


@pytest.mark.cuda
def test_short_conv_k3_cuda() -> None:
    gen = seeded(22)
    C, lengths = 3 * 96 * 128, [3000, 2, 1094]
    cu = torch.tensor([0, 3000, 3002, 4096], dtype=torch.int32, device="cuda")
    # x as the model passes it: the q|k|v columns of the KDA in_proj output (row width 3HD + D + H + HD)
    wide = torch.full((sum(lengths), C + 128 + 96 + 96 * 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    wide[:, :C] = _randn(sum(lengths), C, gen=gen, dtype=torch.bfloat16, device="cuda")
    x = wide[:, :C]
    w = _randn(C, 4, gen=gen, scale=0.5, dtype=torch.bfloat16, device="cuda")
    pool = _randn(4, C, 3, gen=gen, dtype=torch.bfloat16, device="cuda")
    kw = dict(state_indices=torch.tensor([3, 0, 1], dtype=torch.int32, device="cuda"),
              has_initial_state=torch.tensor([True, True, False], device="cuda"))
    pool_tri, pool_ref = pool.clone(), pool.clone()
    y = _fn("short_conv")(x, w, cu, conv_state=pool_tri, **kw)
    assert_rel(y, ref.short_conv(x, w, cu, conv_state=pool_ref, **kw), 1e-2, "y")
    assert torch.equal(pool_tri, pool_ref)
