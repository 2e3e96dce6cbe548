"""Benchmark the Triton KDA kernels on an NVIDIA GPU against FLA and against the memory roofline.

    python benchmarks/bench_kda.py [--json out.json] [--sweep] [--profile] [--prefill-only] [--phase-compare]
                                   [--prep-compare] [--profile-only] [--conv]

``--phase-compare``: only the K3 prefill shapes T = 4k / 16k / 64k, the varlen batch and the varlen batch saving a
state every 1024 tokens, each timed at the default settings, at each of ``PHASE_COMPARE``'s (the state walk's tile
and pipeline stages, ``STATE_STAGES``; relative error of o against the default) and FLA's, few compiles, so it fits
a short device call; ``--prep-compare`` the same with ``PREP_COMPARE`` (the intra kernel uncapped, as before session 25,
and capped at 168 registers instead of 128).
``--profile-only``: per-kernel profiles (torch profiler) at T = 4k, 16k and the varlen batch, ours at the default
settings and at each of ``PROFILE_VARIANTS`` in the same process, then FLA's (after all of ours), each with its
kernel sum per call.

Prefill: ``rocm_k3`` Triton ``kda_prefill`` (gate, q/k L2 norm and beta sigmoid fused, initial state read and
final state written in place) vs FLA ``chunk_kda`` with the same fusions (``use_gate_in_kernel``, ``safe_gate``,
``lower_bound=-5``, ``use_qk_l2norm_in_kernel``, ``use_beta_sigmoid_in_kernel``, initial state, final state out).
Decode: ``kda_decode`` (conv update + gate + norms + state update + gated RMSNorm, one kernel) vs FLA's
``fused_recurrent_kda_fwd`` with in-place slot states (recurrence, gate and norms only: FLA needs separate
conv and norm launches, not counted), and vs the copy floor: state bytes read + written / measured copy bandwidth.

Roofline numbers: prefill floor = max(FLOPs / bf16 matmul rate, minimal bytes / copy bandwidth), with the
minimal bytes = q, k, v, f (bf16), beta, o read/written once plus the states; both ceilings are measured here
(8192^3 bf16 matmul, 4 GiB device copy). Times: ``triton.testing.do_bench`` medians, in ms.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
from typing import Callable

import torch
import triton

from rocm_k3.ops.kda.datatypes import KDAGateParams
from rocm_k3.triton_kernels.kda import KERNELS
from rocm_k3.triton_kernels.kda import decode as tri_decode
from rocm_k3.triton_kernels.kda import prefill as tri_prefill

# the module, not the package's re-exported function of the same name (its tile knobs live on the module)
tri_conv = importlib.import_module("rocm_k3.triton_kernels.kda.short_conv")

D = 128
LOWER = -5.0


def _bench(fn: Callable[[], object]) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def measure_ceilings() -> tuple[float, float]:
    """(copy bandwidth in bytes/s counting read + write, bf16 matmul FLOP/s) on this GPU."""
    src = torch.empty(1 << 31, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    t_copy = _bench(lambda: dst.copy_(src)) * 1e-3
    bw = 2 * src.numel() * src.element_size() / t_copy
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t_mm = _bench(lambda: a @ b) * 1e-3
    return bw, 2 * 8192**3 / t_mm


@contextlib.contextmanager
def prefill_settings(settings: dict):
    """The prefill module's attributes set to ``settings`` inside the block ("PHASE_WARPS" entries update that
    dict), all restored on leaving."""
    saved = {name: getattr(tri_prefill, name) for name in settings if name != "PHASE_WARPS"}
    saved_warps = dict(tri_prefill.PHASE_WARPS)
    try:
        for name, value in settings.items():
            if name == "PHASE_WARPS":
                tri_prefill.PHASE_WARPS.update(value)
            else:
                setattr(tri_prefill, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(tri_prefill, name, value)
        tri_prefill.PHASE_WARPS.clear()
        tri_prefill.PHASE_WARPS.update(saved_warps)


def _fla():
    try:
        from fla.ops.kda import chunk_kda
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except Exception as exc:  # FLA is an optional peer
        print(f"FLA unavailable: {exc!r}")
        return None, None
    return chunk_kda, fused_recurrent_kda_fwd


def prefill_case(H: int, lengths: list[int], gen: torch.Generator, chunk_kda, sweep: bool,
                 variants: tuple = (), inter_every: int = 0,
                 fresh: tuple[int, ...] = ()) -> dict:
    """One prefill shape; ``variants``: (row key, {prefill attribute: value}) settings timed beside the
    default (PHASE_COMPARE, PREP_COMPARE; "PHASE_WARPS" entries update that dict); ``inter_every``
    > 0 also saves the state every that many tokens of each sequence (prefix caching), ``fresh`` lists the
    sequences without an initial state."""
    T, N = sum(lengths), len(lengths)
    dev = "cuda"
    bf = torch.bfloat16
    q, k, v, f = (torch.randn(T, H, D, generator=gen).to(dev, bf) for _ in range(4))
    beta = torch.randn(T, H, generator=gen).to(dev, bf)
    a_log = (torch.randn(H, generator=gen) * 0.5).to(dev)
    dt_bias = (torch.randn(H * D, generator=gen) * 0.5).to(dev)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    pool = (torch.randn(N, H, D, D, generator=gen) * 0.05).to(dev)
    idx = torch.arange(N, dtype=torch.int32, device=dev)
    has_init = torch.ones(N, dtype=torch.bool, device=dev)
    has_init[list(fresh)] = False
    pool[list(fresh)] = 0.0  # FLA reads them as its (zero) initial states
    params = KDAGateParams(a_log, dt_bias, LOWER)
    inter = None
    if inter_every:
        inter = torch.tensor([[i, p] for i, n in enumerate(lengths) for p in range(inter_every, n + 1, inter_every)],
                             dtype=torch.int32, device=dev).view(-1, 2)
    prefill = KERNELS["kda_prefill"][0]

    def run(*a, **kw):
        return prefill(*a, **kw, intermediate_positions=inter)

    pool0 = pool.clone()  # timing runs update pool in place; correctness checks start from this copy
    name = "varlen " if N > 1 and len(set(lengths)) > 1 else ""
    row = {"op": "kda_prefill", "shape": f"{name}H{H} N{N} T{T} D{D} bf16"
                                         + (f" saves/{inter_every}" if inter_every else "")
                                         + (f" {len(fresh)} fresh" if fresh else ""),
           "ms": _bench(lambda: run(q, k, v, f, beta, cu, pool, idx, has_init, gate_params=params))}
    o_ref = None

    def timed_variant() -> tuple[float, str] | str:
        """(ms, relative error of o against the default's) of the settings now in place, or the error."""
        try:
            o = run(q, k, v, f, beta, cu, pool0.clone(), idx, has_init, gate_params=params).o.float()
            err = ((o - o_ref).norm() / o_ref.norm()).item()
            return (round(_bench(lambda: run(q, k, v, f, beta, cu, pool, idx, has_init, gate_params=params)), 4),
                    f"rel {err:.1e}")
        except Exception as exc:
            return repr(exc)[:80]

    if sweep or variants:
        o_ref = run(q, k, v, f, beta, cu, pool0.clone(), idx, has_init, gate_params=params).o.float()
    if variants:  # other settings of the prefill module, each checked against the default
        for key, settings in variants:
            with prefill_settings(settings):
                row[key] = timed_variant()
    if sweep:  # other state-phase tiles, output fused in the walk or split out; checked against the default
        default_tile, default_split = tri_prefill.state_tile, tri_prefill.SPLIT_OUTPUT
        for tile, split in (((16, 4), False), ((32, 4), False), ((64, 8), False), ((16, 4), True),
                            ((32, 4), True), ((64, 4), True), ((64, 8), True)):
            tri_prefill.state_tile = lambda n, v, tile=tile: tile
            tri_prefill.SPLIT_OUTPUT = split
            key = f"ms_state_bv{tile[0]}_w{tile[1]}" + ("_split" if split else "")
            try:
                row[key] = timed_variant()
            finally:
                tri_prefill.state_tile, tri_prefill.SPLIT_OUTPUT = default_tile, default_split
    if chunk_kda is not None:
        cu64 = cu.long()
        h0 = pool.clone()

        def fla() -> object:
            return chunk_kda(q[None], k[None], v[None], f[None], beta[None], initial_state=h0,
                             output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                             use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=LOWER, A_log=a_log,
                             dt_bias=dt_bias, cu_seqlens=cu64, cu_seqlens_cpu=cu64.cpu())

        with torch.inference_mode():
            try:
                row["fla_ms"] = _bench(fla)
            except Exception as exc:
                row["fla_error"] = repr(exc)[:300]
    chunks = sum(-(-n // 64) for n in lengths)
    # A, Aqk (lower blocks ~ 10/16 of 64x64xD each), WY (2 x 64x64xD), state: W S, QG S, KD^T V' (64xDxD), Aqk V'
    row["flops"] = chunks * H * 2 * (2 * 0.625 * 64 * 64 * D + 2 * 64 * 64 * D + 3 * 64 * D * D + 64 * 64 * D)
    row["min_bytes"] = T * H * (5 * D * 2 + 2) + 2 * N * H * D * D * 4  # q, k, v, f, o bf16; beta; states
    return row


def decode_case(H: int, N: int, gen: torch.Generator, fla_rec, sweep: bool) -> dict:
    dev, bf = "cuda", torch.bfloat16
    S = N
    args = [torch.randn(N, 3 * H * D, generator=gen).to(dev, bf), torch.randn(N, H * D, generator=gen).to(dev, bf),
            torch.randn(N, H, generator=gen).to(dev, bf), torch.randn(N, H * D, generator=gen).to(dev, bf),
            (torch.randn(3 * H * D, 4, generator=gen) * 0.5).to(dev, bf),
            torch.randn(S, 3 * H * D, 3, generator=gen).to(dev, bf), (torch.randn(H, generator=gen) * 0.3).to(dev),
            (torch.randn(H * D, generator=gen) * 0.3).to(dev), torch.randn(D, generator=gen).to(dev, bf),
            (torch.randn(S, H, D, D, generator=gen) * 0.05).to(dev),
            torch.randperm(S, generator=gen).to(dev, torch.int32)]
    run = KERNELS["kda_decode"][0]
    row = {"op": "kda_decode", "shape": f"H{H} N{N} D{D} bf16",
           "ms": _bench(lambda: run(*args, num_heads=H, lower_bound=LOWER))}
    row["state_bytes"] = 2 * N * H * D * D * 4
    if sweep:
        default = tri_decode.DECODE_WARPS, tri_decode.DECODE_PREFETCH
        for warps, prefetch in ((4, True), (16, True), (4, False), (8, False), (16, False)):
            tri_decode.DECODE_WARPS, tri_decode.DECODE_PREFETCH = warps, prefetch
            key = f"ms_decode_w{warps}" + ("" if prefetch else "_late_load")
            try:
                row[key] = round(_bench(lambda: run(*args, num_heads=H, lower_bound=LOWER)), 4)
            except Exception as exc:
                row[key] = repr(exc)[:80]
            finally:
                tri_decode.DECODE_WARPS, tri_decode.DECODE_PREFETCH = default
    if fla_rec is not None:
        q, k, v = (torch.randn(1, N, H, D, generator=gen).to(dev, bf) for _ in range(3))
        g = torch.randn(1, N, H, D, generator=gen).to(dev, bf)
        b = torch.randn(1, N, H, generator=gen).to(dev, bf)
        cu = torch.arange(N + 1, dtype=torch.long, device=dev)
        pool = args[9].clone()

        def fla() -> object:
            return fla_rec(q, k, v, g, b, A_log=args[6], dt_bias=args[7], initial_state=pool,
                           output_final_state=True, inplace_final_state=True, cu_seqlens=cu,
                           ssm_state_indices=args[10], use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                           use_beta_sigmoid_in_kernel=True, lower_bound=LOWER)

        with torch.inference_mode():
            try:
                row["fla_ms"] = _bench(fla)
            except Exception as exc:
                row["fla_error"] = repr(exc)[:300]
    return row


# --profile-only's settings of the prefill module profiled beside the default (same inputs, same process). H100
# 2026-12-05 (session 21, RESULTS.md) at T = 4k / 16k / varlen 16k, kernel sums: session 20's byte cuts together
# (NORMS_IN_INTRA + BAND_IN_DOT_DTYPE, the default since) 1.084 / 4.333 / 4.240 ms against 1.297 / 5.136 / 5.042 for
# session 19's default (NORMS_IN_INTRA alone 1.106 / 4.360 / 4.264, the band alone 1.251 / 4.973 / 4.889); slower than
# session 19's default: the intra kernel scaling raw q, k by the prep's row factors (1.275 / 5.032, a half-way step,
# removed), the norm-taking prep at 16-column slices at 4 / 8 warps (1.534 / 1.483 at 4k), the solving walk at 3
# stages (1.391), the inverting intra kernel at 8 warps (1.678). FLA's chunk_kda: 1.611 / 6.366 / 6.305.
# Session 23 (H100): the gate-only prep at 4 warps 1.031 / 4.108 ms against the default's 1.083 / 4.365 at 4k / 16k (o
# bit-equal), at 64-column slices 1.041 / 4.095; the varlen row was cut. The sliced prep + intra launch (6.96 ms against
# 0.71 for prep + intra) and the whole in-chunk inverse (walk 0.396 against 0.369 ms) were rejected and removed, the
# intra kernel at 2 warps (0.622 against 0.502 ms) and the solving walk at BV 32 (0.609 / 0.551 against 0.369) too.
# Session 24 (H100) adopted the 4 warps (end to end lower at 4k / 16k / 64k / varlen, o bit-equal). Session 25: the
# intra kernel under a register cap (prefill.INTRA_MAXNREG; sm_90 cross-compile: 172-174 registers uncapped, two
# 4-warp programs per SM by registers; 168 fits three, 8 bytes spilled; 128 fits four, 24 bytes spilled; 96 five, 256
# bytes; 80 six, 424 bytes). Session 25 (H100) adopted the cap of 128 (intra 0.502 -> 0.444 ms at 4k; end to end
# -5.8 / -5.4 / -5.9 / -5.8 % at 4k / 16k / 64k / varlen in the adopting call, o bit-equal; 168: ~1 %); the uncapped
# kernel stays as the reference row.
# Caps 96 / 80 lost 25 % / 76 % end to end at 4k (spills); the intra phase as one program per (chunk, head) over its
# four sub-blocks (no re-reads, 255 registers) lost 27-34 % (prefill.INTRA_MAXNREG's comment): both dropped.
_INTRA_CAP = {None: {"INTRA_MAXNREG": None}, 168: {"INTRA_MAXNREG": 168}}
PROFILE_VARIANTS = (("intra uncapped (before session 25)", _INTRA_CAP[None]),
                    ("intra capped at 168 registers (3 programs per SM)", _INTRA_CAP[168]))


def _kernel_ms(prof, calls: int) -> float:
    """Sum of the device kernels' own time per call (ms) in a torch profile of ``calls`` calls."""
    total = 0.0
    for ev in prof.key_averages():
        total += getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0.0)
    return total / calls / 1e3


def profile_prefill(H: int, lengths: list[int], gen: torch.Generator, chunk_kda=None,
                    variants: tuple = PROFILE_VARIANTS, ours: bool = True) -> None:
    """Per-kernel CUDA time of one prefill call (torch profiler, 10 calls) over sequences of ``lengths`` tokens:
    ours at the default settings, ours at each of ``variants`` (with the relative error of o against the
    default's; neither without ``ours``) and FLA's ``chunk_kda`` when given; each table is followed by its kernel
    sum per call. Each of ours also gets o's relative error against the same inputs in fp32 through the prefill's
    fp32 path."""
    from torch.profiler import ProfilerActivity, profile

    T, N = sum(lengths), len(lengths)
    q, k, v, f = (torch.randn(T, H, D, generator=gen).to("cuda", torch.bfloat16) for _ in range(4))
    beta = torch.randn(T, H, generator=gen).to("cuda", torch.bfloat16)
    a_log, dt_bias = torch.zeros(H, device="cuda"), torch.zeros(H * D, device="cuda")
    params = KDAGateParams(a_log, dt_bias, LOWER)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    pool = torch.zeros(N, H, D, D, device="cuda")
    idx = torch.arange(N, dtype=torch.int32, device="cuda")
    hi = torch.ones(N, dtype=torch.bool, device="cuda")
    pool0 = pool.clone()  # the profiled calls update pool in place; the error checks start from this copy
    run = KERNELS["kda_prefill"][0]

    def ours_call():
        return run(q, k, v, f, beta, cu, pool, idx, hi, gate_params=params)

    calls = ([("rocm_k3", ours_call, {})] + [(f"rocm_k3 {name}", ours_call, settings) for name, settings in variants]
             if ours else [])
    if chunk_kda is not None:
        cu64, h0 = cu.long(), pool.clone()
        calls.append(("FLA chunk_kda", lambda: chunk_kda(
            q[None], k[None], v[None], f[None], beta[None], initial_state=h0, output_final_state=True,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
            lower_bound=LOWER, A_log=a_log, dt_bias=dt_bias, cu_seqlens=cu64, cu_seqlens_cpu=cu64.cpu()), {}))
    shape = f"T = {T}" + (f" in {N} sequences {lengths}" if N > 1 else "")
    o_ref = None
    with torch.inference_mode():  # the same inputs in fp32 through the fp32 path (fp32 dots, row-by-row inverses)
        o_32 = run(q.float(), k.float(), v.float(), f.float(), beta.float(), cu, pool0.clone(), idx, hi,
                   gate_params=params).o if ours else None
    for name, call, settings in calls:
        try:
            with prefill_settings(settings), torch.inference_mode():
                note = ""
                if name.startswith("rocm_k3"):
                    o = run(q, k, v, f, beta, cu, pool0.clone(), idx, hi, gate_params=params).o.float()
                    if o_ref is None:
                        o_ref = o
                    else:
                        note = f", o relative error vs the default {((o - o_ref).norm() / o_ref.norm()).item():.1e}"
                    note += f", vs the fp32 path {((o - o_32).norm() / o_32.norm()).item():.1e}"
                for _ in range(3):
                    call()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        call()
                    torch.cuda.synchronize()
        except Exception as exc:  # a variant that does not compile (shared memory, registers) is reported, not fatal
            print(f"\n{name}: H = {H}, {shape}: failed: {repr(exc)[:300]}", flush=True)
            continue
        print(f"\n{name}: H = {H}, {shape}, 10 calls; kernel sum {_kernel_ms(prof, 10):.3f} ms per call{note}",
              flush=True)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12), flush=True)


