"""The ``triton`` MXFP4 expert layout and its inline-PTX decode, on the CPU (unit tier).

- :func:`layout.prepare` keeps only the re-laid tensors, round-trips exactly (padding included) and the reference
  op runs the prepared weights expert by expert;
- the element map stated in ``layout``'s docstring (chunk / word / register / half -> row, k; the bit positions of
  each code) reproduces the dequantised checkpoint weights, decoded here by an independent fp64 formula;
- the inline PTX the NVIDIA kernel runs (``decode.ASM_TEXTS``) is executed by a small emulator of its instructions
  (and, shl, shr, shf.l.wrap, or, mov of b16 pairs, mul.rn.bf16x2) on every word of a prepared expert, with the
  scale registers the kernel builds, and must give exactly ``E2M1 * 2^(s - 127)`` in bf16.
"""

from __future__ import annotations

import re

import pytest
import torch

from rocm_k3.ops.moe import ExpertWeights, fused_moe
from rocm_k3.quant.mxfp4 import dequantize_mxfp4_reference, quantize_mxfp4_reference

pytest.importorskip("triton", reason="the triton layout lives in rocm_k3.triton_kernels (the kernels extra)")
from rocm_k3.triton_kernels.moe import layout as L  # noqa: E402

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _experts(e: int, n: int, k: int, kout: int, seed: int, scale_range: tuple[int, int] | None = None) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    w13, s13 = quantize_mxfp4_reference(torch.randn(e, 2 * n, k, generator=g), "ct")
    w2, s2 = quantize_mxfp4_reference(torch.randn(e, kout, n, generator=g), "ct")
    if scale_range is not None:  # arbitrary E8M0 bytes (codes stay random)
        s13 = torch.randint(*scale_range, s13.shape, generator=g, dtype=torch.uint8)
        s2 = torch.randint(*scale_range, s2.shape, generator=g, dtype=torch.uint8)
        w13 = torch.randint(0, 256, w13.shape, generator=g, dtype=torch.uint8)
        w2 = torch.randint(0, 256, w2.shape, generator=g, dtype=torch.uint8)
    return ExpertWeights("mxfp4", w13, s13, w2, s2)


SHAPES = [(3, 64, 128, 128), (2, 96, 160, 96), (2, 32, 32, 32)]  # E, N, K, Kout: exact fit, padded, tiny model


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "E{}-N{}-K{}-Kout{}".format(*s))
def test_prepare_is_single_copy_and_exactly_invertible(shape) -> None:
    w = _experts(*shape, seed=1, scale_range=(0, 255))
    p = L.prepare(w)
    assert p.layout == "triton" and not p.has_checkpoint_tensors and p.w13 is None
    assert (p.num_experts, p.hidden, p.intermediate, p.out_features) == (w.num_experts, w.hidden, w.intermediate,
                                                                         w.out_features)
    t = p.extras["triton"]
    assert {id(x) for x in (t.w13, t.w13_s, t.w2, t.w2_s)}.isdisjoint({id(w.w13), id(w.w2)})
    back = p.to_checkpoint()
    for name in ("w13", "w13_scale", "w2", "w2_scale"):
        assert torch.equal(getattr(back, name), getattr(w, name)), name
    for e in range(w.num_experts):
        got = p.checkpoint_expert(e)
        assert all(torch.equal(a, b) for a, b in zip(got, w.checkpoint_expert(e)))
    assert t.fold13 == (int(w.w13_scale.max()) <= 128) and t.fold2 == (int(w.w2_scale.max()) <= 128)


def test_reference_runs_prepared_weights() -> None:
    w = _experts(4, 64, 128, 128, seed=2)
    p = L.prepare(w)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 128, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(5)]).int()
    tw = torch.rand(5, 2, generator=g)
    assert torch.equal(fused_moe(x, p, tw, ids, backend="reference"), fused_moe(x, w, tw, ids, backend="reference"))


def test_prepared_weights_validation() -> None:
    from rocm_k3.ops.moe import ExpertDims

    dims = ExpertDims(2, 64, 32, 64, torch.device("cpu"))
    with pytest.raises(TypeError, match="need dims"):
        ExpertWeights("mxfp4", None, None, None, None, layout="triton")
    with pytest.raises(ValueError, match="codec"):
        ExpertWeights.prepared("mxfp4", "mystery", dims, {})
    with pytest.raises(ValueError, match="no checkpoint tensors"):
        ExpertWeights("mxfp4", None, torch.zeros(1, dtype=torch.uint8), None, None, layout="triton", dims=dims)
    with pytest.raises(ValueError, match="positive int"):
        ExpertDims(0, 64, 32, 64, torch.device("cpu"))
    with pytest.raises(ValueError, match="not in the 'triton' layout"):
        L.to_checkpoint(_experts(1, 32, 32, 32, seed=4))


