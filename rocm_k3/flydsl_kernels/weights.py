"""Host-side pre-shuffle of MXFP4 expert weights for the FlyDSL MoE GEMMs, and its exact inverse.

Checkpoint layout (K3_SPEC section 6): codes ``w [E, R, K/2]`` uint8 (two E2M1 codes per byte, low nibble =
even k) and scales ``s [E, R, K/32]`` uint8 (E8M0), R = output rows (2N for w13, Kout for w2).

FlyDSL layout: the MFMA lane that supplies output row ``n`` (``n % 16`` inside a 16-row tile) and lane group
``q`` (``lane // 16``) reads, per K group of 128, ONE 16-byte vector: 4 dwords of 8 codes each, in the
order its decode and MFMA steps consume them (``plans.moe_dword_k``; "step" puts the nibbles in the order of the
byte-lookup decode, ``plans.STEP_NIBBLE_K``):

    codes  [E, R/16, K/128, 64 lanes, 4 dwords] int32     dword d, nibble p of lane l holds
           w[e, tile*16 + l % 16, moe_dword_k(l, g, d, p, layout)]
    scales [E, R/16, K/128, 16 rows, 4 blocks] uint8      = s[e, tile*16 + r, g*4 + b]

so a wave reads 1 KiB of contiguous codes per (tile, group) and lanes sharing a row read one scale dword.
``layout`` "step" (gfx942: each MFMA step is one MX block) or "lane" (gfx950: each lane group owns one MX
block, the operand layout of the scaled MFMA); see ``plans.moe_k_index``.
"""

from __future__ import annotations

import torch

from rocm_k3.flydsl_kernels.plans import MOE_K_GROUP, STEP_NIBBLE_K

LAYOUTS = ("step", "lane")


def layout_for_arch(arch: str) -> str:
    """The K layout of the pre-shuffled weights a target's MoE kernels read."""
    if arch == "gfx942":
        return "step"
    if arch == "gfx950":
        return "lane"
    raise ValueError(f"FlyDSL MoE kernels target gfx942 or gfx950, got {arch!r}")


