"""Two Triton KDA prefill calls at K3's head shape, for a profiler: the first compiles, the second is the one to
profile (``ncu --launch-skip 3 --launch-count 3``: prep, intra and the state walk of the second call).

    python scripts/kda_prefill_once.py [T] [H]      one sequence of T tokens (default 16384), H heads (default 96)
"""

from __future__ import annotations

import argparse

import torch

from rocm_k3.ops.kda.datatypes import KDAGateParams
from rocm_k3.triton_kernels.kda.prefill import kda_prefill

D = 128  # K = V, K3_SPEC
LOWER = -5.0  # K3's safe-gate lower bound (as benchmarks/bench_kda.py)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("T", type=int, nargs="?", default=16384)
    parser.add_argument("H", type=int, nargs="?", default=96)
    args = parser.parse_args()
    if args.T < 1 or args.H < 1:
        raise ValueError(f"T and H must be positive, got T = {args.T}, H = {args.H}")
    T, H = args.T, args.H
    gen = torch.Generator().manual_seed(0)
    q, k, v, f = (torch.randn(T, H, D, generator=gen).to("cuda", torch.bfloat16) for _ in range(4))
    beta = torch.randn(T, H, generator=gen).to("cuda", torch.bfloat16)
    params = KDAGateParams(torch.zeros(H, device="cuda"), torch.zeros(H * D, device="cuda"), LOWER)
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    pool = torch.zeros(1, H, D, D, device="cuda")  # [S, H, K, V] fp32, updated in place
    idx = torch.zeros(1, dtype=torch.int32, device="cuda")
    has_init = torch.ones(1, dtype=torch.bool, device="cuda")
    for _ in range(2):
        kda_prefill(q, k, v, f, beta, cu, pool, idx, has_init, gate_params=params)
    torch.cuda.synchronize()
    print(f"two KDA prefill calls: T = {T}, H = {H}, D = {D}, bf16")


if __name__ == "__main__":
    main()