ACCURACY_SETTINGS = (("default", {}),)


def correlated_accuracy(gen: torch.Generator, H: int = 8, T: int = 2048, device: str = "cuda",
                        chunk_kda=None) -> None:
    """bf16 prefill error on keys of decreasing spread around one direction (random, 3e-2, 1e-3), weak decay (a raw
    log-decay in (-1e-3, 0), no gate) and beta 0.99: there (I + A) is nearly singular per chunk and the in-chunk
    solve cancels, the inputs where the A band's bf16 rounding shows (session 23: the whole in-chunk inverse, since
    removed, lost there). Per setting of ACCURACY_SETTINGS: o's and the final state's relative error
    against the same inputs through the fp32 path (fp32 dots, row-by-row inverses: 1e-5 of the reference op), and
    FLA's chunk_kda on the same bf16 inputs when given (the peer's level: its WY form V' = U - W S rounds U and W to
    bf16)."""
    run = KERNELS["kda_prefill"][0]
    print(f"\ncorrelated keys, H = {H}, T = {T}, D = {D}: relative error against the fp32 path (o / final state)")
    for spread in (None, 3e-2, 1e-3):
        base = torch.randn(1, H, D, generator=gen)
        k = torch.randn(T, H, D, generator=gen) if spread is None else base + spread * torch.randn(T, H, D,
                                                                                                     generator=gen)
        q, v = torch.randn(T, H, D, generator=gen), torch.randn(T, H, D, generator=gen)
        f = -1e-3 * torch.rand(T, H, D, generator=gen)
        beta = torch.full((T, H), 0.99)
        args = [x.to(device, torch.bfloat16) for x in (q, k, v)] + [f.to(device), beta.to(device, torch.bfloat16)]
        cu = torch.tensor([0, T], dtype=torch.int32, device=device)
        idx, hi = torch.zeros(1, dtype=torch.int32, device=device), torch.zeros(1, dtype=torch.bool, device=device)
        pool32 = torch.zeros(1, H, D, D, device=device)
        o32 = run(*[a.float() for a in args], cu, pool32, idx, hi, beta_logits=False).o
        cells = []
        for name, settings in ACCURACY_SETTINGS:
            pool = torch.zeros(1, H, D, D, device=device)
            with prefill_settings(settings), torch.inference_mode():
                o = run(*args, cu, pool, idx, hi, beta_logits=False).o.float()
            eo = ((o - o32).norm() / o32.norm()).item()
            es = ((pool - pool32).norm() / pool32.norm()).item()
            cells.append(f"{name} {eo:.1e} / {es:.1e}")
        if chunk_kda is not None:
            q_, k_, v_, f_, b_ = (a[None] for a in args)
            try:
                with torch.inference_mode():
                    o, s_fla = chunk_kda(q_, k_, v_, f_, b_, initial_state=torch.zeros(1, H, D, D, device=device),
                                         output_final_state=True, use_qk_l2norm_in_kernel=True,
                                         cu_seqlens=cu.long(), cu_seqlens_cpu=cu.long().cpu())
                eo = ((o[0].float() - o32).norm() / o32.norm()).item()
                es = ((s_fla.float() - pool32).norm() / pool32.norm()).item()
                cells.append(f"FLA chunk_kda {eo:.1e} / {es:.1e}")
            except Exception as exc:  # the peer's failure is reported, not fatal
                cells.append(f"FLA chunk_kda failed: {repr(exc)[:120]}")
        print(f"  spread {'random' if spread is None else spread}: " + "; ".join(cells), flush=True)