def _value(code: torch.Tensor) -> torch.Tensor:
    """fp64 value of E2M1 codes (int, bit 3 = sign)."""
    mag = torch.tensor(E2M1, dtype=torch.float64)[code & 7]
    return torch.where(code & 8 > 0, -mag, mag)


def _decode_by_docstring(chunks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp64 [E, R, K] from layout tensors, using only the element map of the layout docstring."""
    E, G, U = chunks.shape[:3]
    words = chunks.contiguous().view(torch.int32).reshape(E, G, U, 2, 128, 4).long() & 0xFFFFFFFF
    out = torch.empty(E, G * 64, U * 128, dtype=torch.float64)
    ch = torch.arange(128)
    w, g, q = ch // 32, (ch // 4) % 8, ch % 4
    for kg in range(U):
        for unit in range(2):
            for word in range(4):
                s1, s0 = divmod(word, 2)
                for j in range(4):
                    c, h = divmod(j, 2)
                    for e in range(2):
                        code = torch.zeros_like(words[:, :, kg, unit, :, word])
                        for bit, pos in zip((3, 2, 1, 0), L.BIT_POSITIONS[j][e]):
                            code |= ((words[:, :, kg, unit, :, word] >> pos) & 1) << bit
                        rows = 16 * w + 8 * h + g  # [128] within the group
                        k = 128 * kg + 64 * unit + 32 * s1 + 16 * s0 + 8 * c + 2 * q + e
                        sbyte = scales[:, :, kg, (w * 8 + g), 4 * unit + 2 * h + s1].long()  # [E, G, 128]
                        val = _value(code) * torch.pow(2.0, sbyte.double() - 127)
                        for grp in range(G):
                            out[:, grp * 64 + rows, k] = val[:, grp]
    return out


def test_layout_element_map_matches_dequantised_checkpoint() -> None:
    w = _experts(2, 64, 256, 128, seed=5, scale_range=(100, 140))
    p = L.prepare(w)
    t = p.extras["triton"]
    n = w.intermediate
    ref13 = dequantize_mxfp4_reference(w.w13, w.w13_scale, torch.float64)  # [E, 2N, K] gate | up
    got13 = _decode_by_docstring(t.w13, t.w13_s)  # [E, 2N, K]: 64 gate rows, 64 up rows, ...
    got13 = got13.reshape(2, n // 64, 2, 64, -1)
    assert torch.equal(got13[:, :, 0].reshape(2, n, -1), ref13[:, :n])
    assert torch.equal(got13[:, :, 1].reshape(2, n, -1), ref13[:, n:])
    ref2 = dequantize_mxfp4_reference(w.w2, w.w2_scale, torch.float64)  # [E, Kout, N]; K = N = 64 padded to 128
    got2 = _decode_by_docstring(t.w2, t.w2_s)
    assert torch.equal(got2[:, :, :n], ref2) and not got2[:, :, n:].any()


# ------------------------------------------------------------------------------ the inline PTX, emulated
def _bf16_bits_to_f64(bits: torch.Tensor) -> torch.Tensor:
    return (bits.to(torch.int32) << 16).view(torch.float32).double()


def _f64_to_bf16_bits(v: torch.Tensor) -> torch.Tensor:
    return (v.to(torch.float32).to(torch.bfloat16).view(torch.int16).long() & 0xFFFF)


class _Ptx:
    """Executes the straight-line PTX of the decode asm on int64 tensors holding 32-bit registers."""

    def __init__(self, text: str, args: dict[str, torch.Tensor]) -> None:
        self.regs = dict(args)
        body = text.strip().strip("{}")
        for line in (ln.strip().rstrip(";") for ln in body.splitlines()):
            if line and not line.startswith(".reg"):
                self._run(line)

    def _get(self, name: str) -> torch.Tensor:
        if re.fullmatch(r"0x[0-9A-Fa-f]+|\d+", name):
            return torch.tensor(int(name, 0), dtype=torch.int64)
        return self.regs[name]

    def _run(self, line: str) -> None:
        op, rest = line.split(None, 1)
        unpack = re.fullmatch(r"\{(\w+), (\w+)\}, (\S+)", rest)  # mov.b32 {lo, hi}, src
        pack = re.fullmatch(r"(\S+), \{(\w+), (\w+)\}", rest)  # mov.b32 dst, {lo, hi}
        if op == "mov.b32" and unpack:
            v = self._get(unpack.group(3))
            self.regs[unpack.group(1)], self.regs[unpack.group(2)] = v & 0xFFFF, (v >> 16) & 0xFFFF
            return
        if op == "mov.b32" and pack:
            self.regs[pack.group(1)] = self._get(pack.group(2)) | (self._get(pack.group(3)) << 16)
            return
        dst, *srcs = [part.strip() for part in rest.split(",")]
        a = [self._get(src) for src in srcs]
        if op == "mov.b32":
            r = a[0]
        elif op == "and.b32":
            r = a[0] & a[1]
        elif op == "or.b32":
            r = a[0] | a[1]
        elif op == "shl.b32":
            r = (a[0] << a[1]) & 0xFFFFFFFF
        elif op == "shr.b32":
            r = (a[0] & 0xFFFFFFFF) >> a[1]
        elif op == "shf.l.wrap.b32":  # high word of {b, a} << (c mod 32)
            r = ((((a[1] & 0xFFFFFFFF) << 32) | (a[0] & 0xFFFFFFFF)) << (a[2] & 31)) >> 32 & 0xFFFFFFFF
        elif op == "mul.rn.bf16x2":
            lo = _f64_to_bf16_bits(_bf16_bits_to_f64(a[0] & 0xFFFF) * _bf16_bits_to_f64(a[1] & 0xFFFF))
            hi = _f64_to_bf16_bits(_bf16_bits_to_f64(a[0] >> 16) * _bf16_bits_to_f64(a[1] >> 16))
            r = lo | (hi << 16)
        else:
            raise AssertionError(f"the emulator does not know {op!r}: extend it with the new instruction")
        self.regs[dst] = r


@pytest.mark.parametrize("fold", [True, False], ids=["fold", "two-mul"])
def test_inline_ptx_decodes_every_word_exactly(fold: bool) -> None:
    from rocm_k3.triton_kernels.moe.decode import ASM_TEXTS

    scale_range = (0, 129) if fold else (0, 255)
    w = _experts(2, 128, 128, 128, seed=6, scale_range=scale_range)
    t = L.prepare(w).extras["triton"]
    words = t.w2.contiguous().view(torch.int32).long() & 0xFFFFFFFF  # [E, G, U, 2, 128, 4]
    sw = t.w2_s.contiguous().view(torch.int32).long() & 0xFFFFFFFF  # [E, G, U, 32, 2 units]
    E, G, U = words.shape[:3]
    sw = sw.reshape(E, G, U, 4, 8, 2).permute(0, 1, 2, 5, 3, 4)  # E G kg unit w g
    pair = torch.stack([sw & 0x00FF00FF, (sw >> 8) & 0x00FF00FF], -1)  # ... s1: bytes of rows r | r + 8
    if fold:
        mult = pair * 128 + 0x3F003F00
    else:
        mult = (pair * 128) | torch.where((pair & 0xFF) == 0, 0x40, 0) | torch.where((pair >> 16) == 0, 0x400000, 0)
    # the asm instance of (chunk = 32 w + 4 g + q, word = 2 s1 + s0) gets the scale register of (w, g, s1)
    mult = mult.reshape(E, G, U, 2, 4, 8, 1, 2, 1).expand(E, G, U, 2, 4, 8, 4, 2, 2).reshape(words.shape)
    regs = _Ptx(ASM_TEXTS[fold], {"$4": words, "$5": mult, "$6": mult, "$7": mult, "$8": mult}).regs
    ref = dequantize_mxfp4_reference(w.w2, w.w2_scale, torch.float32).double()  # [E, R, K]
    ch = torch.arange(128)
    wi, gi, qi = ch // 32, (ch // 4) % 8, ch % 4
    got = torch.empty_like(ref)
    for j in range(4):
        c, h = divmod(j, 2)
        for e in range(2):
            val = _bf16_bits_to_f64((regs[f"${j}"] >> (16 * e)) & 0xFFFF)  # [E, G, U, 2, 128, 4]
            for kg in range(U):
                for unit in range(2):
                    for word in range(4):
                        s1, s0 = divmod(word, 2)
                        k = 128 * kg + 64 * unit + 32 * s1 + 16 * s0 + 8 * c + 2 * qi + e
                        for grp in range(G):
                            got[:, grp * 64 + 16 * wi + 8 * h + gi, k] = val[:, grp, kg, unit, :, word]
    assert torch.equal(got, ref.to(torch.bfloat16).double()), "asm decode differs from E2M1 * 2^(s - 127)"
