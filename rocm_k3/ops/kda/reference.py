"""PyTorch references of the KDA op family: the ground truth every backend is tested against.

All math is fp32 (inputs are upcast), results are cast back to the activation dtype stated per function.
Arguments are assumed valid: the public functions in :mod:`rocm_k3.ops.kda` check them first.
Contents: the element-wise and per-token parts (gate, l2 norm, short convolution, gated RMSNorm), the
decode step built from them, and the chunked prefill.

Chunked prefill (K3_SPEC section 2, chunk C = 64, fp32), varlen and state-slot aware. Within a chunk of
length C (rows i, columns j, G = cumsum of the log-decay g from the chunk start)::

    A[i, j]   = beta_i * sum_d k_i[d] k_j[d] exp(G_i[d] - G_j[d])      j < i    (strictly lower)
    Aqk[i, j] = sum_d q_i[d] k_j[d] exp(G_i[d] - G_j[d])               j <= i
    T = (I + A)^-1                       (forward substitution)
    W = T (beta * exp(G) * K),  U = T (beta * V)                       (WY form)

and across the chunks of one sequence, with the state S [K, V] at the chunk start::

    V' = U - W S
    O  = (Q * exp(G)) S + Aqk V'
    S  = diag(exp(G_last)) S + (exp(G_last - G) * K)^T V'

The pairwise factor exp(G_i - G_j) is the product exp(G_i - G_0) exp(G_0 - G_j) (two matmuls) in the chunks
whose decay stays within FACTOR_LIMIT, where both factors lie inside fp32's range; in the others (the safe gate's
in-chunk decay can reach -5 * 64) it is formed from the difference. Everything is differentiable (no in-place
write into a tensor autograd keeps), so training runs through the same code.

Chunks start at every multiple of 64 from each sequence's start; a requested intermediate position p that is
not on such a boundary splits its chunk at p, so the state after p tokens is exact. Intra-chunk work runs
batched over all chunks of all sequences (chunks padded to C with zeros, which are inert: k = q = v = 0,
beta = 0, g = 0); the inter-chunk scan runs once per chunk rank, batched over sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rocm_k3.ops.kda.datatypes import KDAGateParams, KDAPrefillOutput

L2NORM_EPS = 1e-6
CHUNK = 64
# Bound on the elements of the [chunks, H, C, C, K] pairwise-decay temporaries built at once (64 MiB fp32).
_PAIRWISE_BLOCK_ELEMS = 1 << 24
# Largest in-chunk decay max |G_i - G_j| (log space) for the factored products: exp(+-80) is inside fp32's range.
FACTOR_LIMIT = 80.0


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim, in x's dtype (call it on fp32 tensors)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    """Log-space decay gate, fp32 [T, H, K], from the raw gate input f [T, H, K].

    lower_bound L given (safe gate): ``g = L * sigmoid(exp(A_log[h]) * (f + dt_bias[h]))``, in (L, 0).
    lower_bound None (softplus gate): ``g = -exp(A_log[h]) * softplus(f + dt_bias[h])``.
    A_log fp32 [H], dt_bias fp32 [H*K] (head-major: dt_bias[h*K + d]).
    """
    _, H, K = f.shape
    x = f.float() + dt_bias.float().view(H, K)  # [T, H, K]
    a = A_log.float().exp().view(H, 1)  # [H, 1]
    if lower_bound is None:
        return -a * F.softplus(x)
    return lower_bound * torch.sigmoid(a * x)


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    return F.silu(y) if activation == "silu" else y


def short_conv(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, *,
               conv_state: torch.Tensor | None = None, state_indices: torch.Tensor | None = None,
               has_initial_state: torch.Tensor | None = None, activation: str | None = "silu") -> torch.Tensor:
    """Causal depthwise convolution (no bias) per sequence of a varlen batch, then SiLU (or identity).

    ``y[t, c] = sum_j weight[c, j] * h[t - (W-1) + j, c]`` where h is the sequence's inputs preceded by its
    history of W-1 inputs: ``conv_state[state_indices[i]]`` ([C, W-1], oldest first) when conv_state is given
    and ``has_initial_state[i]`` (None = no sequence has one), else zeros. With conv_state given, the slot of
    sequence i is overwritten in place with the last W-1 entries of (history, inputs), in conv_state's dtype.

    x [T, C], weight [C, W], cu_seqlens int32 [N+1]; returns y [T, C] in x's dtype.
    """
    T, C = x.shape
    W = weight.shape[1]
    w = weight.float()  # [C, W]
    y = torch.empty(T, C, dtype=torch.float32, device=x.device)
    bounds = cu_seqlens.tolist()
    slots = state_indices.tolist() if state_indices is not None else None
    has_init = has_initial_state.tolist() if has_initial_state is not None else [False] * (len(bounds) - 1)
    for i in range(len(bounds) - 1):
        start, end = bounds[i], bounds[i + 1]
        if conv_state is not None and has_init[i]:
            history = conv_state[slots[i]].float().t()  # [W-1, C]
        else:
            history = torch.zeros(W - 1, C, dtype=torch.float32, device=x.device)
        ext = torch.cat([history, x[start:end].float()])  # [W-1+L, C]
        if end > start:
            windows = ext.unfold(0, W, 1)  # [L, C, W]: windows[t] = ext[t : t+W].T
            y[start:end] = (windows * w).sum(dim=-1)
        if conv_state is not None:
            last = ext[ext.shape[0] - (W - 1) :]  # [W-1, C]
            conv_state[slots[i]] = last.t().to(conv_state.dtype)
    return _activate(y, activation).to(x.dtype)


def _short_conv_update_fp32(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                            state_indices: torch.Tensor, activation: str | None) -> torch.Tensor:
    """One decode token per sequence; returns fp32 [N, C] and shifts the conv state slots in place."""
    slots = state_indices.long()
    window = torch.cat([conv_state[slots].float(), x.float().unsqueeze(-1)], dim=-1)  # [N, C, W]
    y = (window * weight.float()).sum(dim=-1)  # [N, C]
    conv_state[slots] = window[..., 1:].to(conv_state.dtype)
    return _activate(y, activation)


def short_conv_update(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, state_indices: torch.Tensor,
                      activation: str | None = "silu") -> torch.Tensor:
    """Decode step of :func:`short_conv`: one token per sequence.

    x [N, C], weight [C, W], conv_state [S, C, W-1] (oldest first), state_indices int32 [N].
    ``y[i] = act(sum_j weight[:, j] * window[:, j])`` with window = (conv_state[slot], x[i]); the slot then
    holds the window's last W-1 columns (in place). Returns y [N, C] in x's dtype.
    """
    return _short_conv_update_fp32(x, weight, conv_state, state_indices, activation).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """``x * rsqrt(mean_D(x^2) + eps) * weight * sigmoid(gate)`` over the last dim D, fp32 math.

    x, gate [T, H, D], weight [D]; returns [T, H, D] in x's dtype.
    """
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normed * weight.float() * torch.sigmoid(gate.float())).to(x.dtype)


def delta_rule_step(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the KDA recurrence for a batch of states (K3_SPEC section 2 step 5), fp32.

    S [N, H, K, V]; q (already scaled), k [N, H, K]; v [N, H, V]; g [N, H, K] log-decay; beta [N, H] in (0, 1).
    Returns (new S [N, H, K, V], o [N, H, V]).
    """
    S = S * g.exp().unsqueeze(-1)  # diag(exp(g)) S
    u = v - torch.einsum("nhkv,nhk->nhv", S, k)  # v - S^T k
    S = S + (beta[..., None, None] * k.unsqueeze(-1)) * u.unsqueeze(-2)  # + beta k u^T
    o = torch.einsum("nhkv,nhk->nhv", S, q)  # S^T q
    return S, o