# (BT tokens, BC channels, warps): the old default (32, 128, 4), more tokens per program (64 .. 256), BC 64 / 128 /
# 256, 2 / 4 / 8 warps; conv_case times short_conv's current default first, whether it is listed here or not
CONV_TILES = ((32, 128, 4), (32, 128, 2), (32, 64, 2), (64, 64, 2), (64, 64, 4), (64, 128, 4), (64, 128, 8),
              (128, 64, 4), (128, 128, 4), (128, 128, 8), (256, 128, 8), (256, 64, 4), (32, 256, 4), (64, 256, 8),
              (128, 256, 8), (16, 256, 4))


def conv_case(bw: float) -> None:
    """--conv: the prefill short conv at the K3-width slice's shape (16 sequences x 512 tokens with initial states,
    C = 3 x 96 x 128, x a column slice of the KDA in_proj output as the model passes it) per (BT, BC, warps) tile,
    beside torch's depthwise conv1d (cuDNN; contiguous channels-first input, no state: a lower bound on its work)
    and the floor (x read + y written once / measured copy bandwidth)."""
    T, C, W = 8192, 3 * 96 * 128, 4
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(T, C + 128 + 96 + 96 * 128, generator=gen).to("cuda", torch.bfloat16)
    x = wide[:, :C]
    w = (0.5 * torch.randn(C, W, generator=gen)).to("cuda", torch.bfloat16)
    cu = torch.arange(0, T + 1, 512, dtype=torch.int32, device="cuda")
    pool = torch.randn(17, C, W - 1, generator=gen).to("cuda", torch.bfloat16)
    idx = torch.arange(16, dtype=torch.int32, device="cuda")
    hi = torch.ones(16, dtype=torch.bool, device="cuda")
    floor = 2 * T * C * 2 / bw * 1e3
    default = (tri_conv._BT, tri_conv._BC, tri_conv._WARPS)
    ref = tri_conv.short_conv(x, w, cu, conv_state=pool.clone(), state_indices=idx, has_initial_state=hi)
    print(f"short_conv T {T} C {C} W {W} (16 sequences, initial states, strided x): floor {floor:.3f} ms", flush=True)
    try:
        for bt, bc, warps in (default, *(tile for tile in CONV_TILES if tile != default)):
            tri_conv._BT, tri_conv._BC, tri_conv._WARPS = bt, bc, warps
            y = tri_conv.short_conv(x, w, cu, conv_state=pool.clone(), state_indices=idx, has_initial_state=hi)
            same = torch.equal(y, ref)
            ms = _bench(lambda: tri_conv.short_conv(x, w, cu, conv_state=pool, state_indices=idx,
                                                     has_initial_state=hi))
            mark = " (default)" if (bt, bc, warps) == default else ""
            print(f"  BT {bt:>3} BC {bc:>3} warps {warps}: {ms:.3f} ms, {100 * floor / ms:.0f} % of the floor, "
                  f"output == default's: {same}{mark}", flush=True)
    finally:
        tri_conv._BT, tri_conv._BC, tri_conv._WARPS = default
    xc = x.t().contiguous()[None]  # [1, C, T]
    peer = _bench(lambda: torch.nn.functional.conv1d(xc, w[:, None, :], padding=W - 1, groups=C))
    print(f"  peer torch conv1d (depthwise, cuDNN, channels-first, no state): {peer:.3f} ms", flush=True)


