"""CPU emulation of one chunk's solve in the KDA state walk at bf16: V' = (I + A)^-1 X by the block substitution
(chunk_state's default) and by HORNER's products (Y = T_D X, V' = (I - L)(I + L^2) Y, -L = -T_II A_IJ stored in bf16
by chunk_intra's NEG_L), each against fp64 truth. Operands are rounded to bf16 where the kernels round them (the
band's blocks, the right-hand sides of every product), accumulation is fp64 (the kernels': fp32).

Keys are one random direction plus ``spread`` noise (small spread: strongly correlated keys), b constant, the gate
uniform in [-decay, 0] per token and channel (small decay: the hard case for the diagonal inverses).

    .venv/bin/python scripts/kda_walk_solve_error.py
"""

from __future__ import annotations

import torch

C, K, V, BC = 64, 128, 64, 16


def _bf(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float64)


def _chunk(spread: float, b: float, decay: float, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(A strictly lower [C, C], X [C, V]) of one chunk, fp64."""
    k = torch.randn(K, generator=gen, dtype=torch.float64)[None] + spread * torch.randn(C, K, generator=gen,
                                                                                      dtype=torch.float64)
    k = k / k.norm(dim=1, keepdim=True)
    G = (-decay * torch.rand(C, K, generator=gen, dtype=torch.float64)).cumsum(0)
    A = (b * torch.einsum("ik,jk,ijk->ij", k, k, torch.exp(G[:, None] - G[None]))).tril(-1)
    return A, torch.randn(C, V, generator=gen, dtype=torch.float64)


def _blocks(m: torch.Tensor) -> list[slice]:
    return [slice(BC * i, BC * i + BC) for i in range(m.shape[0] // BC)]


def substitution(A: torch.Tensor, T: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """V'_I = T_II (X_I - sum_{J<I} A_IJ V'_J), the band and V'_J in bf16 (chunk_state's _step_solved)."""
    Ab, Tb, out = _bf(A), _bf(T), []
    for i, s in enumerate(_blocks(A)):
        acc = X[s].clone()
        for j, t in enumerate(_blocks(A)[:i]):
            acc -= Ab[s, t] @ out[j]
        out.append(_bf(Tb[s, s] @ _bf(acc)))
    return torch.cat(out)


def horner(A: torch.Tensor, T: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """Y = T_D X, V' = (I - L)(I + L^2) Y with -L = bf16(-T_II A_IJ) (chunk_state's _step_horner)."""
    eye_blocks = torch.zeros_like(A)
    for s in _blocks(A):
        eye_blocks[s, s] = 1.0
    t_d = _bf(T * eye_blocks)
    neg_l = _bf(-(t_d @ _bf(A * (1 - eye_blocks))))
    y = t_d @ _bf(X)
    w = y + _bf(neg_l @ neg_l) @ _bf(y)
    return _bf(w + neg_l @ _bf(w))


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    print(f"{'spread':>7} {'b':>5} {'decay':>6} {'substitution':>13} {'horner':>10}  (relative error of V', mean of 20)")
    for spread, b, decay in ((1.0, 0.5, 0.5), (1.0, 0.99, 0.05), (0.1, 0.99, 0.05), (0.03, 0.99, 0.01),
                             (0.03, 0.99, 0.001)):
        errs = {"substitution": 0.0, "horner": 0.0}
        for _ in range(20):
            A, X = _chunk(spread, b, decay, gen)
            exact = torch.linalg.solve(torch.eye(C, dtype=torch.float64) + A, X)
            T = torch.zeros_like(A)
            for s in _blocks(A):
                T[s, s] = torch.linalg.inv(torch.eye(BC, dtype=torch.float64) + A[s, s])
            for name, fn in (("substitution", substitution), ("horner", horner)):
                errs[name] += ((fn(A, T, X) - exact).norm() / exact.norm()).item() / 20
        print(f"{spread:>7} {b:>5} {decay:>6} {errs['substitution']:>13.3e} {errs['horner']:>10.3e}")


if __name__ == "__main__":
    main()