def kda_decode(qkv: torch.Tensor, f: torch.Tensor, beta: torch.Tensor, out_gate: torch.Tensor,
               conv_weight: torch.Tensor, conv_state: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
               o_norm_weight: torch.Tensor, state: torch.Tensor, state_indices: torch.Tensor, *, num_heads: int,
               lower_bound: float | None, scale: float | None = None, eps: float = 1e-5) -> torch.Tensor:
    """One decode token per sequence through the whole KDA layer up to (not including) o_proj.

    qkv [N, 3*H*K] pre-conv projections (q | k | v, head-major), f [N, H*K] raw gate input, beta [N, H]
    logits, out_gate [N, H*V] output-gate logits (V = K), conv_weight [3*H*K, W], conv_state [S, 3*H*K, W-1],
    state fp32 [S, H, K, V]; both state pools are updated in place at ``state_indices``.
    Steps: short_conv_update + SiLU, split q|k|v, kda_gate, L2 norms (q then scaled, default K^-0.5),
    beta = sigmoid(beta), one recurrence step, ``gated_rms_norm(o, out_gate, o_norm_weight, eps)``.
    Returns y [N, H*V] in qkv's dtype.
    """
    N = qkv.shape[0]
    H = num_heads
    K = qkv.shape[1] // (3 * H)
    scale = K**-0.5 if scale is None else scale
    mixed = _short_conv_update_fp32(qkv, conv_weight, conv_state, state_indices, "silu")  # [N, 3*H*K]
    q, k, v = mixed.view(N, 3, H, K).unbind(dim=1)  # each [N, H, K]
    g = kda_gate(f.view(N, H, K), A_log, dt_bias, lower_bound)  # [N, H, K]
    q = l2norm(q) * scale
    k = l2norm(k)
    slots = state_indices.long()
    new_state, o = delta_rule_step(state[slots], q, k, v, g, torch.sigmoid(beta.float()))
    state[slots] = new_state
    y = gated_rms_norm(o, out_gate.view(N, H, K), o_norm_weight, eps)  # fp32 [N, H, V]
    return y.reshape(N, H * K).to(qkv.dtype)


