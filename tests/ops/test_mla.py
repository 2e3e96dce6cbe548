"""MLA ops (reference backend) against independent dense formulations written here, at the released latent
geometry (kv_lora_rank 512, rope 64, nope 128, v 128) and at others (the ops read the widths from the shapes).

- prefill: a per-head expanded attention (k = [c_kv W_uk^T | k_pe], v = c_kv W_uv^T) in fp64 over the dense
  context, with a bottom-right-aligned causal mask, never reading the paged cache;
- decode: absorb W_uk into q, run mla_decode, apply W_uv, compare with the same expanded attention;
- paged layouts: random non-contiguous block tables, unused blocks and table padding poisoned with NaN.

Tolerances (relative, per output tensor): fp32 1e-5 (fp32 vs fp64 math; measured <= 5e-7); bf16 1e-2 (the
inputs are the same bf16 values, the output is rounded to bf16, and in decode q_latent and the latent output
are rounded too; measured <= 2.5e-3).
"""

from __future__ import annotations

import pytest
import torch

from rocm_k3.ops import mla
from tests.helpers import assert_rel, seeded

NOPE, ROPE, LORA, VD = 128, 64, 512, 128
SCALE = (NOPE + ROPE) ** -0.5
# (kv_lora_rank, rope, nope, v): no release uses these; odd sizes and v != nope included
OTHER_GEOMETRIES = {"R32-P16-N32-V32": (32, 16, 32, 32), "R48-P24-N40-V24": (48, 24, 40, 24),
                    "R64-P8-N16-V48": (64, 8, 16, 48)}
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16"}


# ------------------------------------------------------------------------------------------------------------
# test-side builders and the independent formulation
# ------------------------------------------------------------------------------------------------------------
def random_latents(lengths: list[int], gen: torch.Generator, width: int = LORA + ROPE) -> list[torch.Tensor]:
    """Per-sequence dense latents [L, R + P]: c_kv ~ N(0, 1) (as after its RMSNorm), k_pe ~ N(0, 1)."""
    return [torch.randn(length, width, generator=gen) for length in lengths]


def random_kv_b(num_heads: int, gen: torch.Generator, lora: int = LORA, nope: int = NOPE,
                vd: int = VD) -> torch.Tensor:
    """[H * (Dn + Dv), R] with unit-variance k_nope / v outputs for unit-variance c_kv."""
    return torch.randn(num_heads * (nope + vd), lora, generator=gen) / lora**0.5