# (row key, prefill settings): --phase-compare's: the state walk's tile (BV, warps) and pipeline stages


def _walk(bv: int, warps: int, stages: int) -> dict:
    return {"state_tile": lambda n, v: (bv, warps), "STATE_STAGES": stages}


# Session 25 (H100, RESULTS.md): the solving walk over the whole value width (BV 128, one program per (sequence, head))
# at 8 warps, KB, QG and KD read once per head instead of once per value block (sm_90: 254 registers, no spills at 2
# stages; the default BV 64 / 4 warps / 2 stages holds 255 with 128 bytes spilled): 1.431 / 5.572 / 22.52 ms end to
# end at 4k / 16k / 64k (1 stage 1.885 / 7.386 / 29.80) against the default's 0.979 / 3.836 / 15.51, o bit-equal:
# rejected (the step's chain grows with the program's width; BV 32 lost the other way, session 23). Earlier rows
# (RESULTS.md): the four launches (session 19), BV 64 at 8 warps / 1-2 stages.
PHASE_COMPARE = (("ms_walk_bv128_w8_s2", _walk(128, 8, 2)), ("ms_walk_bv128_w8_s1", _walk(128, 8, 1)))
# ... and --prep-compare's (until session 26: the intra kernel uncapped and at a cap of 168 registers against
# today's), also while saving states. Session 24 (H100, RESULTS.md) adopted the 4-warp prep this way (its rows also had session
# 19's default: NORMS_IN_INTRA and BAND_IN_DOT_DTYPE off), session 21 session 20's byte cuts, session 19 the four
# launches, INTRA_INVERTS by products and the solve in the walk.
# Session 27 (H100, RESULTS.md) adopted FAST_EXP this way and rejected the walk's L2 prefetch, the 8-warp walk and
# the transposed walk (BV 64 and 128).
# Session 28 (H100, RESULTS.md) adopted the gate-only prep at 1 warp this way (against 2 warps, BK 64, BK 16 at 1 warp)
# and rejected GATE_IN_INTRA. Session 29 (H200) adopted GATE_FACTORS this way (the fp32-G row: its predecessor).
# Session 30: the walk solving by whole-chunk products (WALK_HORNER, at HORNER_WALK_STAGES = 1: its 2-stage build holds
# 172 KB of shared memory on sm_90, one program per SM).
PREP_COMPARE = (("ms_fp32_g", {"GATE_FACTORS": False}), ("ms_horner", {"WALK_HORNER": True}))
VARLEN = [3000, 200, 7000, 64, 1500, 4520]  # mixed lengths, 16,284 tokens


