"""Host wrappers: the FlyDSL implementations of the norm, attn_res and KDA-decode ops, plus their ``supports``.

Each implementation has the signature of the public op minus ``backend`` (the op module has already
validated shapes, dtypes and devices), builds (once per static configuration, cached) the launcher of
its kernel module and runs it on the call's tensors. ``supports`` functions only check what the kernels
add to the op contract (tileable sizes, contiguity, dtypes) and say why not.

Compile-verified only (gfx942, gfx950); not yet run on an AMD GPU.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch

from rocm_k3.flydsl_kernels.plans import KDA_HEAD_DIMS, row_plan

_ACT = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
OK = (True, "flydsl kernel")


def _name(dtype: torch.dtype) -> str:
    return _ACT[dtype]


def stream_of(t: torch.Tensor) -> dict:
    """Launch on torch's current stream of ``t``'s device (FlyDSL's default would be the null stream)."""
    return {"stream": torch.cuda.current_stream(t.device)} if t.is_cuda else {}


def lazy_builder(module: str, name: str) -> Callable[[Any], Any]:
    """``module.name(cfg)`` (a kernel's ``build_*``), memoised per config, the module imported on first use (so
    importing the backend does not import FlyDSL)."""
    @functools.cache
    def build(cfg):
        return getattr(importlib.import_module(module), name)(cfg)

    return build


_norm_launcher = lazy_builder("rocm_k3.flydsl_kernels.norm", "build_norm")


_attn_res_launcher = lazy_builder("rocm_k3.flydsl_kernels.attn_res", "build_attn_res_step")


_kda_decode_launcher = lazy_builder("rocm_k3.flydsl_kernels.kda_decode", "build_kda_decode")


def _row_ok(x: torch.Tensor, weight: torch.Tensor | None = None) -> tuple[bool, str]:
    if x.dtype not in _ACT:
        return False, f"activation dtype {x.dtype} is not bf16/fp16/fp32"
    if weight is not None and weight.dtype not in _ACT:
        return False, f"weight dtype {weight.dtype} is not bf16/fp16/fp32"
    D = x.shape[-1]
    vec = 16 // x.element_size()
    try:
        row_plan(D, vec)
    except ValueError as exc:
        return False, f"row length {D} does not tile: {exc}"
    return OK


# --- rms_norm / add_rms_norm / gated_rms_norm ------------------------------------------------------------


def _norm_config(x: torch.Tensor, weight: torch.Tensor, *, gated=False, residual=False):
    from rocm_k3.flydsl_kernels.norm import NormConfig

    return NormConfig(x.shape[-1], _name(x.dtype), _name(weight.dtype), gated=gated, residual=residual)


def rms_norm_supports(x, weight, eps=1e-5):
    ok, why = _row_ok(x, weight)
    if ok and weight.element_size() < x.element_size():
        return False, f"weight {weight.dtype} narrower than activations {x.dtype}"
    return ok, why


def rms_norm(x, weight, eps=1e-5):
    """FlyDSL ``rms_norm``: x [..., D] -> [..., D]."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()  # [R, D]
    y = torch.empty_like(x2)
    if x2.shape[0]:
        _norm_launcher(_norm_config(x2, weight))(x2, x2, weight.contiguous(), y, x2.shape[0], float(eps),
                                                  **stream_of(x2))
    return y.reshape(x.shape)


def add_rms_norm_supports(x, residual, weight, eps=1e-5):
    return rms_norm_supports(x, weight, eps)


def add_rms_norm(x, residual, weight, eps=1e-5):
    """FlyDSL ``add_rms_norm``: returns (rms_norm(x + residual), x + residual); inputs are not modified."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()  # [R, D]
    res = residual.reshape(-1, x.shape[-1]).clone()  # [R, D] becomes x + residual in place
    y = torch.empty_like(x2)
    if x2.shape[0]:
        _norm_launcher(_norm_config(x2, weight, residual=True))(
            x2, res, weight.contiguous(), y, x2.shape[0], float(eps), **stream_of(x2)
        )
    return y.reshape(x.shape), res.reshape(x.shape)


def gated_rms_norm_supports(x, gate, weight, eps=1e-5):
    if gate.dtype != x.dtype:
        return False, f"gate dtype {gate.dtype} differs from x dtype {x.dtype}"
    return rms_norm_supports(x, weight, eps)


def gated_rms_norm(x, gate, weight, eps=1e-5):
    """FlyDSL ``gated_rms_norm``: x, gate [T, H, D] -> [T, H, D]."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()  # [T*H, D]
    g2 = gate.reshape(-1, x.shape[-1]).contiguous()
    y = torch.empty_like(x2)
    if x2.shape[0]:
        _norm_launcher(_norm_config(x2, weight, gated=True))(x2, g2, weight.contiguous(), y, x2.shape[0], float(eps),
                                                                   **stream_of(x2))
    return y.reshape(x.shape)


# --- attn_res_step ------------------------------------------------------------------------------------------


def _attn_res_config(partial, delta, blocks, num_blocks, write_block, proj_weight):
    from rocm_k3.flydsl_kernels.attn_res import AttnResConfig

    ref = partial if partial is not None else delta
    return AttnResConfig(
        hidden=ref.shape[-1], num_blocks=num_blocks, write_block=write_block, has_partial=partial is not None,
        has_delta=delta is not None, dtype=_name(ref.dtype), weight_dtype=_name(proj_weight.dtype),
    )


def attn_res_step_supports(partial, delta, blocks, num_blocks, *, write_block, proj_weight, norm_weight,
                           rms_weight, eps=1e-5):
    ref = partial if partial is not None else delta
    if ref.dtype not in _ACT:
        return False, f"activation dtype {ref.dtype} is not bf16/fp16/fp32"
    if not (proj_weight.dtype == norm_weight.dtype == rms_weight.dtype) or proj_weight.dtype not in _ACT:
        return False, "proj/norm/rms weights must share one of bf16/fp16/fp32"
    if not blocks.is_contiguous():
        return False, "blocks must be contiguous"
    try:
        _attn_res_config(partial, delta, blocks, num_blocks, write_block, proj_weight)
    except ValueError as exc:
        return False, str(exc)
    return OK


def attn_res_step(partial, delta, blocks, num_blocks, *, write_block, proj_weight, norm_weight, rms_weight,
                  eps=1e-5):
    """FlyDSL ``attn_res_step``: returns AttnResStepOutput(normed, p); blocks[num_blocks] written if asked."""
    from rocm_k3.ops.attn_res import AttnResStepOutput

    ref = partial if partial is not None else delta
    T = ref.shape[0]
    p = torch.empty_like(ref)
    normed = torch.empty_like(ref)
    if T:
        launch = _attn_res_launcher(_attn_res_config(partial, delta, blocks, num_blocks, write_block, proj_weight))
        launch(
            (partial if partial is not None else ref).contiguous(), (delta if delta is not None else ref).contiguous(),
            blocks, proj_weight.contiguous(), norm_weight.contiguous(), rms_weight.contiguous(), normed, p, T,
            float(eps), **stream_of(ref),
        )
    return AttnResStepOutput(normed, p)


# --- kda_decode ---------------------------------------------------------------------------------------------


def kda_decode_supports(qkv, f, beta, out_gate, conv_weight, conv_state, A_log, dt_bias, o_norm_weight, state,
                        state_indices, *, num_heads, lower_bound, scale=None, eps=1e-5):
    K = qkv.shape[1] // (3 * num_heads)
    if K not in KDA_HEAD_DIMS:
        return False, f"head dim {K} is not one of {KDA_HEAD_DIMS} (one lane pair per channel)"
    if qkv.dtype not in _ACT:
        return False, f"activation dtype {qkv.dtype} is not bf16/fp16/fp32"
    if not state.is_contiguous():
        return False, "state must be contiguous [S, H, K, V] (its [K, V] tiles are addressed statically)"
    if not conv_state.is_contiguous():
        return False, "conv_state must be contiguous"
    return OK


def kda_decode(qkv, f, beta, out_gate, conv_weight, conv_state, A_log, dt_bias, o_norm_weight, state,
               state_indices, *, num_heads, lower_bound, scale=None, eps=1e-5):
    """FlyDSL ``kda_decode``: y [N, H*K]; conv_state and state updated in place at state_indices."""
    from rocm_k3.flydsl_kernels.kda_decode import KdaDecodeConfig

    N = qkv.shape[0]
    K = qkv.shape[1] // (3 * num_heads)
    y = torch.empty(N, num_heads * K, dtype=qkv.dtype, device=qkv.device)
    if N == 0:
        return y
    cfg = KdaDecodeConfig(num_heads, K, conv_weight.shape[1], _name(qkv.dtype),
                          None if lower_bound is None else float(lower_bound))
    _kda_decode_launcher(cfg)(
        qkv.contiguous(), f.contiguous(), beta.contiguous(), out_gate.contiguous(), conv_weight.contiguous(),
        conv_state, A_log.contiguous(), dt_bias.contiguous(), o_norm_weight.contiguous(), state,
        state_indices.to(torch.int32).contiguous(), y, N, float(K**-0.5 if scale is None else scale), float(eps),
        **stream_of(qkv),
    )
    return y


# --- kda_prefill (chunked form; the recurrent kernel serves off-grid intermediate positions) -----------------


_kda_prefill_launcher = lazy_builder("rocm_k3.flydsl_kernels.kda_prefill", "build_kda_prefill")


@functools.cache
def _kda_chunk_launchers(cfg):
    """(prep, intra, state) launchers of the chunked prefill for one static configuration."""
    from rocm_k3.flydsl_kernels.kda_chunk_intra import build_kda_chunk_intra
    from rocm_k3.flydsl_kernels.kda_chunk_prep import build_kda_chunk_prep
    from rocm_k3.flydsl_kernels.kda_chunk_state import build_kda_chunk_state

    return build_kda_chunk_prep(cfg), build_kda_chunk_intra(cfg), build_kda_chunk_state(cfg)


def kda_prefill_supports(q, k, v, g, beta, cu_seqlens, state, state_indices, has_initial_state, *, scale=None,
                         gate_params=None, qk_l2norm=True, beta_logits=True, intermediate_positions=None):
    K, V = q.shape[-1], v.shape[-1]
    if K not in KDA_HEAD_DIMS or V != K:
        return False, f"head dims K={K}, V={V}: the kernel needs K == V in {KDA_HEAD_DIMS}"
    if v.dtype not in _ACT:
        return False, f"v dtype {v.dtype} is not bf16/fp16/fp32"
    if not state.is_contiguous():
        return False, "state must be contiguous [S, H, K, V]"
    if _off_grid(cu_seqlens, intermediate_positions):
        return True, "flydsl recurrent-form prefill (intermediate positions off the 64-token chunk grid)"
    walk = "bf16 MFMA, bf16 intermediates" if v.dtype == torch.bfloat16 else "fp32 MFMA, fp32 intermediates"
    return True, f"flydsl chunked prefill (C = 64, the pair sums and the state walk with its WY solve on {walk})"


def _off_grid(cu_seqlens: torch.Tensor, positions: torch.Tensor | None) -> list[tuple[int, int]]:
    """Requested (i, p) that are not chunk ends of sequence i (p % 64 != 0 and p != len_i)."""
    from rocm_k3.flydsl_kernels.kda_prefill_plan import off_grid_positions

    if positions is None or positions.shape[0] == 0:
        return []
    return off_grid_positions(cu_seqlens.tolist(), [tuple(r) for r in positions.tolist()])


def _segments(cu_seqlens: torch.Tensor, positions: torch.Tensor | None, device: torch.device):
    """Split every sequence at its requested positions: (SegPtr [N+1], SegStart, SegEnd, SegRow) int32.

    Segments of sequence i cover [0, len_i) in order; a segment ending at a requested position p carries the
    output row of (i, p) (repeated requests give zero-length segments), the last one row -1.
    """
    bounds = cu_seqlens.tolist()
    wanted: dict[int, list[tuple[int, int]]] = {}
    for row, (i, p) in enumerate([] if positions is None else positions.tolist()):
        wanted.setdefault(int(i), []).append((int(p), row))
    ptr, start, end, rows = [0], [], [], []
    for i in range(len(bounds) - 1):
        pos = 0
        for p, row in sorted(wanted.get(i, [])):
            start.append(pos), end.append(p), rows.append(row)
            pos = p
        start.append(pos), end.append(bounds[i + 1] - bounds[i]), rows.append(-1)
        ptr.append(len(start))
    as_i32 = lambda values: torch.tensor(values, dtype=torch.int32, device=device)
    return as_i32(ptr), as_i32(start), as_i32(end), as_i32(rows)


def _kda_prefill_chunked(cfg, q, k, v, g, beta, cu, state, slots, has_init, inter, positions, a_log, dt_bias, scale):
    """The three chunked launches (prep, intra with the diagonal inverses, the state walk that solves); G and b in
    fp32, the walk's intermediates in its operand type (``kda_prefill_plan.walk_operands``: bf16 for bf16
    activations, else fp32); returns o [T, H, V].
    ``inter`` [max(M, 1), H, K, V] is filled in place (a repeated request copies the first one's state)."""
    from rocm_k3.flydsl_kernels.kda_prefill_plan import CHUNK, chunk_plan, inter_map, walk_operands

    T, H, K = q.shape
    N = cu.numel() - 1
    dev = q.device
    as_i32 = lambda values: torch.tensor(values, dtype=torch.int32, device=dev)
    chunk_seq, chunk_start, first = chunk_plan(cu.tolist())
    NC = len(chunk_seq)
    rows = [] if positions is None else [tuple(r) for r in positions.tolist()]
    imap, source = inter_map(first, rows, NC)
    f32 = lambda *shape: torch.empty(*shape, dtype=torch.float32, device=dev)
    gc, b = f32(T, H, K), f32(T, H)  # phase 1
    opnd = torch.bfloat16 if walk_operands(cfg.dtype) == "bf16" else torch.float32
    mid = lambda *shape: torch.empty(*shape, dtype=opnd, device=dev)
    aqk, ab = mid(T, H, CHUNK), mid(T, H, CHUNK)  # phase 2: Aqk, the A band (T_II on its diagonal blocks) ...
    kb, qg, kd = mid(T, H, K), mid(T, H, K), mid(T, H, K)  # ... and the walk's row operands KB, QG, KD
    o = torch.empty(T, H, K, dtype=v.dtype, device=dev)
    prep, intra, walk = _kda_chunk_launchers(cfg)
    seqs, starts = as_i32(chunk_seq), as_i32(chunk_start)
    stream = stream_of(q)
    prep(g, beta, seqs, starts, cu, a_log, dt_bias, gc, b, NC, **stream)
    intra(q, k, gc, b, seqs, starts, cu, aqk, ab, kb, qg, kd, NC, scale, **stream)
    walk(qg, kd, gc, ab, kb, v, b, aqk, cu, as_i32(first), state, slots, has_init, o, inter, as_i32(imap), N,
         **stream)
    if rows and source != list(range(len(rows))):
        inter[: len(rows)] = inter[torch.tensor(source, device=dev)]
    return o


def kda_prefill(q, k, v, g, beta, cu_seqlens, state, state_indices, has_initial_state, *, scale=None,
                gate_params=None, qk_l2norm=True, beta_logits=True, intermediate_positions=None):
    """FlyDSL ``kda_prefill``: KDAPrefillOutput(o [T, H, V], intermediate states or None).

    The chunked kernels (:mod:`.kda_chunk_prep`, :mod:`.kda_chunk_intra`, :mod:`.kda_chunk_state`) run unless
    an intermediate position is off the chunk grid; then the recurrent kernel (:mod:`.kda_prefill`) does.
    """
    from rocm_k3.flydsl_kernels.kda_prefill import KdaPrefillConfig
    from rocm_k3.ops.kda import KDAPrefillOutput

    T, H, K = q.shape
    N = cu_seqlens.numel() - 1
    dev = q.device
    M = 0 if intermediate_positions is None else intermediate_positions.shape[0]
    inter = torch.empty(max(M, 1), H, K, K, dtype=torch.float32, device=dev)
    if gate_params is None:
        gate, lower, a_log, dt_bias = "logdecay", None, state, state  # the gate tensors are not read
    else:
        a_log, dt_bias, lower = gate_params
        gate = "softplus" if lower is None else "safe"
    cfg = KdaPrefillConfig(H, K, _name(v.dtype), gate, None if lower is None else float(lower), beta_logits,
                           qk_l2norm)
    scale = float(K**-0.5 if scale is None else scale)
    cu = cu_seqlens.to(torch.int32).contiguous()
    slots = state_indices.to(torch.int32).contiguous()
    has_init = has_initial_state.to(torch.int32).contiguous()
    if not (N and T):
        o = torch.empty(T, H, v.shape[-1], dtype=v.dtype, device=dev)
        if N:  # no tokens at all: each final state is its initial state, or zeros without one
            state[state_indices[~has_initial_state.bool()].long()] = 0.0
        return KDAPrefillOutput(o, inter[:M] if M else None)
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    a_log, dt_bias = a_log.contiguous(), dt_bias.contiguous()
    if not _off_grid(cu_seqlens, intermediate_positions):
        o = _kda_prefill_chunked(cfg, q, k, v, g, beta, cu, state, slots, has_init, inter, intermediate_positions,
                                 a_log, dt_bias, scale)
        return KDAPrefillOutput(o, inter[:M] if M else None)
    o = torch.empty(T, H, v.shape[-1], dtype=v.dtype, device=dev)
    seg_ptr, seg_start, seg_end, seg_row = _segments(cu_seqlens, intermediate_positions, dev)
    _kda_prefill_launcher(cfg)(
        q, k, v, g, beta, cu, state, slots, has_init, seg_ptr, seg_start, seg_end, seg_row, inter, o, a_log, dt_bias,
        N, T, scale, **stream_of(q),
    )
    return KDAPrefillOutput(o, inter[:M] if M else None)


# --- situ_and_mul / silu_and_mul ---------------------------------------------------------------------------


_gated_act_launcher = lazy_builder("rocm_k3.flydsl_kernels.gated_act", "build_gated_act")


def _gated_act(x: torch.Tensor, activation: tuple) -> torch.Tensor:
    from rocm_k3.flydsl_kernels.gated_act import GatedActConfig

    N = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * N).contiguous()  # [R, 2N]
    y = torch.empty(x2.shape[0], N, dtype=x.dtype, device=x.device)
    cfg = GatedActConfig(N, _name(x.dtype), activation)
    total = x2.shape[0] * N // cfg.vec
    if total:
        _gated_act_launcher(cfg)(x2, y, total, **stream_of(x2))
    return y.reshape(*x.shape[:-1], N)


