"""MLA prefill on the H200: the expanded-heads Triton kernel vs the absorbed one vs torch SDPA, and the cost of long
contexts.

    PYTHONPATH=. python3 benchmarks/bench_mla_prefill.py [--heads 12] [--sections tiles crossover peer cost]

Shapes: K3 latents (R = 512 c_kv + P = 64 k_pe per token, Dn = 128, Dv = 128 per head), TP-8's 12 heads (``--heads
96`` for one GPU holding every head), bf16, 64-token pages in shuffled order, one sequence per row: n new queries
at the end of an L-token context already in the cache (n = L: a whole prompt; n < L: the last chunk of a chunked
prefill, the most expensive one).

Sections:
- ``tiles``: (BM, BN, warps, stages) of the expanded kernel at n = L = 8192; the best is printed (the default of
  ``default_tiles`` is the one measured best).
- ``crossover``: absorbed vs expanded per chunk length n at L = 4096 and 32768 (``mla_prefill_with``,
  ``expanded_min_queries`` 0 / never); ``EXPANDED_MIN_QUERIES`` is set from this table.
- ``peer``: expanded (everything: page gather, latent expansion GEMM, attention, in one call) vs torch SDPA over
  already expanded q / k / v (its fastest backend that runs the shape; k = [k_nope | k_pe] per head, causal
  lower-right) and vs SDPA plus the same expansion; the absorbed kernel up to 128k. FlashAttention is not in the
  H200 image (no package registry there); SDPA's flash / cuDNN / efficient backends are tried in turn.
- ``cost``: FLOPs and bytes of a whole prompt of 32k / 128k / 1M tokens (attention over the expanded heads:
  2 (Dn + P + Dv) per causal (query, key, head) pair; expansion 2 R H (Dn + Dv) per key; absorbed: 2 (2R + P) per
  pair + the W_uk / W_uv products), with the time measured where one call fits and, beyond, the sum over 8192-query
  chunks at the TFLOP/s measured on the last chunk (stated as an estimate).

Times are medians of 5 calls (CUDA events, one warm-up), host work included. % of peak = FLOPs / 989 TFLOP/s
(H200 dense bf16, spec) and / the bf16 matmul measured in the same run.
"""

from __future__ import annotations

import argparse
import math
import statistics
import traceback

import torch

from rocm_k3.triton_kernels import mla_prefill_expanded as X
from rocm_k3.triton_kernels.mla_prefill import mla_prefill_with

R, P, DN, DV = 512, 64, 128, 128
PEAK = 989e12  # H200 dense bf16 MMA, spec sheet
PAGE = 64
NEVER = 1 << 40


