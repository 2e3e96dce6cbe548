"""MXFP4 routed-expert MoE on the H200: rocm-k3's Triton kernel vs OpenAI's triton_kernels in one run.

Run on the GPU with the peer carried (never installed or committed; see shared/PLATFORM.md: unzip only
``vllm/third_party/triton_kernels`` of the vLLM 0.33 wheel and put its parent on PYTHONPATH)::

    PYTHONPATH=.:<carry>/peer/vllm/third_party python3 benchmarks/bench_moe.py [--tokens 1 4 16] [--sweep] [--out DIR]

Shapes: K3 routed experts, E = 896, top-16, w13 3584 -> 2 x 3072 (SiTU), w2 3072 -> 3584, MXFP4 codes with E8M0
scales 2^-6..2^-3 (uniform random bytes), bf16 activations. Both sides get the same expert ids for every token
(random, distinct per token) and read the same bytes; times are medians of CUDA-graph replays of the whole op
from router logits to the [T, 3584] output (ours: rocm-k3's Triton ``route`` + ``fused_moe``, whose GEMMs on the
H200 are the warp-specialised Hopper kernel, ``--gemm-ab`` adds ``moe_gemm_kernel``, ``--ws-sweep`` the Hopper
kernel's WsConfig variants; the peer: its
``routing`` (its softmax top-k of the same logits picks the same ids) + ``matmul_ogs`` w13 with its fused SwiGLU +
``matmul_ogs`` w2 with the routing weights and its top-k scatter-reduce). Ours are timed for every T first, the
peer after, so a fault in the peer cannot lose our numbers (on 2026-12-01 it faulted at T = 16 when given the ids
through ``routing(..., expt_indx=...)``; it now routes the logits itself). % of HBM = active expert bytes
(codes + scales of the experts the batch uses, each read once) / 4.27 TB/s / time. The peer runs A16W4 only;
A8W4 is ours (x and the intermediate rounded through MXFP8, as the reference does). MMA% (the ceiling of the
compute-bound prefill rows) = T x 16 pairs x 66.06 MFLOP (w13 2 x 3584 x 6144 + w2 2 x 3072 x 3584 per pair) /
989 TFLOP/s (H200 dense bf16, spec) / time (TFLOP/s: the same FLOPs / time). ``--prefill-sweep`` times the prefill
tile candidates (:func:`prefill_sweep_configs`, the sweep behind ``fused.TILE_TABLE``). ``--sweep`` times the tile
variants of ``moe_gemm_kernel`` too. The static SASS count of its K loop (cross-compiled on this machine for sm_90
with its Triton, cuobjdump) is printed per weight element (the Hopper kernel's: the compile tier checks it).

``--experts E`` (default 896) sets the number of routed experts (top-16 of them). ``--grouped`` times the
prefill path of :mod:`rocm_k3.triton_kernels.moe.grouped` (``gemm="grouped"``: dequantised experts + bf16
``torch._grouped_mm``, the whole op: align, host read of the counts, gather, dequant, GEMMs, activation, combine;
eager ``do_bench``, since it syncs with the host once) beside the warp-specialised kernel (``gemm="ws"``, graph
replays) for A16W4 and A8W4. Every run also times an 8192^3 bf16 matmul (torch, graph replays): mm% is the op's
TFLOP/s as a share of that measured peak (beside MMA%, the share of the 989 TFLOP/s spec).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import traceback
from pathlib import Path

import torch
import triton
import triton.testing

from rocm_k3.ops.moe import ExpertWeights, MoEActivation
from rocm_k3.ops.moe_reference import fused_moe_reference
from rocm_k3.triton_kernels.moe import kernels as K
from rocm_k3.triton_kernels.moe.fused import MoEConfig, fused_moe_with, pick_config, prepare_weights
from rocm_k3.triton_kernels.moe.grouped import rows_rule as grouped_rule
from rocm_k3.triton_kernels.moe.pointwise import route

HBM_BPS = 4.27e12
E, TOP_K, HIDDEN, N = 896, 16, 3584, 3072
EXPERT_BYTES = (2 * N * HIDDEN // 2 + 2 * N * HIDDEN // 32) + (HIDDEN * N // 2 + HIDDEN * N // 32)  # 17.55 MB
PAIR_FLOPS = 2 * HIDDEN * 2 * N + 2 * N * HIDDEN  # w13 + w2 per (token, expert) pair: 66.06 MFLOP
MMA_PEAK = 989e12  # H200 dense bf16 MMA (spec): the ceiling of the compute-bound prefill rows


def sweep_configs(picked: MoEConfig, tokens: int) -> list[MoEConfig]:
    """Our tile variants around the picked config at T = tokens (the picked one first: the reference of the
    correctness check): the other item schedule (static / dynamic), pipeline depth, residency, w2 K splits at
    decode, 32-row blocks at prefill (3 programs per SM cap 64-row blocks at 168 registers: ptxas spills ~120
    bytes there), and 5 / 6 resident programs per SM at 16-row blocks (96 / 80 registers: ptxas fits the K loop
    without spills, at 388 instead of 358 SASS per 128 weights)."""
    rep = dataclasses.replace
    other = not picked.dynamic
    out = [picked, rep(picked, dynamic=other), rep(picked, dynamic=other, num_stages=4), rep(picked, num_stages=4),
           rep(picked, programs_per_sm=3, max_registers=168 if picked.block_m in (16, 64) else None)]
    if picked.block_m == 16:
        out += [rep(picked, programs_per_sm=5, max_registers=96), rep(picked, programs_per_sm=6, max_registers=80)]
    if tokens <= 4:
        out += [rep(picked, split_k=s) for s in (2, 4)]
    if tokens >= 512:
        out += [rep(picked, block_m=32, programs_per_sm=3, max_registers=168),
                rep(picked, block_m=32, programs_per_sm=4, max_registers=128)]
    if tokens >= 1024:  # bigger row blocks at prefill: 128 rows, one program per SM, no register cap
        out += [rep(picked, block_m=128, programs_per_sm=1, max_registers=None, num_stages=st) for st in (2, 3)]
    return out


def ws_sweep_configs(picked: MoEConfig, tokens: int) -> list[tuple[MoEConfig, object]]:
    """(MoEConfig, WsConfig) variants of the warp-specialised Hopper kernel at T = tokens, its default first: no
    programmatic dependent launch, producer registers, ring depth, and at prefill the other block sizes (each with
    its default residency)."""
    from rocm_k3.triton_kernels.moe import gemm_hopper as H

    rep = dataclasses.replace
    base = H.default_config(picked.block_m)
    out = [(picked, base), (picked, rep(base, pdl=False))]
    out += [(picked, rep(base, producer_regs=r)) for r in (24, 32, 40) if r != base.producer_regs]
    out += [(picked, rep(base, w2_split=p)) for p in (1, 2, 3, 4) if tokens <= 16]
    candidates = [(picked, dict(stages=st)) for st in (3, 5)]
    if tokens >= 512:
        candidates += [(rep(picked, block_m=bm), dict(block_m=bm)) for bm in (16, 32, 64) if bm != picked.block_m]
    if picked.block_m == 64:
        candidates += [(picked, dict(stages=2, ctas_per_sm=3, max_registers=80, producer_regs=24)),
                       (picked, dict(stages=3, ctas_per_sm=3, max_registers=80, producer_regs=24))]
    for moe, change in candidates:
        try:  # residencies the SM cannot hold are skipped
            ws = H.default_config(change["block_m"]) if "block_m" in change else rep(base, **change)
        except ValueError:
            continue
        out.append((moe, ws))
    return out


def prefill_sweep_configs(picked: MoEConfig, tokens: int) -> list[tuple[MoEConfig, object]]:
    """(MoEConfig, WsConfig, a (w13, w2) pair of them, or None for ``moe_gemm_kernel``) tile candidates of the
    prefill tile table at T = tokens (>= 256): the Hopper kernel at the block sizes from a quarter of an expert's average rows to the first that holds
    them (128-row blocks, one CTA per SM, from T = 1024), each at its default residency and one ring depth either side,
    at 32 / 64-row blocks also 256-row weight tiles (``gemm_hopper.wide_config``) for both GEMMs and for w2 alone (a
    (w13, w2) pair; session 16 measured w2 -18 % and w13 +12 % on them at T = 2048), and from T = 2048
    ``moe_gemm_kernel`` at 128-row blocks (one program per SM)."""
    from rocm_k3.triton_kernels.moe import gemm_hopper as H

    rep = dataclasses.replace
    per_expert = tokens * TOP_K / E
    out = []
    for bm in H.BLOCK_SIZES:
        if bm < per_expert / 4 or bm > 16 and bm / 2 > per_expert * 1.75 or bm == 128 and tokens < 1024:
            continue  # blocks of under a quarter of an expert's rows, or mostly padding
        moe = rep(picked, block_m=bm, programs_per_sm=1 if bm == 128 else picked.programs_per_sm)
        base = H.default_config(bm)
        out.append((moe, base))
        for st in (base.stages - 1, base.stages + 1):
            try:  # ring depths the SM cannot hold at this residency are skipped
                out.append((moe, rep(base, stages=st)))
            except ValueError:
                continue
        if bm in (32, 64):  # 256-row tiles for both GEMMs, and for w2 only (w13 on its default 128-row tiles)
            out.append((moe, H.wide_config(bm)))
            out.append((moe, (base, H.wide_config(bm))))
    if tokens >= 2048:
        out.append((rep(picked, block_m=128, programs_per_sm=1, max_registers=None), None))
    return out


def _ws_short(moe: MoEConfig, ws) -> str:
    """The WsConfig's fields that differ from the default of its block size, e.g. ``bm64 pdlFalse``; a (w13, w2)
    pair as ``w13[...] w2[...]``."""
    from rocm_k3.triton_kernels.moe import gemm_hopper as H

    if isinstance(ws, tuple):
        return " ".join(f"{name}[{_ws_short(moe, w)}]" for name, w in zip(("w13", "w2"), ws))
    base = H.default_config(ws.block_m)
    parts = [f"bm{ws.block_m}"] + [f"{f.name}{getattr(ws, f.name)}" for f in dataclasses.fields(ws)
                                   if getattr(ws, f.name) != getattr(base, f.name)]
    return " ".join(parts)


def _regex(text: str) -> re.Pattern:
    try:
        return re.compile(text)
    except re.error as exc:
        raise argparse.ArgumentTypeError(f"not a regular expression: {text!r} ({exc})") from None


def _short(cfg: MoEConfig) -> str:
    """The config's fields that differ from MoEConfig()'s, e.g. ``bm64 pps2 regsNone dynamic``."""
    names = dict(block_m="bm", block_k="bk", num_warps="warps", num_stages="stages", split_k="split",
                 programs_per_sm="pps", max_registers="regs", dynamic="dynamic")
    base = MoEConfig()
    parts = []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if v != getattr(base, f.name):
            name = names.get(f.name, f.name)
            parts.append(name if v is True else f"{name}{v}")
    return " ".join(parts) or "default tiles"


def kernel_times(fn, args: tuple, reps: int = 10) -> dict[str, float]:
    """Mean GPU microseconds per call of each kernel the op launches (torch.profiler over eager calls; the two
    expert GEMMs, ``moe_gemm_kernel`` or ``moe_gemm_ws_kernel``, are told apart by their launch order)."""
    from torch.profiler import ProfilerActivity, profile

    fn(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn(*args)
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    gemm = 0
    for ev in prof.events():
        if ev.device_type.name != "CUDA":
            continue
        name = ev.name
        if name.startswith(("moe_gemm_kernel", "moe_gemm_ws_kernel")):  # either kernel may run either GEMM
            name = f"{name.split('_kernel')[0]}_kernel w{'13' if gemm % 2 == 0 else '2'}"
            gemm += 1
        totals[name] = totals.get(name, 0.0) + ev.device_time / reps
    return totals


def timed(fn, eager: bool = False) -> float:
    """Median milliseconds of CUDA-graph replays (eager do_bench if the op cannot be captured, or if ``eager``)."""
    fn()
    torch.cuda.synchronize()
    if eager:
        return triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median")
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median")
    except Exception as exc:  # noqa: BLE001 - report and fall back
        print(f"  (graph capture failed: {exc!r:.120}; eager timing)", flush=True)
        return triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median")


def experts(dev: str) -> ExpertWeights:
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randint(0, 256, (E, 2 * N, HIDDEN // 2), dtype=torch.uint8, device=dev, generator=g)
    w2 = torch.randint(0, 256, (E, HIDDEN, N // 2), dtype=torch.uint8, device=dev, generator=g)
    s13 = torch.randint(121, 125, (E, 2 * N, HIDDEN // 32), dtype=torch.uint8, device=dev, generator=g)
    s2 = torch.randint(121, 125, (E, HIDDEN, N // 32), dtype=torch.uint8, device=dev, generator=g)
    return ExpertWeights("mxfp4", w13, s13, w2, s2)


def routing_inputs(t: int, dev: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(router logits fp32 [T, E], chosen ids int32 [T, k]: distinct random experts, the logits' top-k)."""
    ids = torch.rand(t, E, device=dev).argsort(dim=1)[:, :TOP_K].to(torch.int32)
    logits = torch.randn(t, E, device=dev) - 4.0
    logits.scatter_(1, ids.long(), 4.0 + torch.rand(t, TOP_K, device=dev))  # the ids are the top-k of both routers
    return logits, ids