def prefill_cases(sweep: bool, phase_compare: bool = False, prep_compare: bool = False) -> list[tuple]:
    """(H, lengths, state-tile sweep, variants, save every, sequences without an initial state) per row."""
    if phase_compare or prep_compare:  # the K3 shapes of issue 35 item 1 only: few compiles
        v = PHASE_COMPARE if phase_compare else PREP_COMPARE
        rows = [(96, [4096], False, v, 0, ()), (96, [16384], False, v, 0, ()), (96, [65536], False, v, 0, ()),
                (96, VARLEN, False, v, 0, (1, 3))]
        saving = v[:2] if phase_compare else v
        return rows + [(96, VARLEN, False, saving, 1024, (1, 3))]
    return [(96, [1024], False, (), 0, ()), (96, [4096], sweep, (), 0, ()), (96, [16384], False, (), 0, ()),
            (96, [65536], False, (), 0, ()), (96, VARLEN, False, (), 0, (1, 3)),
            (96, VARLEN, False, (), 1024, (1, 3)), (96, [1024] * 4, False, (), 0, ()),
            (12, [4096], False, (), 0, ()), (12, [8192] * 4, False, (), 0, ())]


def _progress(row: dict, path: str | None) -> None:
    """Print a finished row and append it to ``path`` + '.rows' (so a run cut short keeps its numbers)."""
    print(row, flush=True)
    if path:
        with open(path + ".rows", "a") as fh:
            fh.write(json.dumps(row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write all rows to this file")
    parser.add_argument("--sweep", action="store_true", help="also time other tile/warp choices")
    parser.add_argument("--profile", action="store_true", help="per-kernel times of one K3 prefill (ours, FLA)")
    parser.add_argument("--conv", action="store_true", help="only the prefill short conv's tiles vs torch conv1d")
    parser.add_argument("--profile-only", action="store_true",
                        help="only the per-kernel profiles, at T = 4096, 16384 and the varlen batch (H = 96): ours "
                             "(default and PROFILE_VARIANTS) and FLA's")
    parser.add_argument("--prefill-only", action="store_true", help="skip the decode rows")
    parser.add_argument("--phase-compare", action="store_true",
                        help="prefill rows T = 4k/16k/64k + varlen (+ saving states) only: the default vs the "
                             "PHASE_COMPARE settings (state-walk tiles and stages) vs FLA")
    parser.add_argument("--prep-compare", action="store_true",
                        help="as --phase-compare, with the PREP_COMPARE settings (the intra kernel uncapped "
                             "and capped at 168 registers)")
    parser.add_argument("--saving-only", action="store_true",
                        help="with --phase-compare / --prep-compare: only the row that also saves states")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    bw, mm = measure_ceilings()
    print(f"measured ceilings: copy {bw / 1e12:.2f} TB/s (read + write), bf16 matmul {mm / 1e12:.0f} TFLOP/s")
    if args.conv:
        conv_case(bw)
        return
    chunk_kda, fla_rec = _fla()
    if args.profile_only:
        try:
            correlated_accuracy(gen, chunk_kda=chunk_kda)
        except Exception as exc:  # an accuracy table that fails must not cost the profiles after it
            print(f"correlated_accuracy failed: {repr(exc)[:300]}", flush=True)
        # ours at every shape first, then FLA's (its first call per shape autotunes, > 150 s at 4k on a fresh
        # machine in session 24: a cap cut there keeps all of ours); each shape's inputs seeded by its length
        for with_fla in (False, True):
            for lengths in ([4096], [16384], VARLEN):
                shape_gen = torch.Generator().manual_seed(sum(lengths))
                profile_prefill(96, lengths, shape_gen, chunk_kda if with_fla else None, ours=not with_fla)
        return
    rows = []
    skip_decode = args.prefill_only or args.phase_compare or args.prep_compare
    for H, N in () if skip_decode else ((96, 64), (96, 256), (12, 256), (12, 1024)):
        rows.append(decode_case(H, N, gen, fla_rec, args.sweep))
        _progress(rows[-1], args.json)
    cases = prefill_cases(args.sweep, args.phase_compare, args.prep_compare)
    if args.saving_only:
        cases = [c for c in cases if c[4] > 0]
    for H, lengths, tiles, variants, every, fresh in cases:
        rows.append(prefill_case(H, lengths, gen, chunk_kda, tiles, variants, every, fresh))
        _progress(rows[-1], args.json)
    if args.profile:
        profile_prefill(96, [4096], gen, chunk_kda)
    print(f"\n{'op':<11} {'shape':<26} {'ours ms':>8} {'FLA ms':>8} {'speedup':>8} {'floor ms':>9} {'% floor':>8}")
    for r in rows:
        if r["op"] == "kda_prefill":
            floor = max(r["flops"] / mm, r["min_bytes"] / bw) * 1e3
        else:
            floor = r["state_bytes"] / bw * 1e3
        r["floor_ms"] = floor
        fla = r.get("fla_ms")
        sp = f"{fla / r['ms']:.2f}x" if fla else "n/a"
        print(f"{r['op']:<11} {r['shape']:<26} {r['ms']:8.3f} {fla if fla else float('nan'):8.3f} {sp:>8} "
              f"{floor:9.3f} {100 * floor / r['ms']:7.1f}%")
        extra = {k: v for k, v in r.items() if k.startswith("ms_") or k == "fla_error"}
        if extra:
            print("    ", extra)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"copy_bw": bw, "matmul_flops": mm, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
