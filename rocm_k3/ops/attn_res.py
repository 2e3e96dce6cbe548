"""Attention Residuals (AttnRes, K3_SPEC section 5): a learned softmax mix over depth instead of one residual.

The model keeps, per token, a bank of completed block snapshots ``blocks [B_max, T, Hd]`` (b_0 = the token
embedding; at most 8 are mixed in K3) and the running partial sum ``p`` of the current block. Every sublayer
input is ``mix(p, blocks[:num_blocks])``:

    sources V = [blocks[0], ..., blocks[num_blocks - 1], p]                      # num_blocks + 1 sources
    logit_i = <norm_w * proj_w, V_i> * rsqrt(mean(V_i^2) + eps)                   # fp32, per token
    a = softmax_i(logit);  out = sum_i a_i V_i

Ops:
- :func:`attn_res_mix` is the mix alone.
- :func:`attn_res_step` is what a fused kernel does between two sublayers: ``p = partial + delta``, the mix,
  the optional snapshot of ``p`` into the bank (in place), and the RMSNorm of the mixed input of the next sublayer.

The bank lives for one forward pass only; it is not part of the KV cache.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from rocm_k3.ops import registry
from rocm_k3.ops.norm import rms_norm_reference
from rocm_k3.ops.tensor_checks import check_like

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class AttnResStepOutput(NamedTuple):
    normed: torch.Tensor  # [T, Hd] rms_norm(mix(p, blocks)), p's dtype: the input of the next sublayer
    partial: torch.Tensor  # [T, Hd] p = partial + delta (the caller drops it after a block write)


# ----------------------------------------------------------------------------------------------------------
# boundary validation
# ----------------------------------------------------------------------------------------------------------
def _float(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must have dtype float32, bfloat16 or float16, got {t.dtype}")
    return t


def _check_common(ref_name: str, ref: torch.Tensor, blocks: object, num_blocks: object, eps: object,
                  weights: dict[str, object]) -> None:
    """Validate the bank, num_blocks, the [Hd] weight vectors and eps against ``ref`` [T, Hd]."""
    if ref.dim() != 2:
        raise ValueError(f"{ref_name} must have shape [T, Hd], got {list(ref.shape)}")
    tokens, hidden = ref.shape
    blocks = _float("blocks", blocks)
    if blocks.dim() != 3 or tuple(blocks.shape[1:]) != (tokens, hidden):
        raise ValueError(
            f"blocks must have shape [B_max, T, Hd] = [B_max, {tokens}, {hidden}], got {list(blocks.shape)}"
        )
    if blocks.dtype != ref.dtype:
        raise TypeError(f"blocks dtype {blocks.dtype} must match {ref_name} dtype {ref.dtype}")
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int):
        raise TypeError(f"num_blocks must be an int, got {type(num_blocks).__name__}")
    if not 0 <= num_blocks <= blocks.shape[0]:
        raise ValueError(f"num_blocks must be in [0, B_max = {blocks.shape[0]}], got {num_blocks}")
    for name, w in weights.items():
        w = _float(name, w)
        if tuple(w.shape) != (hidden,):
            raise ValueError(f"{name} must have shape [Hd] = [{hidden}], got {list(w.shape)}")
        if w.device != ref.device:
            raise ValueError(f"{name} is on {w.device} but {ref_name} is on {ref.device}; all must share a device")
    if blocks.device != ref.device:
        raise ValueError(f"blocks is on {blocks.device} but {ref_name} is on {ref.device}; all must share a device")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be finite and > 0, got {eps}")


# ----------------------------------------------------------------------------------------------------------
# references
# ----------------------------------------------------------------------------------------------------------
def _source_logit(v: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """<w, v_t> * rsqrt(mean(v_t^2) + eps) per token, fp32 [T]."""
    vf = v.float()  # [T, Hd]
    return (vf @ w) * torch.rsqrt(vf.square().mean(dim=-1) + eps)


def _attn_res_mix_reference(partial: torch.Tensor, blocks: torch.Tensor, num_blocks: int,
                            proj_weight: torch.Tensor, norm_weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    # under autograd (training) the bank is written again after this read: keep copies for backward, not views
    bank = blocks[:num_blocks].clone() if blocks.requires_grad else blocks
    sources = [bank[i] for i in range(num_blocks)] + [partial]  # each [T, Hd]
    w = norm_weight.float() * proj_weight.float()  # [Hd]
    logits = torch.stack([_source_logit(v, w, eps) for v in sources])  # [S, T]
    weights = torch.softmax(logits, dim=0)  # [S, T]
    out = torch.zeros(partial.shape, dtype=torch.float32, device=partial.device)  # [T, Hd]
    for i, v in enumerate(sources):  # one source in fp32 at a time: no [S, T, Hd] temporary
        out += weights[i, :, None] * v.float()
    return out.to(partial.dtype)


def _attn_res_step_reference(partial: torch.Tensor | None, delta: torch.Tensor | None, blocks: torch.Tensor,
                             num_blocks: int, *, write_block: bool, proj_weight: torch.Tensor,
                             norm_weight: torch.Tensor, rms_weight: torch.Tensor,
                             eps: float = 1e-5) -> AttnResStepOutput:
    if partial is None or delta is None:
        given = partial if partial is not None else delta
        p = given.clone()  # a fresh tensor either way, never an alias of the input
    else:
        p = (partial.float() + delta.float()).to(partial.dtype)  # [T, Hd]
    x = _attn_res_mix_reference(p, blocks, num_blocks, proj_weight, norm_weight, eps)  # [T, Hd]
    if write_block:
        blocks[num_blocks].copy_(p)  # snapshot the finished block, in place
    return AttnResStepOutput(rms_norm_reference(x, rms_weight, eps), p)


REFERENCE_IMPLS = {
    "attn_res_mix": _attn_res_mix_reference,
    "attn_res_step": _attn_res_step_reference,
}


# ----------------------------------------------------------------------------------------------------------
# public ops
# ----------------------------------------------------------------------------------------------------------
def attn_res_mix(partial: torch.Tensor, blocks: torch.Tensor, num_blocks: int, proj_weight: torch.Tensor,
                 norm_weight: torch.Tensor, eps: float = 1e-5, *, backend: str | None = None) -> torch.Tensor:
    """Softmax mix over depth of the first ``num_blocks`` bank entries and the partial sum.

    Args:
        partial: [T, Hd] running partial sum p of the current block.
        blocks: [B_max, T, Hd] block bank, same dtype as ``partial``; only ``blocks[:num_blocks]`` are read.
        num_blocks: completed blocks to mix, 0 <= num_blocks <= B_max (0: the result equals ``partial``).
        proj_weight, norm_weight: [Hd] (any float dtype); the logit direction is their product.
        eps: inside the per-source rsqrt.

    Math (fp32): ``V = [blocks[0..num_blocks-1], partial]``;
    ``logit_i = <norm_weight * proj_weight, V_i> * rsqrt(mean(V_i^2) + eps)``; ``out = sum_i softmax(logit)_i V_i``.

    Returns: [T, Hd] in ``partial``'s dtype.
    """
    partial = _float("partial", partial)
    _check_common("partial", partial, blocks, num_blocks, eps,
                  {"proj_weight": proj_weight, "norm_weight": norm_weight})
    return registry.dispatch("attn_res_mix", backend, partial, blocks, num_blocks, proj_weight, norm_weight, eps)


def attn_res_step(partial: torch.Tensor | None, delta: torch.Tensor | None, blocks: torch.Tensor, num_blocks: int,
                  *, write_block: bool, proj_weight: torch.Tensor, norm_weight: torch.Tensor,
                  rms_weight: torch.Tensor, eps: float = 1e-5, backend: str | None = None) -> AttnResStepOutput:
    """The fused step between two sublayers: accumulate, mix over depth, optionally snapshot, RMSNorm.

    Args:
        partial: [T, Hd] running partial sum, or None (a block was just snapshotted).
        delta: [T, Hd] output of the previous sublayer, or None; at least one of partial/delta is given, and
            when both are, they share shape and dtype.
        blocks: [B_max, T, Hd] block bank (same dtype); ``blocks[num_blocks]`` is written when ``write_block``.
        num_blocks: completed blocks mixed (the snapshot written by this call is NOT among them).
        write_block: store p into ``blocks[num_blocks]`` in place; requires num_blocks < B_max.
        proj_weight, norm_weight: [Hd] mix parameters (see :func:`attn_res_mix`).
        rms_weight: [Hd] weight of the RMSNorm in front of the next sublayer.
        eps: used by both the mix and the RMSNorm.

    Math: ``p = partial + delta`` (fp32 add, cast to the activation dtype; a missing term counts as 0);
    ``x = attn_res_mix(p, blocks, num_blocks)``; ``normed = x * rsqrt(mean(x^2) + eps) * rms_weight`` (fp32).

    Returns: AttnResStepOutput(normed [T, Hd], partial = p [T, Hd]), both in the activation dtype. The caller
    resets its partial to None after a block write.
    """
    if partial is None and delta is None:
        raise ValueError("attn_res_step needs partial or delta (or both); both are None")
    if not isinstance(write_block, bool):
        raise TypeError(f"write_block must be a bool, got {type(write_block).__name__}")
    given = {name: _float(name, t) for name, t in (("partial", partial), ("delta", delta)) if t is not None}
    ref_name, ref = next(iter(given.items()))
    check_like(ref_name, ref, given)
    _check_common(ref_name, ref, blocks, num_blocks, eps,
                  {"proj_weight": proj_weight, "norm_weight": norm_weight, "rms_weight": rms_weight})
    if write_block and num_blocks >= blocks.shape[0]:
        raise ValueError(
            f"write_block=True needs a free bank row, but num_blocks = {num_blocks} and the bank holds "
            f"B_max = {blocks.shape[0]} blocks (bank full)"
        )
    return registry.dispatch("attn_res_step", backend, partial, delta, blocks, num_blocks, write_block=write_block,
                             proj_weight=proj_weight, norm_weight=norm_weight, rms_weight=rms_weight, eps=eps)
