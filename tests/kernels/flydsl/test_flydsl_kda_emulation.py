"""Host emulation of the chunked FlyDSL kda_prefill (unit tier, no compiler, no GPU).

The FlyDSL kernels cannot run here, so their algorithm is checked in torch, step for step:
- the three phases in matrix form (fp32, exp of G differences, the row norms factored out of the raw q, k pair
  sums, the walk's row operands QG / KD formed by the intra kernel, the diagonal blocks' inverses by row-by-row
  forward substitution, the walk's block substitution over 16-row tiles, masked chunk tails, chunk-end
  intermediate states) against the float64 token recurrence ``kda_prefill_naive`` — an independent formulation;
  this matrix form is the reference the lane emulations below are held to;
- the state kernel's per-lane MFMA fragment bookkeeping (``kda_prefill_plan.mfma_krow``, MFMA emulated per
  lane, fp32 and bf16 operands) against that matrix form;
- the intra kernel's writes lane by lane (its MFMA pair sums with the decay split per block, NaN where no lane
  writes), fed to that fragment walk; and the bf16 path end to end against the recurrence.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from rocm_k3.flydsl_kernels import plans
from tests.helpers import assert_rel, seeded


def _emulate_chunked_prefill(q, k, v, g, beta, bounds, state, slots, has_init, positions, scale, l2norm=True):
    """The chunked FlyDSL prefill's phases in matrix form in torch fp32 (the diagonal inverses row by row, the
    walk's block substitution, exp of fp32 differences, masked tails): the reference of the lane emulations;
    logdecay gate, l2 norm unless l2norm is false, beta logits."""
    from rocm_k3.flydsl_kernels import kda_prefill_plan as kp

    T, H, K = q.shape
    b = torch.sigmoid(beta)  # phase 1: b and G only
    seq, start, first = kp.chunk_plan(bounds)
    ends = [min(bounds[s + 1], t0 + kp.CHUNK) for s, t0 in zip(seq, start)]
    gc = torch.empty_like(g)
    for t0, te in zip(start, ends):
        gc[t0:te] = torch.cumsum(g[t0:te], 0)
    # phase 2 reads the raw q, k: the row factors k' = rk k, q' = rq q factor out of the pair sums
    rk = 1.0 / torch.sqrt((k * k).sum(-1) + 1e-6) if l2norm else torch.ones(T, H)  # [T, H]
    rq = scale / torch.sqrt((q * q).sum(-1) + 1e-6) if l2norm else torch.full((T, H), scale)
    kn, qn = k * rk[..., None], q * rq[..., None]
    aqk, ab = torch.zeros(T, H, kp.CHUNK), torch.zeros(T, H, kp.CHUNK)
    kb = b[:, :, None] * torch.exp(gc) * kn  # [T, H, K]: the walk's right-hand side in W's place
    qg, kd = qn * torch.exp(gc), torch.empty(T, H, K)  # the walk's row operands
    for t0, te in zip(start, ends):  # phase 2: pair matrices, the A band with the diagonal blocks inverted
        n = te - t0
        kd[t0:te] = kn[t0:te] * torch.exp(gc[te - 1][None] - gc[t0:te])
        diff = gc[t0:te, None] - gc[None, t0:te]  # [i, j, H, K]: G_i - G_j
        lower = torch.ones(n, n).tril()[:, :, None, None].bool()
        e = torch.where(lower, torch.exp(torch.where(lower, diff, 0.0)), 0.0) * k[None, t0:te]  # raw k_j
        rows, cols = rk[t0:te].T[:, :, None], rk[t0:te].T[:, None, :]  # [H, i, 1], [H, 1, j]
        a = torch.einsum("ihd,ijhd->hij", k[t0:te], e) * b[t0:te].T[:, :, None] * rows * cols
        a = a * torch.ones(n, n).tril(-1)
        qk = torch.einsum("ihd,ijhd->hij", q[t0:te], e) * rq[t0:te].T[:, :, None] * cols
        aqk[t0:te, :, :n] = qk.permute(1, 0, 2)
        ab[t0:te, :, :n] = a.permute(1, 0, 2)
        for i0 in range(0, n, kp.SUB):  # T_II = (I + A_II)^-1, row by row as the kernel's lanes solve it
            m = min(kp.SUB, n - i0)
            blk = a[:, i0:i0 + m, i0:i0 + m]  # [H, m, m] strictly lower
            t = []
            for r in range(m):
                t.append(torch.eye(m)[r].expand(H, m) - sum((blk[:, r, j, None] * t[j] for j in range(r)),
                                                            torch.zeros(H, m)))
            ab[t0 + i0:t0 + i0 + m, :, i0:i0 + m] = torch.stack(t)  # [m, H, m]
    imap, source = kp.inter_map(first, positions, len(seq))
    inter = torch.zeros(len(positions), H, K, K)
    o = torch.empty(T, H, K)
    for i in range(len(bounds) - 1):  # phase 3: the walk, solving tile by tile
        s = torch.where(has_init[i], state[slots[i]], torch.zeros(H, K, K))
        for c in range(first[i], first[i + 1]):
            t0, te = start[c], ends[c]
            n = te - t0
            rhs = b[t0:te, :, None] * v[t0:te] - torch.einsum("thk,hkv->thv", kb[t0:te], s)  # [n, H, V]
            vp = torch.zeros(n, H, K)
            for i0 in range(0, n, kp.SUB):
                m = min(kp.SUB, n - i0)
                x = rhs[i0:i0 + m] - torch.einsum("thj,jhv->thv", ab[t0 + i0:t0 + i0 + m, :, :i0], vp[:i0])
                vp[i0:i0 + m] = torch.einsum("thj,jhv->thv", ab[t0 + i0:t0 + i0 + m, :, i0:i0 + m], x)
            o[t0:te] = (torch.einsum("thk,hkv->thv", qg[t0:te], s)
                        + torch.einsum("thj,jhv->thv", aqk[t0:te, :, :n], vp))
            s = torch.exp(gc[te - 1])[:, :, None] * s + torch.einsum("thk,thv->hkv", kd[t0:te], vp)
            if imap[c] >= 0:
                inter[imap[c]] = s
        state[slots[i]] = s
    # what phases 2 and 3 read
    mids = {"q": q, "k": k, "scale": scale, "l2norm": l2norm, "qg": qg, "kd": kd, "gc": gc, "ab": ab, "kb": kb,
            "v": v, "b": b, "aqk": aqk}
    return o, (inter[source] if positions else inter), mids


@pytest.mark.parametrize("lens,save,l2norm", [([5, 64, 0, 130], [(1, 64), (3, 128), (0, 5), (3, 130), (1, 64)], True),
                                              ([200], [(0, 192)], True), ([70, 5], [(0, 64)], False)],
                         ids=["4seq-save-dup", "1seq-T200", "no-l2norm"])
def test_kda_chunked_prefill_emulation_matches_recurrence(lens: list[int], save: list[tuple[int, int]],
                                                          l2norm: bool) -> None:
    """The phase decomposition the chunked kernels implement (host emulation) against the float64 recurrence
    (without the L2 norm, small q and k keep the delta rule stable)."""
    from rocm_k3.ops.kda.naive import kda_prefill_naive

    H, K = 2, 32
    bounds = [0, *itertools.accumulate(lens)]
    T, N = bounds[-1], len(lens)
    gen = seeded(50)
    q, k, v = (torch.randn(T, H, K, generator=gen) for _ in range(3))
    if not l2norm:
        q, k = q * 0.15, k * 0.15
    g = -torch.rand(T, H, K, generator=gen) * 0.5
    beta = torch.randn(T, H, generator=gen)
    state = torch.randn(N + 1, H, K, K, generator=gen) * 0.1
    slots = list(range(1, N + 1))
    has_init = [i % 2 == 0 for i in range(N)]
    st_emu, st_ref = state.clone(), state.clone()
    o, inter, _ = _emulate_chunked_prefill(q, k, v, g, beta, bounds, st_emu, slots, torch.tensor(has_init), save,
                                        K**-0.5, l2norm)
    ref = kda_prefill_naive(q, k, v, g, beta, torch.tensor(bounds, dtype=torch.int32), st_ref,
                            torch.tensor(slots, dtype=torch.int32), torch.tensor(has_init), qk_l2norm=l2norm,
                            intermediate_positions=torch.tensor(save, dtype=torch.int32))
    assert_rel(o, ref.o.float(), 1e-4, "o")
    assert_rel(st_emu, st_ref, 1e-4, "final states")
    assert_rel(inter, ref.intermediate_states.float(), 1e-4, "intermediate states")


def _mfma(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """v_mfma_f32_16x16x(4 kpl) on per-lane values a, b [64, kpl]: lane l gives A[l % 16, kpl (l // 16) + j] and
    B[kpl (l // 16) + j, l % 16] as its element j and holds C[(l // 16) * 4 + i, l % 16] in acc[l, i] (the layout of
    ``plans.mfma_c_coord``); fp32 products and accumulation (bf16 operands are exact in fp32)."""
    kpl = a.shape[1]
    lane = torch.arange(64)
    A, B = torch.zeros(16, 4 * kpl), torch.zeros(4 * kpl, 16)
    k = kpl * (lane // 16)[:, None] + torch.arange(kpl)[None, :]  # [64, kpl]
    A[(lane % 16)[:, None].expand(64, kpl), k] = a
    B[k, (lane % 16)[:, None].expand(64, kpl)] = b
    C = A @ B
    rows = torch.tensor([[plans.mfma_c_coord(int(l), i)[0] for i in range(4)] for l in range(64)])
    return acc + C[rows, (lane % 16)[:, None]]


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def _emulate_state_wave(mids, bounds, first, state, slot, has_init, n, h, vt, K, out, inter, imap, kpl=1, rnd=None):
    """One wave of kda_chunk_state, step for step: the kernel's fragment index arithmetic (``mfma_krow`` with kpl
    values per lane and step) with the MFMA emulated per lane. ``rnd`` rounds the operands the kernel converts (S, the
    right-hand side, V' as it goes to LDS; the bf16 walk) and is the identity by default: kpl = 4 without it checks
    the bf16 walk's bookkeeping exactly. The intermediates are used as given (the caller rounds them)."""
    from rocm_k3.flydsl_kernels import kda_prefill_plan as kp

    rnd = rnd or (lambda x: x)
    qg, kd, gc, ab, kb, v, b, aqk = (mids[x] for x in ("qg", "kd", "gc", "ab", "kb", "v", "b", "aqk"))
    lane = torch.arange(64)
    q, a_row = lane // 16, lane % 16
    col = vt * kp.STATE_BV + a_row
    krow = lambda s, j: kp.mfma_krow(s, q, j, kpl)
    js = range(kpl)
    k_steps, c_steps, t_steps = K // (4 * kpl), kp.CHUNK // (4 * kpl), 16 // (4 * kpl)
    st = [torch.stack([state[slot, h, kp.mfma_krow(4 * m + i, q), col] if has_init else torch.zeros(64)
                       for i in range(4)], 1) for m in range(K // 16)]
    for ci in range(first[n], first[n + 1]):
        t0 = bounds[n] + (ci - first[n]) * kp.CHUNK
        cnt = min(bounds[n + 1] - t0, kp.CHUNK)
        t_last = t0 + cnt - 1
        s_frag = [x.clone() for x in st]
        # element j of step s: C element e % 4 of S tile e // 4, e = kpl s + j
        s_ops = [rnd(torch.stack([s_frag[(s * kpl + j) // 4][:, (s * kpl + j) % 4] for j in js], 1))
                 for s in range(k_steps)]
        svp = torch.full((kp.CHUNK, kp.STATE_BV), float("nan"))  # the LDS V' tile, [64, 16]
        o_acc = []
        for r in range(kp.CHUNK // 16):
            src = (t0 + r * 16 + a_row).clamp(max=t_last)
            acc, acc_o = torch.zeros(64, 4), torch.zeros(64, 4)
            for s in range(k_steps):
                idx = torch.stack([krow(s, j) for j in js], 1)  # [64, kpl]
                acc = _mfma(acc, kb[src[:, None], h, idx], s_ops[s])
                acc_o = _mfma(acc_o, qg[src[:, None], h, idx], s_ops[s])
            for s in range(r * t_steps):  # the earlier tiles' V' rows, read back from LDS
                idx = torch.stack([krow(s, j) for j in js], 1)
                acc = _mfma(acc, ab[src[:, None], h, idx], svp[idx, a_row[:, None]])
            rhs = []
            for i in range(4):
                row = r * 16 + 4 * q + i
                t = (t0 + row).clamp(max=t_last)
                rhs.append(torch.where(row < cnt, b[t, h] * v[t, h, col] - acc[:, i], 0.0))
            acc_v = torch.zeros(64, 4)
            for s in range(t_steps):  # element j of step s: C element s kpl + j of the right-hand side
                idx = torch.stack([r * 16 + 4 * q + s * kpl + j for j in js], 1)
                acc_v = _mfma(acc_v, ab[src[:, None], h, idx], rnd(torch.stack([rhs[s * kpl + j] for j in js], 1)))
            for i in range(4):
                row = r * 16 + 4 * q + i
                svp[row, a_row] = rnd(torch.where(row < cnt, acc_v[:, i], 0.0))
            o_acc.append(acc_o)
        vp = [svp[torch.stack([krow(s, j) for j in js], 1), a_row[:, None]] for s in range(c_steps)]
        for r in range(kp.CHUNK // 16):
            src = (t0 + r * 16 + a_row).clamp(max=t_last)
            for s in range(c_steps):
                o_acc[r] = _mfma(o_acc[r], aqk[src[:, None], h, torch.stack([krow(s, j) for j in js], 1)], vp[s])
            for i in range(4):
                row = r * 16 + 4 * q + i
                ok = row < cnt
                out[t0 + row[ok], h, col[ok]] = o_acc[r][ok, i]
        for m in range(K // 16):
            key = m * 16 + a_row
            st[m] = s_frag[m] * torch.exp(torch.stack([gc[t_last, h, kp.mfma_krow(4 * m + i, q)] for i in range(4)], 1))
            for s in range(c_steps):
                t = (t0 + torch.stack([krow(s, j) for j in js], 1)).clamp(max=t_last)  # [64, kpl] chunk rows
                st[m] = _mfma(st[m], kd[t, h, key[:, None]], vp[s])
        if imap[ci] >= 0:
            for m, i in itertools.product(range(K // 16), range(4)):
                inter[imap[ci], h, kp.mfma_krow(4 * m + i, q), col] = st[m][:, i]
    for m, i in itertools.product(range(K // 16), range(4)):
        state[slot, h, kp.mfma_krow(4 * m + i, q), col] = st[m][:, i]


@pytest.mark.parametrize("kpl", [1, 4], ids=["fp32-mfma", "bf16-mfma-layout"])
def test_kda_chunk_state_fragment_walk_matches_matrix_form(kpl: int) -> None:
    """The state kernel's per-lane MFMA bookkeeping (emulated) against the matrix form of phase 3, for the fp32
    walk (1 value per lane and step) and the bf16 walk's layout (4 per lane and step; no rounding here, so the index
    arithmetic is checked exactly)."""
    from rocm_k3.flydsl_kernels import kda_prefill_plan as kp

    H, K, lens, save = 1, 32, [70, 5], [(0, 64), (1, 5)]
    bounds = [0, *itertools.accumulate(lens)]
    T = bounds[-1]
    gen = seeded(51)
    q, k, v = (torch.randn(T, H, K, generator=gen) for _ in range(3))
    g = -torch.rand(T, H, K, generator=gen) * 0.5
    beta = torch.randn(T, H, generator=gen)
    state = torch.randn(3, H, K, K, generator=gen) * 0.1
    slots, has_init = [2, 0], [True, False]
    st_mat, st_frag = state.clone(), state.clone()
    o_mat, inter_mat, mids = _emulate_chunked_prefill(q, k, v, g, beta, bounds, st_mat, slots,
                                                      torch.tensor(has_init), save, K**-0.5)
    _, _, first = kp.chunk_plan(bounds)
    imap, _ = kp.inter_map(first, save, first[-1])
    o_frag, inter_frag = torch.full((T, H, K), float("nan")), torch.full((len(save), H, K, K), float("nan"))
    for n, vt in itertools.product(range(len(lens)), range(K // kp.STATE_BV)):
        _emulate_state_wave(mids, bounds, first, st_frag, slots[n], has_init[n], n, 0, vt, K, o_frag, inter_frag,
                            imap, kpl)
    assert_rel(o_frag, o_mat, 1e-5, "o")  # NaN (a row or column never written) fails
    assert_rel(st_frag, st_mat, 1e-5, "final states")
    assert_rel(inter_frag, inter_mat, 1e-5, "intermediate states")


@pytest.mark.parametrize("lens,save", [([70, 5, 200], [(0, 64), (1, 5), (2, 128)]), ([64, 33], [(0, 64)])],
                         ids=["3seq", "full-and-tail"])
def test_kda_bf16_walk_error_is_bf16_level(lens: list[int], save: list[tuple[int, int]]) -> None:
    """The bf16 walk as the kernels round it (intermediates written in bf16 by phase 2; S, the right-hand side and V'
    rounded to bf16 where the kernel converts them; fp32 accumulation) against the float64 token recurrence: o
    within 2e-2 and states within 1e-2, the bounds the Triton twin's bf16 path meets (tests/kernels/triton's cuda
    tier); and the same fragment walk without the roundings within 1e-5 (so the bound measures the rounding, not
    the bookkeeping)."""
    from rocm_k3.flydsl_kernels import kda_prefill_plan as kp
    from rocm_k3.ops.kda.naive import kda_prefill_naive

    H, K = 1, 64
    bounds = [0, *itertools.accumulate(lens)]
    T, N = bounds[-1], len(lens)
    gen = seeded(53)
    q, k, v = (torch.randn(T, H, K, generator=gen) for _ in range(3))
    g = -torch.rand(T, H, K, generator=gen) * 0.3
    beta = torch.randn(T, H, generator=gen)
    state = torch.randn(N + 1, H, K, K, generator=gen) * 0.1
    slots, has_init = list(range(1, N + 1)), [i % 2 == 0 for i in range(N)]
    st_mat, st_ref = state.clone(), state.double()  # the recurrence updates st_ref in place
    _, _, mids = _emulate_chunked_prefill(q, k, v, g, beta, bounds, st_mat, slots, torch.tensor(has_init), save,
                                          K**-0.5)
    ref = kda_prefill_naive(q.double(), k.double(), v.double(), g.double(), beta.double(),
                            torch.tensor(bounds, dtype=torch.int32), st_ref,
                            torch.tensor(slots, dtype=torch.int32), torch.tensor(has_init),
                            intermediate_positions=torch.tensor(save, dtype=torch.int32))
    _, _, first = kp.chunk_plan(bounds)
    imap, _ = kp.inter_map(first, save, first[-1])
    rounded = dict(mids, **{x: _bf16(mids[x]) for x in ("qg", "kd", "ab", "kb", "aqk")})
    for name, operands, rnd, tol_o, tol_s in (("bf16", rounded, _bf16, 2e-2, 1e-2), ("exact", mids, None, 1e-5, 1e-5)):
        st = state.clone()
        o, inter = torch.full((T, H, K), float("nan")), torch.full((len(save), H, K, K), float("nan"))
        for n, vt in itertools.product(range(N), range(K // kp.STATE_BV)):
            _emulate_state_wave(operands, bounds, first, st, slots[n], has_init[n], n, 0, vt, K, o, inter, imap, 4,
                                rnd)
        assert_rel(o, ref.o.float(), tol_o, f"o ({name})")
        assert_rel(st, st_ref.float(), tol_s, f"final states ({name})")
        assert_rel(inter, ref.intermediate_states.float(), tol_s, f"intermediate states ({name})")


def _emulate_intra_writes(mids, bounds, H, K, kpl=1, rnd=None):
    """kda_chunk_intra's global writes lane by lane into NaN-filled outputs (an entry the walk reads but no lane
    writes stays NaN): wave I's MFMA pair sums (emulated per lane, the operands as the kernel forms them: the
    references G at block I's first row for the earlier blocks' tiles and the midpoint of its G range for its diagonal
    tile, ``intra_pair_dim`` channels, kpl values per lane and step), the row factors from the lanes' sums of squares
    through the [2, 64] LDS table, the inverse lanes' columns and the KB / QG / KD lanes. ``rnd`` rounds what the
    kernel converts to the operand type (the MFMA operands and every written value; bf16 at kpl = 4); identity by
    default."""
    from rocm_k3.flydsl_kernels import kda_prefill_plan as kp

    rnd = rnd or (lambda x: x)
    q, k, gc, b, scale, l2norm = (mids[x] for x in ("q", "k", "gc", "b", "scale", "l2norm"))
    T = q.shape[0]
    aqk, ab = (torch.full((T, H, kp.CHUNK), float("nan")) for _ in range(2))
    kb, qg, kd = (torch.full((T, H, K), float("nan")) for _ in range(3))
    seq, start, _ = kp.chunk_plan(bounds)
    lane = torch.arange(64)
    ql, a_row = lane // 16, lane % 16
    blocks = kp.CHUNK // kp.SUB
    for (sq, t0), h in itertools.product(zip(seq, start), range(H)):
        t_end = min(bounds[sq + 1], t0 + kp.CHUNK)
        t_last = t_end - 1
        srn = torch.full((2 * kp.CHUNK,), float("nan"))  # the LDS table of row factors
        sa = torch.full((kp.CHUNK, kp.CHUNK), float("nan"))  # the LDS A
        accs = []
        for blk in range(blocks):  # wave blk: row block I = blk
            i_src = (t0 + blk * 16 + a_row).clamp(max=t_last)
            r_first, r_last = min(t0 + blk * 16, t_last), min(t0 + blk * 16 + 15, t_last)
            acc_k, acc_q = [torch.zeros(64, 4) for _ in range(blocks)], [torch.zeros(64, 4) for _ in range(blocks)]
            ssk, ssq = torch.zeros(64), torch.zeros(64)
            for s in range(K // (4 * kpl)):
                dims = torch.stack([kp.intra_pair_dim(s, ql, j, kpl) for j in range(kpl)], 1)  # [64, kpl]
                g_first = gc[r_first, h][dims]
                g_mid = (g_first + gc[r_last, h][dims]) * 0.5
                k_i, q_i, g_i = (x[i_src[:, None], h, dims] for x in (k, q, gc))
                ssk, ssq = ssk + (k_i * k_i).sum(1), ssq + (q_i * q_i).sum(1)
                e_f, e_m = torch.exp(g_i - g_first), torch.exp(g_i - g_mid)
                for J in range(blk + 1):
                    j_src = (t0 + J * 16 + a_row).clamp(max=t_last)
                    ref, e = (g_first, e_f) if J < blk else (g_mid, e_m)
                    kc = rnd(k[j_src[:, None], h, dims] * torch.exp(ref - gc[j_src[:, None], h, dims]))
                    acc_k[J] = _mfma(acc_k[J], rnd(k_i * e), kc)
                    acc_q[J] = _mfma(acc_q[J], rnd(q_i * e), kc)
            ssk, ssq = ssk.view(4, 16).sum(0).repeat(4), ssq.view(4, 16).sum(0).repeat(4)  # the two shuffles
            rk = torch.rsqrt(ssk + 1e-6) if l2norm else torch.ones(64)
            rq = torch.rsqrt(ssq + 1e-6) * scale if l2norm else torch.full((64,), scale)
            srn[blk * 16 + a_row[ql == 0]], srn[kp.CHUNK + blk * 16 + a_row[ql == 0]] = rk[ql == 0], rq[ql == 0]
            accs.append((acc_k, acc_q))
        for blk, (acc_k, acc_q) in enumerate(accs):  # after the barrier: factors, writes
            for c in range(4):
                i = blk * 16 + 4 * ql + c
                ok = t0 + i < t_end
                rk_i, rq_i, b_i = srn[i], srn[kp.CHUNK + i], b[(t0 + i).clamp(max=t_last), h]
                for J in range(blocks):
                    j = J * 16 + a_row
                    a_ij = torch.where(j < i, acc_k[J][:, c] * (b_i * rk_i) * srn[j], 0.0)
                    qk_ij = torch.where(j <= i, acc_q[J][:, c] * rq_i * srn[j], 0.0)
                    if J == blk:  # only the diagonal tile goes to LDS (the rest stays NaN: the inverses never read it)
                        sa[i, j] = a_ij
                    aqk[t0 + i[ok], h, j[ok]] = rnd(qk_ij[ok])
                    if J != blk:
                        ab[t0 + i[ok], h, j[ok]] = rnd(a_ij[ok])
        for tid in range(kp.CHUNK):  # inverse lanes: one column of one diagonal block each
            blk, c = kp.intra_inverse(tid)
            base, t = blk * kp.SUB, []
            for r in range(kp.SUB):
                t.append(float(c == r) - sum((sa[base + r, base + jj] * t[jj] for jj in range(r)), torch.tensor(0.0)))
                if t0 + base + r < t_end:
                    ab[t0 + base + r, h, base + c] = rnd(t[r])
        for tid, el in itertools.product(range(kp.LANES), range(kp.CHUNK * K // kp.LANES)):  # KB, QG, KD
            row, d = divmod(tid + el * kp.LANES, K)
            if t0 + row < t_end:
                st = t0 + row
                kk = k[st, h, d] * srn[row]
                eg = torch.exp(gc[st, h, d])
                kb[st, h, d] = rnd(kk * eg * b[st, h])
                qg[st, h, d] = rnd(q[st, h, d] * srn[kp.CHUNK + row] * eg)
                kd[st, h, d] = rnd(kk * torch.exp(gc[t_last, h, d] - gc[st, h, d]))
    return {"aqk": aqk, "ab": ab, "kb": kb, "qg": qg, "kd": kd}


@pytest.mark.parametrize("kpl", [1, 4], ids=["fp32-mfma", "bf16-mfma-layout"])
@pytest.mark.parametrize("lens,gscale,l2norm", [([1, 17, 33], 0.5, True), ([64, 65], 0.5, True),
                                                ([40, 64], 10.0, True), ([17, 64], 0.5, False)],
                         ids=["short-tails", "full-and-one", "strong-decay", "no-l2norm"])
def test_kda_chunk_intra_lane_writes_feed_the_walk(lens: list[int], gscale: float, l2norm: bool, kpl: int) -> None:
    """kda_chunk_intra's per-lane writes (NaN where no lane writes) equal the matrix form within 1e-5 (the split
    decay factors and the MFMA's summation order against exp of the fp32 difference), and fed to the state kernel's
    fragment walk give the matrix form's o and states: partial chunks (1, 17, 33 rows), a chunk of one row after a
    full one, and per-token decays up to 10 (near the split's bound of 11), where the diagonal tiles' discarded
    entries above the diagonal overflow. Both lane maps (kpl 1: fp32 MFMA; kpl 4: the bf16 MFMA's, without the
    roundings here, so its bookkeeping is held to the same bounds)."""
    from rocm_k3.flydsl_kernels import kda_prefill_plan as kp

    H, K = 1, 32
    bounds = [0, *itertools.accumulate(lens)]
    T, N = bounds[-1], len(lens)
    gen = seeded(52)
    q, k, v = (torch.randn(T, H, K, generator=gen) for _ in range(3))
    if not l2norm:  # small q and k keep the unnormalised delta rule (and T_II) well conditioned
        q, k = q * 0.15, k * 0.15
    g = -torch.rand(T, H, K, generator=gen) * gscale
    beta = torch.randn(T, H, generator=gen)
    state = torch.randn(N + 1, H, K, K, generator=gen) * 0.1
    slots, has_init = list(range(1, N + 1)), [i % 2 == 0 for i in range(N)]
    save = [(i, n) for i, n in enumerate(lens)]
    st_mat, st_frag = state.clone(), state.clone()
    o_mat, inter_mat, mids = _emulate_chunked_prefill(q, k, v, g, beta, bounds, st_mat, slots,
                                                      torch.tensor(has_init), save, K**-0.5, l2norm)
    writes = _emulate_intra_writes(mids, bounds, H, K, kpl)
    for key, got in writes.items():
        assert_rel(got, mids[key], 1e-5, key)  # NaN (an entry no lane writes) fails
    _, _, first = kp.chunk_plan(bounds)
    imap, _ = kp.inter_map(first, save, first[-1])
    o_frag, inter_frag = torch.full((T, H, K), float("nan")), torch.full((len(save), H, K, K), float("nan"))
    lanes = dict(mids, **writes)
    for n, vt in itertools.product(range(N), range(K // kp.STATE_BV)):
        _emulate_state_wave(lanes, bounds, first, st_frag, slots[n], has_init[n], n, 0, vt, K, o_frag, inter_frag,
                            imap, kpl)
    assert_rel(o_frag, o_mat, 1e-5, "o")
    assert_rel(st_frag, st_mat, 1e-5, "final states")
    assert_rel(inter_frag, inter_mat, 1e-5, "intermediate states")


@pytest.mark.parametrize("lens,gscale", [([40, 64, 130], 0.5), ([64, 17], 5.0)], ids=["3seq", "safe-gate-range"])
def test_kda_bf16_intra_and_walk_error_is_bf16_level(lens: list[int], gscale: float) -> None:
    """The bf16 path end to end as the kernels round it: the intra kernel's MFMA pair sums on bf16 operands (kpl 4)
    and its bf16 writes, fed to the bf16 walk, against the float64 token recurrence: o within 2e-2 and states within
    1e-2 (the Triton twin's bf16 bounds); each written tensor within 1e-2 of the matrix form (relative norm).
    These bounds measure the size of the bf16 error, not where the kernels round: that is checked by reading them
    against the Triton twin."""
    from rocm_k3.flydsl_kernels import kda_prefill_plan as kp
    from rocm_k3.ops.kda.naive import kda_prefill_naive

    H, K = 1, 64
    bounds = [0, *itertools.accumulate(lens)]
    T, N = bounds[-1], len(lens)
    gen = seeded(54)
    q, k, v = (torch.randn(T, H, K, generator=gen) for _ in range(3))
    g = -torch.rand(T, H, K, generator=gen) * gscale
    beta = torch.randn(T, H, generator=gen)
    state = torch.randn(N + 1, H, K, K, generator=gen) * 0.1
    slots, has_init = list(range(1, N + 1)), [i % 2 == 0 for i in range(N)]
    save = [(i, n) for i, n in enumerate(lens)]
    st_ref = state.double()
    _, _, mids = _emulate_chunked_prefill(q, k, v, g, beta, bounds, state.clone(), slots, torch.tensor(has_init),
                                          save, K**-0.5)
    ref = kda_prefill_naive(q.double(), k.double(), v.double(), g.double(), beta.double(),
                            torch.tensor(bounds, dtype=torch.int32), st_ref, torch.tensor(slots, dtype=torch.int32),
                            torch.tensor(has_init), intermediate_positions=torch.tensor(save, dtype=torch.int32))
    writes = _emulate_intra_writes(mids, bounds, H, K, 4, _bf16)
    for key, got in writes.items():
        assert_rel(got, mids[key], 1e-2, key)  # NaN (an entry no lane writes) fails
    _, _, first = kp.chunk_plan(bounds)
    imap, _ = kp.inter_map(first, save, first[-1])
    st = state.clone()
    o, inter = torch.full((T, H, K), float("nan")), torch.full((len(save), H, K, K), float("nan"))
    for n, vt in itertools.product(range(N), range(K // kp.STATE_BV)):
        _emulate_state_wave(dict(mids, **writes), bounds, first, st, slots[n], has_init[n], n, 0, vt, K, o, inter,
                            imap, 4, _bf16)
    assert_rel(o, ref.o.float(), 2e-2, "o")
    assert_rel(st, st_ref.float(), 1e-2, "final states")
    assert_rel(inter, ref.intermediate_states.float(), 1e-2, "intermediate states")