def gated_act_supports(x, *args, **kwargs):
    if x.dtype not in _ACT:
        return False, f"activation dtype {x.dtype} is not bf16/fp16/fp32"
    vec = 16 // x.element_size()
    if (x.shape[-1] // 2) % vec:
        return False, f"half width {x.shape[-1] // 2} is not a multiple of {vec} (one 128-bit access per lane)"
    return OK


def situ_and_mul(x, beta=4.0, linear_beta=25.0):
    """FlyDSL ``situ_and_mul``: x [..., 2N] -> [..., N]."""
    return _gated_act(x, ("situ", float(beta), None if linear_beta is None else float(linear_beta)))


def silu_and_mul(x):
    """FlyDSL ``silu_and_mul``: x [..., 2N] -> [..., N]."""
    return _gated_act(x, ("silu", 0.0, None))


# --- short_conv (prefill) ----------------------------------------------------------------------------------


_short_conv_launcher = lazy_builder("rocm_k3.flydsl_kernels.short_conv", "build_short_conv")


def short_conv_supports(x, weight, cu_seqlens, *, conv_state=None, state_indices=None, has_initial_state=None,
                        activation="silu"):
    if x.dtype not in _ACT:
        return False, f"activation dtype {x.dtype} is not bf16/fp16/fp32"
    if activation not in ("silu", None):
        return False, f"activation {activation!r} is not silu or None"
    return OK


def short_conv(x, weight, cu_seqlens, *, conv_state=None, state_indices=None, has_initial_state=None,
               activation="silu"):
    """FlyDSL ``short_conv``: y [T, C]; conv_state (if given) updated in place at state_indices."""
    from rocm_k3.flydsl_kernels.short_conv import ShortConvConfig

    T, C = x.shape
    N = cu_seqlens.numel() - 1
    dev = x.device
    y = torch.empty_like(x)
    has_state = conv_state is not None
    cfg = ShortConvConfig(C, weight.shape[1], _name(x.dtype), activation == "silu", has_state)
    cu = cu_seqlens.to(torch.int32).contiguous()
    seq_id = torch.repeat_interleave(torch.arange(N, dtype=torch.int32, device=dev), (cu[1:] - cu[:-1]).long())
    if has_state:
        slots = state_indices.to(torch.int32).contiguous()
        init = (has_initial_state if has_initial_state is not None
                else torch.zeros(N, dtype=torch.bool, device=dev)).to(torch.int32)
        state = conv_state
    else:
        slots = init = torch.zeros(max(N, 1), dtype=torch.int32, device=dev)
        state = x  # not read
    if N and T:
        _short_conv_launcher(cfg)(x.contiguous(), weight.contiguous(), cu, seq_id, state, slots, init, y, T, N,
                                  **stream_of(x))
    elif N and has_state:  # no tokens at all: a slot keeps its history, or becomes zeros without one
        conv_state[slots[init == 0].long()] = 0
    return y


# --- route ----------------------------------------------------------------------------------------------------


_route_launcher = lazy_builder("rocm_k3.flydsl_kernels.route", "build_route")


def route_supports(router_logits, top_k, *, correction_bias=None, renormalize=True, scaling_factor=1.0):
    if top_k > 256:
        return False, f"top_k={top_k} > 256 (one winner slot per lane)"
    return OK


def route(router_logits, top_k, *, correction_bias=None, renormalize=True, scaling_factor=1.0):
    """FlyDSL ``route``: RouteResult(weights fp32 [T, k], ids int32 [T, k])."""
    from rocm_k3.flydsl_kernels.route import RouteConfig
    from rocm_k3.ops.moe import RouteResult

    T, E = router_logits.shape
    logits = router_logits.contiguous()
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=logits.device)
    if T:
        cfg = RouteConfig(E, top_k, correction_bias is not None, bool(renormalize), float(scaling_factor))
        bias = correction_bias.contiguous() if correction_bias is not None else logits  # not read without a bias
        _route_launcher(cfg)(logits, bias, weights, ids, T, **stream_of(logits))
    return RouteResult(weights, ids)
