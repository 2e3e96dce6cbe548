"""A differentiable chunked KDA delta rule for training: the math of ``rocm_k3.ops.kda.reference.kda_prefill``
written without in-place writes, over a batch of equal-length rows (no state in, no state out).

The serving reference writes the WY inverse row by row and scatters chunk outputs into preallocated tensors, which
autograd cannot differentiate. Here the unit-lower-triangular solve is ``torch.linalg.solve_triangular`` and the
inter-chunk scan keeps its state and outputs in Python lists. Per chunk of C tokens (G = cumsum of the log-decay g)::

    Aqk[i, j] = sum_d q_i k_j exp(G_i - G_j)  (j <= i),   Akk the same with k_i (j < i)
    T = (I + diag(beta) Akk)^-1,   W = T (beta exp(G) k),   U = T (beta v)
    V' = U - W S,   O = (q exp(G)) S + Aqk V',   S = diag(exp(G_last)) S + (exp(G_last - G) k)^T V'

The pairwise factor exp(G_i - G_j) is a product exp(G_i - G_0) exp(G_0 - G_j) (two matmuls) while the decay
inside every chunk stays within fp32's exponent range (K3's safe gate bounds it by 5 per token: chunks of 16 span
at most 75); otherwise it is formed from the difference, as the serving reference does, at [B, H, N, C, C, K]
memory. Tests compare it with the token-by-token recurrence.
"""

from __future__ import annotations

import torch

TRAIN_CHUNK = 16
# Largest in-chunk decay |G_first - G_last| (log space) for the factored products: exp(+-80) is inside fp32's range.
FACTOR_LIMIT = 80.0


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       chunk: int = TRAIN_CHUNK) -> torch.Tensor:
    """KDA outputs for rows that start with a zero state.

    q (already L2-normalised and scaled), k (L2-normalised): [B, L, H, K]; v: [B, L, H, V]; g: fp32 log-decay
    [B, L, H, K]; beta: [B, L, H] in (0, 1). Returns o fp32 [B, L, H, V].
    """
    if chunk < 1:
        raise ValueError(f"chunk: expected >= 1, got {chunk}")
    b, length, h, kd = q.shape
    vd = v.shape[-1]
    pad = (-length) % chunk
    n = (length + pad) // chunk

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [B, L, H, *D] -> [B, H, N, C, *D], zero (inert) padding
        x = x.float()
        if pad:
            x = torch.cat([x, x.new_zeros(b, pad, *x.shape[2:])], dim=1)
        x = x.reshape(b, n, chunk, h, *x.shape[3:])
        return x.movedim(3, 1)

    qc, kc, vc, gc = chunks(q), chunks(k), chunks(v), chunks(g)  # [B, H, N, C, K or V]
    bc = chunks(beta)  # [B, H, N, C]
    G = gc.cumsum(dim=3)  # [B, H, N, C, K]
    Aqk, Akk = _intra_chunk_products(qc, kc, G)  # [B, H, N, C(i), C(j)]
    eye = torch.eye(chunk, dtype=torch.float32, device=q.device)
    Tinv = torch.linalg.solve_triangular(eye + Akk * bc.unsqueeze(-1), eye.expand_as(Akk), upper=False,
                                         unitriangular=True)  # (I + diag(beta) Akk)^-1
    W = Tinv @ (bc.unsqueeze(-1) * G.exp() * kc)  # [B, H, N, C, K]
    U = Tinv @ (bc.unsqueeze(-1) * vc)  # [B, H, N, C, V]
    q_decayed = qc * G.exp()  # [B, H, N, C, K]
    G_last = G[:, :, :, -1:, :]  # [B, H, N, 1, K]
    k_to_end = (kc * (G_last - G).exp()).transpose(-1, -2)  # [B, H, N, K, C]
    chunk_decay = G_last.squeeze(3).exp().unsqueeze(-1)  # [B, H, N, K, 1]

    S = q.new_zeros(b, h, kd, vd, dtype=torch.float32)  # [B, H, K, V]
    outs = []
    read = torch.cat([W, q_decayed], dim=3)  # [B, H, N, 2C, K]: W S and (q exp(G)) S in one matmul per chunk
    # unbound once: indexing chunk i inside the loop would make every backward step write a full-size zero tensor
    for U_i, read_i, A_i, decay_i, k_i in zip(*(t.unbind(2) for t in (U, read, Aqk, chunk_decay, k_to_end))):
        ws, qs = (read_i @ S).split(chunk, dim=2)  # [B, H, C, V] each
        v_new = U_i - ws
        outs.append(qs + A_i @ v_new)
        S = decay_i * S + k_i @ v_new
    o = torch.stack(outs, dim=2)  # [B, H, N, C, V]
    return o.movedim(1, 3).reshape(b, n * chunk, h, vd)[:, :length]


def _intra_chunk_products(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Aqk[i, j] = sum_d q_i k_j exp(G_i - G_j) for j <= i and Akk (k_i instead of q_i) for j < i, zero elsewhere.

    q, k, G: [..., C, K]. When the decay inside a chunk is bounded (|G_i - G_j| <= FACTOR_LIMIT for all i, j),
    exp(G_i - G_j) = exp(G_i - G_0) exp(G_0 - G_j) with both factors inside fp32's range, and the products are two
    matmuls; otherwise the pairwise differences are formed explicitly ([..., C, C, K], exact for any decay).
    """
    C = G.shape[-2]
    causal = torch.ones(C, C, dtype=torch.bool, device=G.device).tril()  # [C(i), C(j)] j <= i
    strict = causal.tril(-1)
    span = (G[..., 0, :] - G[..., -1, :]).detach().abs().max() if G.numel() else G.new_zeros(())
    if float(span) <= FACTOR_LIMIT:
        rel = G - G[..., :1, :]  # G_i - G_0
        k_out = (k * torch.exp(-rel)).transpose(-1, -2)  # [..., K, C]: k_j exp(G_0 - G_j)
        Aqk = (q * torch.exp(rel)) @ k_out
        Akk = (k * torch.exp(rel)) @ k_out
    else:
        diff = G.unsqueeze(-2) - G.unsqueeze(-3)  # [..., C(i), C(j), K]: G_i - G_j
        k_decayed = k.unsqueeze(-3) * torch.exp(diff.masked_fill(~causal[:, :, None], float("-inf")))
        Aqk = (k_decayed @ q.unsqueeze(-1)).squeeze(-1)
        Akk = (k_decayed @ k.unsqueeze(-1)).squeeze(-1)
    return torch.where(causal, Aqk, 0.0), torch.where(strict, Akk, 0.0)