# ---- chunked prefill ----


@dataclass
class _ChunkPlan:
    """Where the chunks of a varlen batch lie.

    token_index: int64 [NC, C]  global token of each chunk row (0 for padding)
    valid:       bool  [NC, C]  row holds a real token
    seq:         int64 [NC]     sequence of each chunk
    by_rank:     chunk ids grouped by their rank inside their sequence (at most one chunk per sequence per rank)
    end_chunk:   (seq, local end position) -> id of the chunk that ends there
    """

    token_index: torch.Tensor
    valid: torch.Tensor
    seq: torch.Tensor
    by_rank: list[list[int]]
    end_chunk: dict[tuple[int, int], int]


def _plan_chunks(bounds: list[int], positions: list[list[int]], device: torch.device) -> _ChunkPlan:
    split_extra: dict[int, set[int]] = {}
    for seq, pos in positions:
        split_extra.setdefault(seq, set()).add(pos)
    starts: list[int] = []
    lengths: list[int] = []
    seqs: list[int] = []
    by_rank: list[list[int]] = []
    end_chunk: dict[tuple[int, int], int] = {}
    for seq in range(len(bounds) - 1):
        length = bounds[seq + 1] - bounds[seq]
        cuts = sorted(set(range(CHUNK, length, CHUNK)) | split_extra.get(seq, set()) | {length})
        prev = 0
        for rank, cut in enumerate(c for c in cuts if c > 0):
            chunk_id = len(starts)
            starts.append(bounds[seq] + prev)
            lengths.append(cut - prev)
            seqs.append(seq)
            if rank == len(by_rank):
                by_rank.append([])
            by_rank[rank].append(chunk_id)
            end_chunk[(seq, cut)] = chunk_id
            prev = cut
    # padded to the longest chunk, not CHUNK: short segments (decode-sized verifications, save cuts) stay cheap
    offsets = torch.arange(max(lengths, default=1), device=device)
    start_t = torch.tensor(starts, dtype=torch.int64, device=device)
    length_t = torch.tensor(lengths, dtype=torch.int64, device=device)
    valid = offsets < length_t[:, None]  # [NC, C]
    token_index = torch.where(valid, start_t[:, None] + offsets, torch.zeros_like(offsets))  # [NC, C]
    seq_t = torch.tensor(seqs, dtype=torch.int64, device=device)
    return _ChunkPlan(token_index, valid, seq_t, by_rank, end_chunk)