def _check(codes: torch.Tensor, scales: torch.Tensor, layout: str) -> tuple[int, int, int]:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if codes.dtype != torch.uint8 or codes.dim() != 3:
        raise TypeError(f"codes must be uint8 [E, R, K/2], got {codes.dtype} {list(codes.shape)}")
    E, R, half_k = codes.shape
    K = 2 * half_k
    if R % 16 or K % MOE_K_GROUP:
        raise ValueError(f"codes [E, R, K/2] = {list(codes.shape)}: need R % 16 == 0 and K % {MOE_K_GROUP} == 0")
    if scales.dtype != torch.uint8 or tuple(scales.shape) != (E, R, K // 32):
        raise ValueError(f"scales must be uint8 [E, R, K/32] = {[E, R, K // 32]}, got {scales.dtype} {list(scales.shape)}")
    return E, R, K


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> uint8 [..., K] one code per element (low nibble first)."""
    return torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2)


def _pack(nibbles: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K] codes -> uint8 [..., K/2] (low nibble = even element)."""
    pairs = nibbles.unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _lane_order(E: int, R: int, K: int, nib: torch.Tensor, layout: str) -> torch.Tensor:
    """[E, R, K] codes -> [E, R/16, K/128, 64, 32] codes in each lane's dword/nibble order."""
    G = K // MOE_K_GROUP
    t = nib.reshape(E, R // 16, 16, G, 4, 4, 8)  # [E, tile, row, g, a, b, p]: k = g*128 + a*32 + b*8 + p
    if layout == "step":
        # lane q = b (k = g*128 + d*32 + q*8 + o): dword d = a, nibble p holds offset o = STEP_NIBBLE_K[p]
        t = t.permute(0, 1, 3, 5, 2, 4, 6)[..., list(STEP_NIBBLE_K)]  # [E, tile, g, q=b, row, d=a, p]
    else:
        # lane q = a (k = g*128 + q*32 + d*8 + p): dword d = b
        t = t.permute(0, 1, 3, 4, 2, 5, 6)  # [E, tile, g, q=a, row, d=b, p]
    return t.reshape(E, R // 16, G, 64, 32)  # lane = q*16 + row


def preshuffle_codes(codes: torch.Tensor, scales: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint (codes uint8 [E, R, K/2], scales uint8 [E, R, K/32]) -> (int32 [E, R/16, K/128, 64, 4],
    uint8 [E, R/16, K/128, 16, 4]) as described in the module docstring."""
    E, R, K = _check(codes, scales, layout)
    G = K // MOE_K_GROUP
    lanes = _lane_order(E, R, K, _nibbles(codes), layout)  # [E, tiles, G, 64, 32]
    packed = _pack(lanes).contiguous()  # [E, tiles, G, 64, 16] bytes: dword d = bytes 4d..4d+3 (little endian)
    words = packed.view(torch.int32)  # [E, tiles, G, 64, 4]
    s = scales.reshape(E, R // 16, 16, G, 4).permute(0, 1, 3, 2, 4).contiguous()  # [E, tiles, G, 16, 4]
    return words, s


def unshuffle_codes(words: torch.Tensor, s: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact inverse of :func:`preshuffle_codes`: back to checkpoint (codes [E, R, K/2], scales [E, R, K/32])."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if words.dtype != torch.int32 or words.dim() != 5 or tuple(words.shape[3:]) != (64, 4):
        raise ValueError(f"words must be int32 [E, R/16, K/128, 64, 4], got {words.dtype} {list(words.shape)}")
    E, tiles, G = words.shape[:3]
    if s.dtype != torch.uint8 or tuple(s.shape) != (E, tiles, G, 16, 4):
        raise ValueError(f"scales must be uint8 [E, R/16, K/128, 16, 4] = {[E, tiles, G, 16, 4]}, got {list(s.shape)}")
    R, K = tiles * 16, G * MOE_K_GROUP
    nib = _nibbles(words.contiguous().view(torch.uint8))  # [E, tiles, G, 64, 32]
    t = nib.reshape(E, tiles, G, 4, 16, 4, 8)  # [E, tile, g, q, row, d, p]
    if layout == "step":
        t = t[..., list(STEP_NIBBLE_K)].permute(0, 1, 4, 2, 5, 3, 6)  # [E, tile, row, g, a=d, b=q, offset]
    else:
        t = t.permute(0, 1, 4, 2, 3, 5, 6)  # [E, tile, row, g, a=q, b=d, p]
    codes = _pack(t.reshape(E, R, K)).contiguous()
    scales = s.permute(0, 1, 3, 2, 4).reshape(E, R, K // 32).contiguous()
    return codes, scales


def checkpoint_expert(weights, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codec of the ``flydsl`` layout (``ExpertWeights.checkpoint_expert``): expert ``e`` of prepared weights in
    checkpoint layout, (w13 [2N, K/2], w13_scale [2N, K/32], w2 [Kout, N/2], w2_scale [Kout, N/32])."""
    ex = weights.extras
    w13, s13 = unshuffle_codes(ex["w13_q"][e : e + 1], ex["w13_s"][e : e + 1], ex["k_layout"])
    w2, s2 = unshuffle_codes(ex["w2_q"][e : e + 1], ex["w2_s"][e : e + 1], ex["k_layout"])
    return w13[0], s13[0], w2[0], s2[0]


def to_checkpoint(weights):
    """Codec of the ``flydsl`` layout (``ExpertWeights.to_checkpoint``): the whole layer in checkpoint layout."""
    from rocm_k3.ops.moe_types import ExpertWeights

    ex = weights.extras
    w13, s13 = unshuffle_codes(ex["w13_q"], ex["w13_s"], ex["k_layout"])
    w2, s2 = unshuffle_codes(ex["w2_q"], ex["w2_s"], ex["k_layout"])
    return ExpertWeights("mxfp4", w13, s13, w2, s2)