class Peer:
    """OpenAI triton_kernels (v3.5/3.6 ``matmul_ogs`` API) on the same bytes: w [E, K, N] FP4 in its Hopper
    value layout, scales in its Hopper scale layout, SwiGLU (alpha 1.702, limit 7) fused on interleaved columns."""

    def __init__(self, w: ExpertWeights) -> None:
        from triton_kernels import swiglu
        from triton_kernels.matmul_ogs import FlexCtx, FnSpecs, FusedActivation, PrecisionConfig, matmul_ogs
        from triton_kernels.numerics import InFlexData
        from triton_kernels.routing import routing
        from triton_kernels.tensor import FP4, convert_layout, wrap_torch_tensor
        from triton_kernels.tensor_details import layout

        self.matmul_ogs, self.routing = matmul_ogs, routing
        value_layout, value_opts = layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
        scale_layout, scale_opts = layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=8)

        def swizzle(codes, scales):  # checkpoint [E, N, K/2] -> [E, K, N] (quantisation axis 1)
            q = convert_layout(wrap_torch_tensor(codes.transpose(-2, -1), dtype=FP4), value_layout, **value_opts)
            s = convert_layout(wrap_torch_tensor(scales.transpose(-2, -1)), scale_layout, **scale_opts)
            return q, PrecisionConfig(weight_scale=s, flex_ctx=FlexCtx(rhs_data=InFlexData()))

        self.w1, self.pc1 = swizzle(w.w13, w.w13_scale)
        self.w2, self.pc2 = swizzle(w.w2, w.w2_scale)
        self.act = FusedActivation(FnSpecs("swiglu", swiglu.swiglu_fn, ("alpha", "limit")), (1.702, 7.0), 2)

    def __call__(self, x: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        del ids  # the logits' top-k are these ids (routing_inputs); its own top-k picks them
        rdata, gather, scatter = self.routing(logits, TOP_K, sm_first=False)
        h = self.matmul_ogs(x, self.w1, None, rdata, gather_indx=gather, precision_config=self.pc1,
                            fused_activation=self.act)
        return self.matmul_ogs(h, self.w2, None, rdata, scatter_indx=scatter, precision_config=self.pc2,
                               gammas=rdata.gate_scal)


def ours(prepared: ExpertWeights, act_quant: str, config: MoEConfig | None, act_math: str | None = None,
         gemm: str | None = None, ws_config=None):
    kw = dict(activation=MoEActivation(), act_quant=act_quant,
              fp8_dtype=torch.float8_e4m3fn if act_quant == "mxfp8" else None, config=config, act_math=act_math,
              gemm=gemm, ws_config=ws_config)

    def run(x: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        r = route(logits, TOP_K)
        return fused_moe_with(x, prepared, r.weights, r.ids, **kw)
    return run


def sass_per_weight() -> dict:
    """Static SASS of our K loop per weight element (w13 and w2 at the decode tiles, no K split), for this GPU's
    Triton."""
    from rocm_k3.triton_kernels.compile_check import compile_kernel, sass_loops

    out = {}
    for stage, split in ((1, 1), (2, 1)):
        ce = dict(STAGE=stage, W_FMT=0, DECODE=0, FOLD=True, OP_F32=False, DOT_F32=False, ACT=0, HAS_LINEAR_BETA=True,
                  OUT_MX=False, EMAX=8, BIAS=7, FP8_MAX=448.0, EVEN_K=True, SPLIT=split, BMT=16, KU=2, STAGES=3,
                  DYNAMIC=False, FAST_ACT=True)
        sig = dict(K.GEMM_SIGNATURE, out_ptr="*bf16" if stage == 1 else "*fp32")
        res = compile_kernel(K.moe_gemm_kernel, sig, ce, "sm_90", num_warps=4, num_stages=3,
                             divisible_by_16=K.GEMM_DIVISIBLE)
        loops = sass_loops(res.extra["cubin"]) or []
        loop = next((lp for lp in loops if lp.opcodes.get("HGMMA") or lp.opcodes.get("HMMA")), None)
        out[f"w{'13' if stage == 1 else '2'}"] = None if loop is None else dict(
            per_weight=loop.instructions / 128, instructions=loop.instructions, registers=res.registers,
            opcodes=dict(sorted(loop.opcodes.items(), key=lambda kv: -kv[1])))
    return out


def measured_mm_peak() -> float:
    """TFLOP/s of an 8192^3 bf16 torch matmul (graph replays): the measured ceiling of the MoE GEMMs."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = timed(lambda: a @ b)
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


def _time_variants(t: int, inputs: tuple, variants: list, mm_peak: float | None = None) -> list[dict]:
    """Time each (label, fn(x, logits, ids)) at T = t; print and return the rows."""
    x, logits, ids = inputs
    used = torch.unique(ids).numel()
    nbytes = used * EXPERT_BYTES
    floor_us = nbytes / HBM_BPS * 1e6
    rows = []
    # the first variant's output per label word 2 ("A16W4", "A8W4"): checks the later variants of one call (the
    # sweep's tiles against the picked ones); a call's first variant, and the peer, is only its own reference
    refs: dict[str, torch.Tensor] = {}
    for label, fn in variants:
        try:
            out = fn(x, logits, ids).float()
            ref = refs.setdefault(label.split()[1], out)
            err = ((out - ref).norm() / ref.norm()).item()
            # A8W4 on the grouped path: its bf16 w13 output flips a few % of the MXFP8 roundings (grouped.py)
            if not err < (3e-2 if "grouped" in label and "A8W4" in label else 1e-2):  # NaN fails too
                print(f"{t:>5} {used:>7} {floor_us:8.1f}us {label:<42} WRONG: rel. error {err:.2e} vs the first "
                      "variant", flush=True)
                continue
            us = timed(lambda: fn(x, logits, ids), eager="grouped" in label) * 1e3
        except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, the run goes on
            print(f"{t:>5} {used:>7} {floor_us:8.1f}us {label:<42} FAILED {exc!r:.200}", flush=True)
            continue
        flops = t * TOP_K * PAIR_FLOPS
        row = dict(tokens=t, experts=used, bytes=nbytes, floor_us=floor_us, variant=label, us=us,
                   hbm_pct=100 * floor_us / us, flops=flops, tflops=flops / us / 1e6,
                   mma_pct=100 * flops / MMA_PEAK / (us * 1e-6), num_experts=E,
                   mm_pct=100 * flops / (us * 1e-6) / (mm_peak * 1e12) if mm_peak else None)
        rows.append(row)
        mm = f" {row['mm_pct']:5.1f}%" if mm_peak else ""
        print(f"{t:>5} {used:>7} {floor_us:8.1f}us {label:<42} {us:9.1f}us {row['hbm_pct']:5.1f}% "
              f"{row['tflops']:6.1f} {row['mma_pct']:5.1f}%{mm}", flush=True)
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="*", default=[1, 4, 16, 64, 256, 512, 1024, 2048])
    parser.add_argument("--sweep", action="store_true",
                        help="also time moe_gemm_kernel's tile variants at every T (gemm='triton')")
    parser.add_argument("--sweep-filter", type=_regex, default=re.compile(""),
                        help="only the sweep variants whose MoEConfig repr (e.g. 'programs_per_sm=5', not the "
                             "short label printed) matches this regular expression (the picked one always runs)")
    parser.add_argument("--ws-sweep", action="store_true",
                        help="also time the warp-specialised Hopper kernel's variants (WsConfig) at every T")
    parser.add_argument("--prefill-sweep", action="store_true",
                        help="also time the prefill tile candidates (prefill_sweep_configs) at every T >= 256")
    parser.add_argument("--prefill-filter", type=_regex, default=re.compile(""),
                        help="only the prefill sweep's candidates whose printed label matches this regular expression "
                             "(e.g. 'tile_rows256' for the 256-row weight tiles; the default tiles always run)")
    parser.add_argument("--kernels", action="store_true", help="per-kernel GPU times of ours (torch.profiler)")
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--act-ab", action="store_true",
                        help="also time ours with the w13 epilogue's portable math (act_math='portable')")
    parser.add_argument("--gemm-ab", action="store_true",
                        help="also time ours with moe_gemm_kernel for both GEMMs (gemm='triton') where the default "
                             "runs the warp-specialised Hopper kernel")
    parser.add_argument("--no-sass", action="store_true", help="skip the static SASS count (two cross-compiles)")
    parser.add_argument("--out", type=Path, default=None, help="write bench_moe.json here")
    parser.add_argument("--experts", type=int, default=896, help="routed experts (top-16 of them)")
    parser.add_argument("--grouped", action="store_true",
                        help="time the grouped prefill path (gemm='grouped') beside the ws kernel (gemm='ws')")
    args = parser.parse_args()
    if args.experts < TOP_K:
        raise SystemExit(f"--experts must be at least {TOP_K}")
    global E
    E = args.experts
    if not torch.cuda.is_available():
        raise SystemExit("bench_moe.py needs a CUDA GPU")
    dev = "cuda"
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, f"E={E}", flush=True)
    mm_peak = measured_mm_peak()
    print(f"measured bf16 matmul 8192^3: {mm_peak:.1f} TFLOP/s (mm% = share of it)", flush=True)
    rows: list[dict] = []
    sass = None
    try:
        if not args.no_sass:
            sass = sass_per_weight()
            print("static SASS of the K loop:", json.dumps(sass), flush=True)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    w = experts(dev)
    prepared = prepare_weights(w)
    peer = None
    if not args.no_peer:
        try:
            peer = Peer(w)
        except Exception:  # noqa: BLE001 - the peer is optional: report why it is missing
            traceback.print_exc()
    print(f"MMA% = T x {TOP_K} pairs x {PAIR_FLOPS / 1e6:.2f} MFLOP (w13 2 x {HIDDEN} x {2 * N} + w2 2 x {N} x "
          f"{HIDDEN}) / {MMA_PEAK / 1e12:.0f} TFLOP/s (H200 dense bf16) / time", flush=True)
    print(f"{'T':>5} {'experts':>7} {'floor':>9} {'variant':<42} {'time':>10} {'HBM%':>6} {'TFLOP/s':>6} {'MMA%':>6} "
          f"{'mm%':>6}", flush=True)
    inputs: dict = {}
    kernels: dict = {}
    for t in args.tokens:
        logits, ids = routing_inputs(t, dev)
        x = torch.randn(t, HIDDEN, device=dev, dtype=torch.bfloat16)
        inputs[t] = (x, logits, ids)
        if t in (1, 64):  # sanity: the measured op is the right one
            r = route(logits, TOP_K)
            out = fused_moe_with(x, prepared, r.weights, r.ids)
            ref = fused_moe_reference(x, w, r.weights, r.ids).float()
            out_tr = fused_moe_with(x, prepared, r.weights, r.ids, gemm="triton")
            same = torch.equal(out_tr, fused_moe_with(x, prepared, r.weights, r.ids, decode="portable"))
            err = ((out.float() - ref).norm() / ref.norm()).item()
            ws = ((out.float() - out_tr.float()).norm() / out_tr.float().norm()).item()
            print(f"T{t}: rel. error vs reference {err:.2e}, default vs moe_gemm_kernel {ws:.1e}, inline PTX == "
                  f"portable decode (moe_gemm_kernel): {same}", flush=True)
        picked = pick_config(t * TOP_K, E)
        # the default A16W4 op takes the grouped path from grouped.MIN_ROWS_PER_EXPERT rows per expert (outside graph
        # capture): label it so, which also times it eagerly (_time_variants)
        a16 = "grouped (default)" if grouped_rule(t, TOP_K, E) else _short(picked)
        variants = [(f"ours A16W4 {a16}", ours(prepared, "bf16", None)),
                    (f"ours A8W4 {_short(picked)}", ours(prepared, "mxfp8", None))]
        if args.act_ab:  # the w13 epilogue's portable math beside the default (fast) one, same tiles
            variants.insert(1, ("ours A16W4 portable epilogue", ours(prepared, "bf16", None, "portable")))
        if args.gemm_ab:  # on the H200 the default GEMMs are the Hopper ws kernel
            variants.insert(1, ("ours A16W4 moe_gemm_kernel", ours(prepared, "bf16", None, None, "triton")))
        if args.grouped:  # both paths named explicitly (the default picks one of them by rows per expert)
            variants = [(f"ours {aq} {gemm}", ours(prepared, q, None, None, gemm))
                        for aq, q in (("A16W4", "bf16"), ("A8W4", "mxfp8")) for gemm in ("ws", "grouped")]
        rows += _time_variants(t, inputs[t], variants, mm_peak)
    if peer is not None:  # after ours: a fault in the peer cannot lose our numbers
        for t in args.tokens:
            rows += _time_variants(t, inputs[t], [("peer triton_kernels A16W4", peer)])
    if args.kernels:
        for t in args.tokens:
            x, logits, ids = inputs[t]
            times = kernel_times(ours(prepared, "bf16", None), (x, logits, ids))
            print(f"T{t} kernels (us): " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()), flush=True)
            kernels[t] = times
    if args.sweep:  # moe_gemm_kernel's tile variants (the Hopper ws kernel has fixed tiles: gemm="triton")
        for t in args.tokens:
            picked = pick_config(t * TOP_K, E)
            cfgs = [picked] + [c for c in sweep_configs(picked, t)[1:] if args.sweep_filter.search(repr(c))]
            rows += _time_variants(t, inputs[t], [(f"moe_gemm_kernel A16W4 {_short(cfg)}",
                                                   ours(prepared, "bf16", cfg, None, "triton")) for cfg in cfgs])
    if args.ws_sweep:
        for t in args.tokens:
            picked = pick_config(t * TOP_K, E)
            rows += _time_variants(t, inputs[t], [(f"ws A16W4 {_ws_short(moe, ws)}",
                                                   ours(prepared, "bf16", moe, None, "ws", ws))
                                                  for moe, ws in ws_sweep_configs(picked, t)])
    if args.prefill_sweep:
        for t in (t for t in args.tokens if t >= 256):
            picked = pick_config(t * TOP_K, E)
            labels = [(f"tiles A16W4 {_ws_short(moe, ws) if ws is not None else 'moe_gemm_kernel ' + _short(moe)}",
                       moe, ws) for moe, ws in prefill_sweep_configs(picked, t)]
            rows += _time_variants(t, inputs[t], [(f"tiles A16W4 default {_short(picked)}",
                                                   ours(prepared, "bf16", None))] + [
                (label, ours(prepared, "bf16", moe, None, "triton" if ws is None else "ws", ws))
                for label, moe, ws in labels if args.prefill_filter.search(label)])
    print("\nsummary (speedup = peer time / ours):", flush=True)
    for row in rows:
        peer_us = next((r["us"] for r in rows if r["tokens"] == row["tokens"] and r["variant"].startswith("peer")),
                       None)
        row["speedup_vs_peer"] = peer_us / row["us"] if peer_us else None
        vs = f"{row['speedup_vs_peer']:.2f}x" if row["speedup_vs_peer"] else "-"
        print(f"{row['tokens']:>5} {row['experts']:>7} {row['floor_us']:8.1f}us {row['variant'][:72]:<72} "
              f"{row['us']:9.1f}us {row['hbm_pct']:5.1f}% {row['tflops']:6.1f} {row['mma_pct']:5.1f}% "
              f"{row['mm_pct'] or 0:5.1f}% {vs:>7}", flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_moe.json").write_text(json.dumps({"sass": sass, "rows": rows, "kernels": kernels}, indent=1))


if __name__ == "__main__":
    main()