def _to_chunks(x: torch.Tensor, plan: _ChunkPlan) -> torch.Tensor:
    """[T, H, *D] -> [NC, H, C, *D] with zeros in the padding rows."""
    gathered = x[plan.token_index]  # [NC, C, H, *D]
    mask = plan.valid.view(*plan.valid.shape, *([1] * (x.dim() - 1)))
    gathered = torch.where(mask, gathered, torch.zeros((), dtype=x.dtype, device=x.device))
    return gathered.transpose(1, 2)


def _pairwise_decayed_products(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Aqk[i, j] = sum_d q_i k_j exp(G_i - G_j) for j <= i, and Akk the same with k_i and j < i.

    q, k, G: [NC, H, C, K]. Returns (Aqk, Akk), each [NC, H, C, C], zero above (Akk: on and above) the diagonal.
    Chunks whose decay spans at most FACTOR_LIMIT take the factored products; the others form G_i - G_j
    explicitly in blocks of [b, H, C, C, K] (exact for any decay).
    """
    NC, H, C, K = G.shape
    causal = torch.ones(C, C, dtype=torch.bool, device=G.device).tril()  # [C, C] j <= i
    span = (G.amax(dim=2) - G.amin(dim=2)).detach().flatten(1).amax(dim=1)  # [NC]
    Aqk = torch.zeros(NC, H, C, C, dtype=G.dtype, device=G.device)
    Akk = torch.zeros_like(Aqk)
    factored = torch.nonzero(span <= FACTOR_LIMIT).flatten()
    if factored.numel():
        Gf = G[factored]
        rel = Gf - Gf[:, :, :1]  # G_i - G_0
        k_out = (k[factored] * torch.exp(-rel)).transpose(-1, -2)  # [n, H, K, C(j)]: k_j exp(G_0 - G_j)
        Aqk[factored] = (q[factored] * torch.exp(rel)) @ k_out
        Akk[factored] = (k[factored] * torch.exp(rel)) @ k_out
    steep = torch.nonzero(span > FACTOR_LIMIT).flatten()
    step = max(1, _PAIRWISE_BLOCK_ELEMS // max(1, H * C * C * K))
    for lo in range(0, steep.numel(), step):
        blk = steep[lo : lo + step]
        diff = G[blk].unsqueeze(-2) - G[blk].unsqueeze(-3)  # [b, H, C(i), C(j), K]: G_i - G_j
        decay = diff.masked_fill(~causal[:, :, None], float("-inf")).exp()  # 0 where j > i
        k_decayed = (k[blk].unsqueeze(-3) * decay).transpose(-1, -2)  # [b, H, C(i), K, C(j)]
        Aqk[blk] = (q[blk].unsqueeze(-2) @ k_decayed).squeeze(-2)
        Akk[blk] = (k[blk].unsqueeze(-2) @ k_decayed).squeeze(-2)
    return torch.where(causal, Aqk, 0.0), torch.where(causal.tril(-1), Akk, 0.0)


def _unit_lower_inverse(A: torch.Tensor) -> torch.Tensor:
    """(I + A)^-1 for strictly lower triangular A [..., C, C]: a unit-triangular solve against the identity
    (differentiable, so training runs through it)."""
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    return torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)


def kda_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                cu_seqlens: torch.Tensor, state: torch.Tensor, state_indices: torch.Tensor,
                has_initial_state: torch.Tensor, *, scale: float | None = None,
                gate_params: KDAGateParams | None = None, qk_l2norm: bool = True, beta_logits: bool = True,
                intermediate_positions: torch.Tensor | None = None) -> KDAPrefillOutput:
    """Chunked KDA over a varlen batch (see the module docstring for the math).

    q, k [T, H, K]; v [T, H, V]; g [T, H, K] (fp32 log-decay, or the raw gate input when gate_params is given);
    beta [T, H] (logits when beta_logits); cu_seqlens int32 [N+1]; state fp32 [S, H, K, V] (read at
    state_indices[i] when has_initial_state[i], else zeros; the final state of every sequence is written back
    in place); intermediate_positions int32 [M, 2] rows (i, p): the state after the first p tokens of seq i.
    Returns KDAPrefillOutput(o [T, H, V] in v's dtype, intermediate_states fp32 [M, H, K, V] or None).
    """
    T, H, K = q.shape
    V = v.shape[-1]
    N = cu_seqlens.numel() - 1
    dev = q.device
    scale = K**-0.5 if scale is None else scale
    qf, kf = q.float(), k.float()
    if qk_l2norm:
        qf, kf = l2norm(qf), l2norm(kf)
    qf = qf * scale
    gf = kda_gate(g, *gate_params) if gate_params is not None else g.float()  # [T, H, K]
    bf = torch.sigmoid(beta.float()) if beta_logits else beta.float()  # [T, H]

    rows = [] if intermediate_positions is None else intermediate_positions.tolist()
    plan = _plan_chunks(cu_seqlens.tolist(), rows, dev)
    qc, kc, vc, gc = (_to_chunks(t, plan) for t in (qf, kf, v.float(), gf))  # [NC, H, C, K or V]
    bc = _to_chunks(bf, plan)  # [NC, H, C]

    # Intra-chunk: everything that does not depend on the state entering the chunk.
    G = gc.cumsum(dim=2)  # [NC, H, C, K]
    Aqk, Akk = _pairwise_decayed_products(qc, kc, G)  # [NC, H, C, C]
    Tinv = _unit_lower_inverse(Akk * bc.unsqueeze(-1))  # (I + A)^-1, A = diag(beta) Akk
    W = Tinv @ (bc.unsqueeze(-1) * G.exp() * kc)  # [NC, H, C, K]
    U = Tinv @ (bc.unsqueeze(-1) * vc)  # [NC, H, C, V]
    q_decayed = qc * G.exp()  # [NC, H, C, K]
    G_last = G[:, :, -1:, :]  # [NC, H, 1, K]; padding rows have g = 0, so this is the last real row
    k_to_end = (kc * (G_last - G).exp()).transpose(-1, -2)  # [NC, H, K, C]
    chunk_decay = G_last.squeeze(2).exp().unsqueeze(-1)  # [NC, H, K, 1]

    # Inter-chunk scan, one chunk rank at a time, batched over sequences.
    slots = state_indices.long()
    S = torch.zeros(N, H, K, V, dtype=torch.float32, device=dev)
    S = torch.where(has_initial_state.view(N, 1, 1, 1), state[slots], S)  # [N, H, K, V]
    O = torch.zeros(vc.shape, dtype=torch.float32, device=dev)  # [NC, H, C, V]
    wanted = {plan.end_chunk[(seq, pos)] for seq, pos in rows}
    saved: dict[int, torch.Tensor] = {}
    for chunk_ids in plan.by_rank:
        ids = torch.tensor(chunk_ids, dtype=torch.int64, device=dev)
        seqs = plan.seq[ids]
        S_in = S[seqs]  # [n, H, K, V]
        V_new = U[ids] - W[ids] @ S_in  # [n, H, C, V]
        O[ids] = q_decayed[ids] @ S_in + Aqk[ids] @ V_new
        S_out = chunk_decay[ids] * S_in + k_to_end[ids] @ V_new  # [n, H, K, V]
        S[seqs] = S_out
        for row, chunk_id in enumerate(chunk_ids):
            if chunk_id in wanted:
                saved[chunk_id] = S_out[row].clone()

    o = torch.zeros(T, H, V, dtype=torch.float32, device=dev)
    o[plan.token_index[plan.valid]] = O.transpose(1, 2)[plan.valid]  # [T_real, H, V]
    state[slots] = S
    intermediate = None
    if intermediate_positions is not None:
        intermediate = torch.zeros(len(rows), H, K, V, dtype=torch.float32, device=dev)
        for m, (seq, pos) in enumerate(rows):
            intermediate[m] = saved[plan.end_chunk[(seq, pos)]]
    return KDAPrefillOutput(o.to(v.dtype), intermediate)
