"""Relative error of the Triton KDA prefill against the reference op (fp32 math on the same bf16 inputs) at K3's head
shape, for the default settings and each of ``benchmarks/bench_kda.py``'s ``PREP_COMPARE`` variants: o, the final
states and the saved prefix states, on one 4096-token sequence and a varlen batch, with K3's safe gate.

    python scripts/kda_prefill_error.py [H] [--device cuda]      (default 96 heads; on the CPU only under
                                                                 TRITON_INTERPRET=1, a plumbing check: its bf16 dots
                                                                 are not the GPU's)
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_kda import PREP_COMPARE  # noqa: E402
from rocm_k3.ops.kda import reference as ref  # noqa: E402
from rocm_k3.ops.kda.datatypes import KDAGateParams  # noqa: E402
from rocm_k3.triton_kernels.kda import prefill  # noqa: E402

D = 128  # K = V, K3_SPEC
LOWER = -5.0  # K3's safe-gate lower bound


@contextlib.contextmanager
def _settings(overrides: dict):
    """The prefill module's settings with ``overrides`` (a "PHASE_WARPS" entry updates that dict), restored after."""
    saved = {name: getattr(prefill, name) for name in overrides}
    for name, value in overrides.items():
        setattr(prefill, name, {**saved[name], **value} if name == "PHASE_WARPS" else value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(prefill, name, value)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("nan")
    return ((a - b).norm() / b.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("H", type=int, nargs="?", default=96)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.H < 1:
        raise ValueError(f"H must be positive, got {args.H}")
    H, dev = args.H, args.device
    gen = torch.Generator().manual_seed(0)
    for lengths in ([4096], [3000, 200, 1500, 64]):
        T, N = sum(lengths), len(lengths)
        q, k, v, f = (torch.randn(T, H, D, generator=gen).to(dev, torch.bfloat16) for _ in range(4))
        beta = torch.randn(T, H, generator=gen).to(dev, torch.bfloat16)
        params = KDAGateParams((torch.randn(H, generator=gen) * 0.5).to(dev),
                               (torch.randn(H * D, generator=gen) * 0.5).to(dev), LOWER)
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=dev)
        pool = (torch.randn(N, H, D, D, generator=gen) * 0.05).to(dev)
        idx = torch.arange(N, dtype=torch.int32, device=dev)
        has_init = torch.tensor([i % 2 == 0 for i in range(N)], device=dev)
        pos = torch.tensor([[0, 1024]], dtype=torch.int32, device=dev)
        pool_ref = pool.clone()
        want = ref.kda_prefill(q, k, v, f, beta, cu, pool_ref, idx, has_init, gate_params=params,
                               intermediate_positions=pos)
        for label, overrides in (("default", {}),) + tuple(PREP_COMPARE):
            got_pool = pool.clone()
            with _settings(overrides):
                got = prefill.kda_prefill(q, k, v, f, beta, cu, got_pool, idx, has_init, gate_params=params,
                                          intermediate_positions=pos)
            print(f"{'+'.join(map(str, lengths)):>20} H{H} {label:<28} o {_rel(got.o, want.o):.3e}  "
                  f"final states {_rel(got_pool, pool_ref):.3e}  prefix state "
                  f"{_rel(got.intermediate_states, want.intermediate_states):.3e}", flush=True)


if __name__ == "__main__":
    main()