def timed_ms(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = timed_ms(lambda: a @ a, reps=10)
    return 2 * 8192 ** 3 / ms / 1e9


class Problem:
    """One sequence: an L-token latent cache in shuffled 64-token pages and n queries at its end."""

    def __init__(self, n: int, length: int, heads: int, seed: int = 0) -> None:
        g = torch.Generator(device="cuda").manual_seed(seed)
        pages = -(-length // PAGE)
        self.n, self.length, self.heads = n, length, heads
        self.cache = torch.randn(pages, PAGE, R + P, device="cuda", dtype=torch.bfloat16, generator=g)
        self.table = torch.randperm(pages, device="cuda", generator=g).to(torch.int32).view(1, pages)
        self.q = torch.randn(n, heads, DN + P, device="cuda", dtype=torch.bfloat16, generator=g)
        self.w = (torch.randn(heads * (DN + DV), R, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
        self.cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
        self.lens = torch.tensor([length], dtype=torch.int32, device="cuda")

    @property
    def args(self) -> tuple:
        return self.q, self.cache, self.table, self.cu, self.lens, self.w

    def pairs(self) -> int:
        """Causal (query, key) pairs: query j sees L - n + j + 1 keys."""
        return self.n * (self.length - self.n) + self.n * (self.n + 1) // 2

    def flops_expanded(self) -> tuple[float, float]:
        """(attention, expansion) FLOPs over the expanded heads."""
        return self.pairs() * self.heads * 2 * (DN + P + DV), self.length * 2 * R * self.heads * (DN + DV)

    def flops_absorbed(self) -> float:
        return self.pairs() * self.heads * 2 * (2 * R + P) + self.n * self.heads * 2 * R * (DN + DV)

    def sdpa_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [1, H, n, Dn + P], k [1, H, L, Dn + P], v [1, H, L, Dv], expanded once (not timed)."""
        kv, latent = X.expand_segment(self.cache, self.table[0], 0, self.length, self.w, torch.bfloat16)
        kv = kv.view(self.length, self.heads, DN + DV)
        pe = latent[:, R:].unsqueeze(1).expand(self.length, self.heads, P)
        k = torch.cat([kv[..., :DN], pe], dim=-1).transpose(0, 1).unsqueeze(0).contiguous()
        v = kv[..., DN:].transpose(0, 1).unsqueeze(0).contiguous()
        return self.q.transpose(0, 1).unsqueeze(0).contiguous(), k, v


def expanded(p: Problem, tiles=None):
    return lambda: X.mla_prefill_expanded(*p.args, tiles=tiles)


def absorbed(p: Problem):
    return lambda: mla_prefill_with(*p.args, expanded_min_queries=NEVER)


def sdpa_best(p: Problem) -> tuple[float, str, torch.Tensor | None]:
    """(ms, backend, output [n, H, Dv]) of the fastest SDPA backend that runs the shape."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = p.sdpa_inputs()
    f = torch.nn.functional.scaled_dot_product_attention
    scale = (DN + P) ** -0.5
    if p.n == p.length:
        call = lambda: f(q, k, v, is_causal=True, scale=scale)  # noqa: E731
    else:
        bias = causal_lower_right(p.n, p.length)
        call = lambda: f(q, k, v, attn_mask=bias, scale=scale)  # noqa: E731
    best = (math.inf, "none ran", None)
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                ms = timed_ms(call)
                out = call()
        except Exception as exc:  # noqa: BLE001 - a backend that declines the shape is reported
            print(f"    sdpa {backend.name}: declined ({str(exc).splitlines()[0][:100]})", flush=True)
            continue
        print(f"    sdpa {backend.name}: {ms:.2f} ms", flush=True)
        if ms < best[0]:
            best = (ms, backend.name, out[0].transpose(0, 1))
    del q, k, v
    return best


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item() if torch.isfinite(a).all() else math.inf


def section_tiles(heads: int) -> tuple:
    p = Problem(8192, 8192, heads)
    ref = X.mla_prefill_expanded(*p.args, tiles=(64, 32, 4, 2)).float()
    att, exp = p.flops_expanded()
    best = (math.inf, None)
    print(f"\n## tiles, n = L = 8192, H = {heads}\n| BM | BN | warps | stages | ms | TFLOP/s (attention + expansion) |")
    for tiles in [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 4, 2), (64, 64, 4, 2), (128, 128, 8, 2)]:
        try:
            err = rel(X.mla_prefill_expanded(*p.args, tiles=tiles), ref)
            if not err < 1e-2:
                print(f"| {' | '.join(map(str, tiles))} | WRONG rel. error {err:.1e} | |")
                continue
            ms = timed_ms(expanded(p, tiles))
        except Exception as exc:  # noqa: BLE001
            print(f"| {' | '.join(map(str, tiles))} | FAILED {str(exc).splitlines()[0][:80]} | |")
            continue
        print(f"| {' | '.join(map(str, tiles))} | {ms:.2f} | {(att + exp) / ms / 1e9:.0f} |", flush=True)
        if ms < best[0]:
            best = (ms, tiles)
    print(f"best tiles: {best[1]} (default_tiles: {X.default_tiles(torch.bfloat16)})")
    return best[1]


def section_crossover(heads: int, tiles) -> None:
    print(f"\n## crossover absorbed -> expanded, H = {heads} (EXPANDED_MIN_QUERIES = {X.EXPANDED_MIN_QUERIES})")
    print("| L | n | absorbed ms | expanded ms | absorbed / expanded | default picks |")
    for length in (4096, 32768):
        for n in (64, 128, 256, 512, 1024, 4096):
            p = Problem(n, length, heads, seed=n)
            a = absorbed(p)()
            e = X.mla_prefill_expanded(*p.args, tiles=tiles)
            err = rel(e, a)
            ta, te = timed_ms(absorbed(p)), timed_ms(expanded(p, tiles))
            pick = "expanded" if n >= X.EXPANDED_MIN_QUERIES else "absorbed"
            print(f"| {length} | {n} | {ta:.3f} | {te:.3f} | {ta / te:.2f} | {pick} |  rel. diff {err:.1e}",
                  flush=True)
            del p


def section_peer(heads: int, tiles, matmul: float) -> dict:
    print(f"\n## expanded vs SDPA vs absorbed, H = {heads}, bf16 (SDPA: kernel on pre-expanded q/k/v; "
          "+exp: plus the same expansion time)")
    print("| n | L | expanded ms | TFLOP/s | % of 989 | % of matmul | SDPA ms (backend) | SDPA+exp ms | "
          "expanded vs SDPA+exp | absorbed ms | rel. diff vs SDPA |")
    rates = {}
    for n, length in ((4096, 4096), (16384, 16384), (32768, 32768), (8192, 131072), (4096, 1048576)):
        p = Problem(n, length, heads, seed=length)
        att, exp = p.flops_expanded()
        te = timed_ms(expanded(p, tiles), reps=3 if length > 100_000 else 5)
        out = X.mla_prefill_expanded(*p.args, tiles=tiles)
        kv_ms = timed_ms(lambda: X.expand_segment(p.cache, p.table[0], 0, min(length, X.SEGMENT_KEYS), p.w,
                                                  torch.bfloat16)) * -(-length // X.SEGMENT_KEYS)
        ts, backend, so = sdpa_best(p)
        diff = rel(out, so) if so is not None else math.nan
        del so
        ta = timed_ms(absorbed(p), reps=3) if length <= 131072 else math.nan
        tflops = (att + exp) / te / 1e9
        rates[(n, length)] = tflops
        print(f"| {n} | {length} | {te:.2f} | {tflops:.0f} | {100 * tflops * 1e12 / PEAK:.1f} | "
              f"{100 * tflops / matmul:.1f} | {ts:.2f} ({backend}) | {ts + kv_ms:.2f} | {(ts + kv_ms) / te:.2f}x | "
              f"{ta:.2f} | {diff:.1e} |", flush=True)
        del p, out
        torch.cuda.empty_cache()
    return rates


def section_cost(heads: int, tiles, rates: dict) -> None:
    print(f"\n## cost of a whole prompt, H = {heads} (expanded kernel; chunks of 8192 queries beyond 32k)")
    print("| L | attention TFLOP | expansion TFLOP | absorbed TFLOP | latent bytes | expanded K/V bytes per pass | "
          "time |")
    for length in (32768, 131072, 1048576):
        p = Problem(min(length, 8), 8, heads)  # sizes only
        p.n, p.length = length, length
        att, exp = p.flops_expanded()
        ab = p.flops_absorbed()
        # one call up to 32k; beyond, chunks of 8192 queries, each re-expanding the context it sees
        chunks = 1 if length <= 32768 else -(-length // 8192)
        exp_total = sum(min(length, (c + 1) * length // chunks) for c in range(chunks)) * 2 * R * heads * (DN + DV)
        latent = length * (R + P) * 2
        kvb = min(length, X.SEGMENT_KEYS) * heads * (DN + DV) * 2
        if length <= 32768:
            q = Problem(length, length, heads, seed=1)
            when = f"{timed_ms(expanded(q, tiles), reps=3):.1f} ms measured (one call)"
            del q
        else:
            rate = rates.get((8192, 131072)) if length == 131072 else rates.get((4096, 1048576))
            when = (f"{(att + exp_total) / (rate * 1e12) * 1e3:.0f} ms estimated at {rate:.0f} TFLOP/s measured on "
                    "the last chunk" if rate else "-")
        print(f"| {length} | {att / 1e12:.1f} | {exp_total / 1e12:.2f} ({chunks} chunks) | {ab / 1e12:.1f} | "
              f"{latent / 2 ** 20:.0f} MiB | {kvb / 2 ** 20:.0f} MiB | {when} |", flush=True)
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--sections", nargs="+", default=["tiles", "crossover", "peer", "cost"])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_mla_prefill needs a GPU")
    matmul = matmul_tflops()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; bf16 matmul 8192^3: {matmul:.0f} TFLOP/s "
          f"(peak used: {PEAK / 1e12:.0f})", flush=True)
    tiles, rates = None, {}
    for name in args.sections:  # a section that fails is reported; the others still run
        try:
            if name == "tiles":
                tiles = section_tiles(args.heads)
            elif name == "crossover":
                section_crossover(args.heads, tiles)
            elif name == "peer":
                rates = section_peer(args.heads, tiles, matmul)
            elif name == "cost":
                section_cost(args.heads, tiles, rates)
            else:
                raise SystemExit(f"unknown section {name!r}")
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