def build_paged(latents: list[torch.Tensor], block_size: int, dtype: torch.dtype, gen: torch.Generator,
                spare_blocks: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter each sequence's latents over randomly permuted physical blocks.

    Returns kv_cache [num_blocks, block_size, 576] (every slot not holding context = NaN) and block_table int32
    [N, max_blocks] whose unused entries point at a NaN block, so a read past seq_lens poisons the output.
    """
    need = [-(-lat.shape[0] // block_size) for lat in latents]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    cache = torch.full((num_blocks, block_size, latents[0].shape[1]), float("nan"), dtype=dtype)
    max_blocks = max(need) + 1
    table = torch.full((len(latents), max_blocks), perm[-1], dtype=torch.int32)  # perm[-1]: a spare NaN block
    cursor = 0
    for i, lat in enumerate(latents):
        for j in range(need[i]):
            block = perm[cursor]
            cursor += 1
            table[i, j] = block
            rows = lat[j * block_size:(j + 1) * block_size]
            cache[block, :rows.shape[0]] = rows.to(dtype)
    return cache, table


def expanded_attention(q: torch.Tensor, latent: torch.Tensor, kv_b: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain causal softmax attention in fp64; q [n, H, Dn + P] are the last n of L positions; returns [n, H, Dv].

    The widths come from the shapes: R = kv_b columns, P = latent width - R, Dn = q width - P.
    """
    q, latent, kv_b = q.double(), latent.double(), kv_b.double()
    n, num_heads, q_width = q.shape
    length = latent.shape[0]
    lora = kv_b.shape[1]
    nope = q_width - (latent.shape[1] - lora)
    per_head = kv_b.shape[0] // num_heads
    c_kv, k_pe = latent[:, :lora], latent[:, lora:]
    allowed = torch.ones(n, length, dtype=torch.bool).tril(diagonal=length - n)  # query j sees keys <= L-n+j
    heads = []
    for h in range(num_heads):
        w_uk = kv_b[h * per_head:h * per_head + nope]  # [Dn, R]
        w_uv = kv_b[h * per_head + nope:(h + 1) * per_head]  # [Dv, R]
        k = torch.cat([c_kv @ w_uk.T, k_pe], dim=-1)  # [L, Dn + P]
        v = c_kv @ w_uv.T  # [L, Dv]
        s = (q[:, h] @ k.T) * scale  # [n, L]
        s = s.masked_fill(~allowed, float("-inf"))
        heads.append(torch.softmax(s, dim=-1) @ v)
    return torch.stack(heads, dim=1)


def cu_from_counts(counts: list[int]) -> torch.Tensor:
    return torch.tensor([0] + counts, dtype=torch.int32).cumsum(0).to(torch.int32)


# ------------------------------------------------------------------------------------------------------------
# prefill
# ------------------------------------------------------------------------------------------------------------
# (context length L after the step, new tokens n) per sequence
PREFILL_CASES = {
    "fresh-L37": [(37, 37)],
    "chunked-ctx100-new37": [(137, 37)],
    "varlen-4seq": [(137, 37), (50, 50), (1, 1), (70, 3)],
    "with-empty-seq": [(20, 0), (65, 65)],
    "ctx100-new300": [(400, 300)],  # more queries than one reference score block (256)
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("block_size", [16, 64], ids=lambda b: f"bs{b}")
@pytest.mark.parametrize("case", list(PREFILL_CASES), ids=str)
def test_prefill_matches_dense_causal_attention(case: str, block_size: int, dtype: torch.dtype) -> None:
    seqs = PREFILL_CASES[case]
    gen = seeded(1000 + block_size)
    num_heads = 2
    lengths, counts = [s[0] for s in seqs], [s[1] for s in seqs]
    latents = [lat.to(dtype) for lat in random_latents(lengths, gen)]
    kv_b = random_kv_b(num_heads, gen).to(dtype)
    q = torch.randn(sum(counts), num_heads, NOPE + ROPE, generator=gen).to(dtype)
    cache, table = build_paged(latents, block_size, dtype, gen)
    cu = cu_from_counts(counts)
    out = mla.mla_prefill(q, cache, table, cu, torch.tensor(lengths, dtype=torch.int32), kv_b)
    assert out.shape == (sum(counts), num_heads, VD) and out.dtype == dtype
    for i, (length, n) in enumerate(seqs):
        q0, q1 = int(cu[i]), int(cu[i + 1])
        if n == 0:
            continue
        ref = expanded_attention(q[q0:q1], latents[i], kv_b, SCALE)
        assert_rel(out[q0:q1], ref, TOL[dtype], name=f"{case} seq{i} out")


def test_prefill_output_gate() -> None:
    """``gate [T, H, Dv]``: the output times sigmoid(gate), in fp32 before the rounding (a strided gate view, as the
    model's split of its merged projection gives, is fine)."""
    gen = seeded(8)
    lengths, counts = [9, 20], [4, 20]
    latents = random_latents(lengths, gen)
    kv_b = random_kv_b(2, gen)
    q = torch.randn(sum(counts), 2, NOPE + ROPE, generator=gen)
    cache, table = build_paged(latents, 16, torch.float32, gen)
    cu, lens = cu_from_counts(counts), torch.tensor(lengths, dtype=torch.int32)
    merged = torch.randn(sum(counts), 3 * 2 * VD, generator=gen) * 2
    gate = merged[:, VD : VD + 2 * VD].view(sum(counts), 2, VD)  # [T, H, Dv], row stride 3 H Dv
    plain = mla.mla_prefill(q, cache, table, cu, lens, kv_b)
    assert_rel(mla.mla_prefill(q, cache, table, cu, lens, kv_b, gate=gate), plain * torch.sigmoid(gate), 1e-6,
               name="gated")
    with pytest.raises(ValueError, match=r"gate must have shape \[T, H, v_head_dim\] = \[24, 2, 128\]"):
        mla.mla_prefill(q, cache, table, cu, lens, kv_b, gate=gate[:, :1])
    with pytest.raises(TypeError, match="gate must have dtype"):
        mla.mla_prefill(q, cache, table, cu, lens, kv_b, gate=gate.to(torch.int32))
    with pytest.raises(ValueError, match="gate must have a contiguous last dim"):
        mla.mla_prefill(q, cache, table, cu, lens, kv_b, gate=gate.transpose(0, 2).contiguous().transpose(0, 2))


def test_prefill_scale_argument() -> None:
    gen = seeded(7)
    latents = random_latents([40], gen)
    kv_b = random_kv_b(2, gen)
    q = torch.randn(9, 2, NOPE + ROPE, generator=gen)
    cache, table = build_paged(latents, 16, torch.float32, gen)
    out = mla.mla_prefill(q, cache, table, cu_from_counts([9]), torch.tensor([40], dtype=torch.int32), kv_b,
                          scale=0.05)
    assert_rel(out, expanded_attention(q, latents[0], kv_b, 0.05), 1e-5, name="out (scale=0.05)")


def test_prefill_nope_uses_pe_dims_unrotated() -> None:
    """With W_uk = 0 the scores are exactly scale * q_pe . k_pe (no position-dependent rotation anywhere)."""
    gen = seeded(11)
    length, n, num_heads = 50, 50, 2
    latents = random_latents([length], gen)
    kv_b = random_kv_b(num_heads, gen).view(num_heads, NOPE + VD, LORA)
    kv_b[:, :NOPE] = 0.0  # k_nope = 0
    kv_b = kv_b.reshape(num_heads * (NOPE + VD), LORA)
    q = torch.randn(n, num_heads, NOPE + ROPE, generator=gen)
    cache, table = build_paged(latents, 16, torch.float32, gen)
    out = mla.mla_prefill(q, cache, table, cu_from_counts([n]), torch.tensor([length], dtype=torch.int32), kv_b)
    k_pe = latents[0][:, LORA:].double()  # [L, 64], used as stored
    for h in range(num_heads):
        s = SCALE * q[:, h, NOPE:].double() @ k_pe.T  # [n, L]
        s = s + torch.full((n, length), float("-inf"), dtype=torch.float64).triu(diagonal=1)
        v = latents[0][:, :LORA].double() @ kv_b[h * (NOPE + VD) + NOPE:(h + 1) * (NOPE + VD)].double().T
        assert_rel(out[:, h], torch.softmax(s, dim=-1) @ v, 1e-5, name=f"head {h} out")


# ------------------------------------------------------------------------------------------------------------
# decode
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("block_size", [16, 64], ids=lambda b: f"bs{b}")
@pytest.mark.parametrize("num_heads", [1, 4], ids=lambda h: f"H{h}")
def test_decode_absorbed_matches_expanded(num_heads: int, block_size: int, dtype: torch.dtype) -> None:
    gen = seeded(2000 + block_size + num_heads)
    lengths = [1, 17, 64, 100, 130]
    latents = [lat.to(dtype) for lat in random_latents(lengths, gen)]
    kv_b = random_kv_b(num_heads, gen).to(dtype)
    q = torch.randn(len(lengths), num_heads, NOPE + ROPE, generator=gen).to(dtype)  # one new token per sequence
    w = kv_b.float().view(num_heads, NOPE + VD, LORA)
    w_uk, w_uv = w[:, :NOPE], w[:, NOPE:]  # [H, 128, 512] each
    q_latent = torch.einsum("nhd,hdc->nhc", q[..., :NOPE].float(), w_uk).to(dtype)  # absorb W_uk
    cache, table = build_paged(latents, block_size, dtype, gen)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    out_latent = mla.mla_decode(q_latent, q[..., NOPE:].contiguous(), cache, table, seq_lens, scale=SCALE)
    assert out_latent.shape == (len(lengths), num_heads, LORA) and out_latent.dtype == dtype
    out = torch.einsum("nhc,hvc->nhv", out_latent.float(), w_uv)  # apply W_uv: [N, H, 128]
    for i in range(len(lengths)):
        ref = expanded_attention(q[i:i + 1], latents[i], kv_b, SCALE)[0]  # the last position sees everything
        assert_rel(out[i], ref, TOL[dtype], name=f"seq{i} (L={lengths[i]}) out")


def test_decode_nope_uses_pe_dims_unrotated() -> None:
    """q_latent = 0: weights are softmax(scale * q_pe . k_pe), the output their mix of the stored c_kv."""
    gen = seeded(12)
    lengths, num_heads = [33, 70], 3
    latents = random_latents(lengths, gen)
    q_pe = torch.randn(2, num_heads, ROPE, generator=gen)
    cache, table = build_paged(latents, 16, torch.float32, gen)
    out = mla.mla_decode(torch.zeros(2, num_heads, LORA), q_pe, cache, table,
                         torch.tensor(lengths, dtype=torch.int32), scale=SCALE)
    for i, lat in enumerate(latents):
        a = torch.softmax(SCALE * q_pe[i].double() @ lat[:, LORA:].double().T, dim=-1)  # [H, L]
        assert_rel(out[i], a @ lat[:, :LORA].double(), 1e-5, name=f"seq{i} out_latent")


# ------------------------------------------------------------------------------------------------------------
# other latent geometries
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("geo", list(OTHER_GEOMETRIES), ids=str)
def test_any_geometry_prefill_and_decode(geo: str, dtype: torch.dtype) -> None:
    """Prefill (chunked, varlen) and absorbed decode at a non-released geometry against the dense formulation."""
    lora, rope, nope, vd = OTHER_GEOMETRIES[geo]
    gen = seeded(5000 + lora)
    num_heads, block_size = 3, 16
    seqs = [(57, 20), (9, 9), (33, 1)]  # (context after the step, new tokens)
    lengths, counts = [s[0] for s in seqs], [s[1] for s in seqs]
    latents = [lat.to(dtype) for lat in random_latents(lengths, gen, lora + rope)]
    kv_b = random_kv_b(num_heads, gen, lora, nope, vd).to(dtype)
    cache, table = build_paged(latents, block_size, dtype, gen)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    scale = (nope + rope) ** -0.5
    q = torch.randn(sum(counts), num_heads, nope + rope, generator=gen).to(dtype)
    cu = cu_from_counts(counts)
    out = mla.mla_prefill(q, cache, table, cu, seq_lens, kv_b)  # default scale (Dn + P)^-0.5
    assert out.shape == (sum(counts), num_heads, vd) and out.dtype == dtype
    for i in range(len(seqs)):
        q0, q1 = int(cu[i]), int(cu[i + 1])
        assert_rel(out[q0:q1], expanded_attention(q[q0:q1], latents[i], kv_b, scale), TOL[dtype], f"{geo} seq{i}")
    qd = torch.randn(len(lengths), num_heads, nope + rope, generator=gen).to(dtype)  # one new token each
    w = kv_b.float().view(num_heads, nope + vd, lora)
    q_latent = torch.einsum("nhd,hdc->nhc", qd[..., :nope].float(), w[:, :nope]).to(dtype)
    out_latent = mla.mla_decode(q_latent, qd[..., nope:].contiguous(), cache, table, seq_lens, scale=scale)
    assert out_latent.shape == (len(lengths), num_heads, lora)
    dec = torch.einsum("nhc,hvc->nhv", out_latent.float(), w[:, nope:])  # [N, H, Dv]
    for i in range(len(lengths)):
        ref = expanded_attention(qd[i:i + 1], latents[i], kv_b, scale)[0]
        assert_rel(dec[i], ref, TOL[dtype], f"{geo} decode seq{i}")


def test_any_geometry_write_cache() -> None:
    gen = seeded(6)
    cache = torch.full((3, 4, 40), float("nan"))
    latent = torch.randn(5, 40, generator=gen)
    mla.mla_write_cache(latent, cache, torch.tensor([0, 11, -1, 5, 2]))
    assert torch.equal(cache.view(-1, 40)[[0, 11, 5, 2]], latent[[0, 1, 3, 4]])


# ------------------------------------------------------------------------------------------------------------
# write_cache
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_write_cache_writes_slots_and_skips_minus_one(dtype: torch.dtype) -> None:
    gen = seeded(3)
    num_blocks, block_size, tokens = 6, 16, 12
    cache = torch.randn(num_blocks, block_size, LORA + ROPE, generator=gen).to(dtype)
    before = cache.clone()
    latent = torch.randn(tokens, LORA + ROPE, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[[2, 5, 11]] = -1
    mla.mla_write_cache(latent, cache, slots)
    expected = before.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // block_size, slot % block_size] = latent[t]
    assert torch.equal(cache, expected), "written slots must equal the latents and every other slot be untouched"


def test_write_cache_then_prefill_round_trip() -> None:
    """Latents written through slot_mapping (slot = block * block_size + offset) are read back by the block table."""
    gen = seeded(4)
    block_size, lengths, num_heads = 16, [45, 20], 2
    latents = random_latents(lengths, gen)
    _, table = build_paged(latents, block_size, torch.float32, gen)
    num_blocks = int(table.max()) + 1
    cache = torch.full((num_blocks, block_size, LORA + ROPE), float("nan"))
    slots = torch.cat([
        table[i, torch.arange(length) // block_size].long() * block_size + torch.arange(length) % block_size
        for i, length in enumerate(lengths)
    ])
    mla.mla_write_cache(torch.cat(latents), cache, slots)
    kv_b = random_kv_b(num_heads, gen)
    q = torch.randn(sum(lengths), num_heads, NOPE + ROPE, generator=gen)
    out = mla.mla_prefill(q, cache, table, cu_from_counts(lengths), torch.tensor(lengths, dtype=torch.int32), kv_b)
    assert_rel(out[:45], expanded_attention(q[:45], latents[0], kv_b, SCALE), 1e-5, name="seq0 out")
    assert_rel(out[45:], expanded_attention(q[45:], latents[1], kv_b, SCALE), 1e-5, name="seq1 out")


# ------------------------------------------------------------------------------------------------------------
# named errors
# ------------------------------------------------------------------------------------------------------------
def _decode_args(**over: object) -> dict[str, object]:
    args: dict[str, object] = dict(
        q_latent=torch.zeros(2, 2, LORA), q_pe=torch.zeros(2, 2, ROPE), kv_cache=torch.zeros(4, 16, LORA + ROPE),
        block_table=torch.zeros(2, 2, dtype=torch.int32), seq_lens=torch.tensor([5, 20], dtype=torch.int32),
        scale=SCALE,
    )
    args.update(over)
    return args


def _prefill_args(**over: object) -> dict[str, object]:
    args: dict[str, object] = dict(
        q=torch.zeros(7, 2, NOPE + ROPE), kv_cache=torch.zeros(4, 16, LORA + ROPE),
        block_table=torch.zeros(2, 2, dtype=torch.int32), cu_seqlens_q=cu_from_counts([3, 4]),
        seq_lens=torch.tensor([5, 20], dtype=torch.int32), kv_b_weight=torch.zeros(2 * (NOPE + VD), LORA),
    )
    args.update(over)
    return args


@pytest.mark.parametrize("over, exc, match", [
    (dict(kv_cache=torch.zeros(4, 16, 512)), ValueError, r"kv_cache must have shape \[num_blocks, block_size, 576\]"),
    (dict(q_latent=torch.zeros(2, 2, 256)), ValueError, r"kv_cache must have shape \[num_blocks, block_size, 320\] "
                                                        r"\(kv_lora_rank 256 of q_latent \+ rope 64 of q_pe\)"),
    (dict(q_pe=torch.zeros(2, 3, ROPE)), ValueError, r"q_pe must have shape"),
    (dict(q_pe=torch.zeros(2, 2, ROPE, dtype=torch.bfloat16)), TypeError, r"q_pe dtype torch.bfloat16 must match"),
    (dict(block_table=torch.zeros(2, 2, dtype=torch.int64)), TypeError, r"block_table must have dtype torch.int32"),
    (dict(seq_lens=torch.tensor([5], dtype=torch.int32)), ValueError, r"seq_lens must have shape \[N\]"),
    (dict(seq_lens=torch.tensor([5, 40], dtype=torch.int32)), ValueError, r"block_table too small: seq_lens\[1\] = 40"),
    (dict(seq_lens=torch.tensor([0, 5], dtype=torch.int32)), ValueError, r"seq_lens\[0\] must be >= 1"),
    (dict(block_table=torch.tensor([[0, 9], [1, 2]], dtype=torch.int32), seq_lens=torch.tensor([20, 5], dtype=torch.int32)),
     ValueError, r"block_table\[0, :2\] holds block ids outside \[0, 4\)"),
    (dict(scale=-1.0), ValueError, r"scale must be finite and > 0"),
    (dict(scale=None), TypeError, r"scale must be a float"),
    (dict(q_latent=torch.zeros(2, 2, LORA, dtype=torch.int32)), TypeError, r"q_latent must have dtype float32"),
], ids=["cache-last-dim", "q_latent-dim", "q_pe-heads", "q_pe-dtype", "table-dtype", "seq_lens-shape",
        "table-too-small", "empty-seq", "block-id-range", "neg-scale", "scale-none", "int-q"])
def test_decode_named_errors(over: dict[str, object], exc: type[Exception], match: str) -> None:
    args = _decode_args(**over)
    scale = args.pop("scale")
    with pytest.raises(exc, match=match):
        mla.mla_decode(*args.values(), scale=scale)


@pytest.mark.parametrize("over, exc, match", [
    (dict(q=torch.zeros(7, 2, 64)), ValueError, r"q must have shape \[T, H, qk_nope \+ 64\] with qk_nope >= 1 "
                                                r"\(rope 64 from kv_cache\), got \[7, 2, 64\]"),
    (dict(q=torch.zeros(7, 2)), ValueError, r"q must have shape \[T, H, qk_nope \+ rope\], got \[7, 2\]"),
    (dict(kv_cache=torch.zeros(4, 16, 512)), ValueError, r"kv_cache must have shape \[num_blocks, block_size, 512 "
                                                         r"\+ rope\] with rope >= 1"),
    (dict(kv_b_weight=torch.zeros(2 * 100, LORA)), ValueError, r"kv_b_weight must have shape \[H \* \(128 \+ "
                                                               r"v_head_dim\), 512\] with v_head_dim >= 1 for H = 2"),
    (dict(kv_b_weight=torch.zeros(3 * 171, LORA)), ValueError, r"kv_b_weight must have shape"),
    (dict(cu_seqlens_q=torch.tensor([0, 3, 7], dtype=torch.int64)), TypeError, r"cu_seqlens_q must have dtype torch.int32"),
    (dict(cu_seqlens_q=cu_from_counts([3, 3])), ValueError, r"end at T = 7"),
    (dict(cu_seqlens_q=cu_from_counts([6, 1])), ValueError, r"sequence 0 has 6 query tokens but seq_lens\[0\] = 5"),
    (dict(seq_lens=torch.tensor([5, 33], dtype=torch.int32)), ValueError, r"block_table too small"),
    (dict(kv_cache=torch.zeros(4, 16, 576, dtype=torch.bfloat16)), TypeError, r"kv_cache dtype .* must match q"),
    (dict(seq_lens=torch.tensor([5, 20], dtype=torch.int32, device="meta")), ValueError,
     r"seq_lens is on meta but q is on cpu"),
    (dict(scale="0.1"), TypeError, r"scale must be a float or None, got str"),
], ids=["q-dim", "q-2d", "cache-last-dim", "kv_b-rows", "kv_b-heads", "cu-dtype", "cu-total", "more-q-than-ctx", "table-too-small",
        "cache-dtype", "device-mismatch", "scale-str"])
def test_prefill_named_errors(over: dict[str, object], exc: type[Exception], match: str) -> None:
    args = _prefill_args(**over)
    scale = args.pop("scale", None)
    with pytest.raises(exc, match=match):
        mla.mla_prefill(*args.values(), scale=scale)


@pytest.mark.parametrize("latent, cache, slots, exc, match", [
    (torch.zeros(3, 576), torch.zeros(2, 16, 576), torch.tensor([0, 40, -1]), ValueError, r"slot_mapping values .* \[0, 32\)"),
    (torch.zeros(3, 576), torch.zeros(2, 16, 576), torch.tensor([0, -2, 1]), ValueError, r"slot_mapping values"),
    (torch.zeros(3, 576), torch.zeros(2, 16, 576), torch.tensor([0, 1, 2], dtype=torch.int32), TypeError,
     r"slot_mapping must have dtype torch.int64"),
    (torch.zeros(3, 576), torch.zeros(2, 16, 576), torch.tensor([0, 1]), ValueError, r"slot_mapping must have shape \[T\]"),
    (torch.zeros(3, 512), torch.zeros(2, 16, 576), torch.tensor([0, 1, 2]), ValueError, r"latent must have shape \[T, 576\]"),
    (torch.zeros(3, 576), torch.zeros(2, 16, 64), torch.tensor([0, 1, 2]), ValueError,
     r"latent must have shape \[T, 64\] to match kv_cache \[num_blocks, block_size, 64\]"),
    (torch.zeros(3, 576), torch.zeros(32, 576), torch.tensor([0, 1, 2]), ValueError, r"kv_cache must have shape"),
    (torch.zeros(3, 576, dtype=torch.bfloat16), torch.zeros(2, 16, 576), torch.tensor([0, 1, 2]), TypeError,
     r"latent dtype torch.bfloat16 must match kv_cache dtype torch.float32"),
    (torch.zeros(3, 576), torch.zeros(16, 2, 576).transpose(0, 1), torch.tensor([0, 1, 2]), ValueError,
     r"kv_cache must be contiguous"),
], ids=["slot-too-big", "slot-below-minus-one", "slot-dtype", "slot-shape", "latent-dim", "cache-last-dim", "cache-2d",
        "dtype-mismatch", "non-contiguous"])
def test_write_cache_named_errors(latent: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                                  exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        mla.mla_write_cache(latent, cache, slots)
