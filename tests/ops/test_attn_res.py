"""AttnRes ops (reference backend) against a direct fp64 formulation written here (torch.stack + softmax).

Unused bank rows are poisoned with NaN, so reading past ``num_blocks`` fails every comparison.
Tolerances (relative, per output tensor): fp32 1e-5 (fp32 vs fp64 math; measured <= 6e-7); bf16 1e-2 (outputs
rounded to bf16, ~2^-9 per element; measured <= 1.7e-3). The multi-layer dataflow test runs the pseudo-code of
K3_SPEC section 5 with the same rounding points as the fused sequence, under the same tolerances.
"""

from __future__ import annotations

import pytest
import torch

from rocm_k3.ops import attn_res
from tests.helpers import assert_rel, seeded

EPS = 1e-5
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16"}
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


# ------------------------------------------------------------------------------------------------------------
# the independent formulation
# ------------------------------------------------------------------------------------------------------------
def direct_mix(sources: list[torch.Tensor], proj_w: torch.Tensor, norm_w: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """K3_SPEC section 5 ``mix`` in fp64: softmax over the stacked sources of <norm_w*proj_w, V_i>/rms(V_i)."""
    v = torch.stack(sources).double()  # [S, T, Hd]
    direction = (norm_w.double() * proj_w.double())  # [Hd]
    logits = (v * direction).sum(-1) / torch.sqrt(v.pow(2).mean(-1) + eps)  # [S, T]
    a = torch.softmax(logits, dim=0)  # [S, T]
    return (a.unsqueeze(-1) * v).sum(0)  # [T, Hd]


def direct_rms(x: torch.Tensor, w: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN poison included)."""
    return a.dtype == b.dtype and torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


def make_bank(b_max: int, filled: int, tokens: int, hidden: int, dtype: torch.dtype,
              gen: torch.Generator) -> torch.Tensor:
    """[b_max, T, Hd]: rows < filled random with per-row magnitudes (so the rsqrt matters), the rest NaN."""
    bank = torch.full((b_max, tokens, hidden), float("nan"), dtype=dtype)
    for i in range(filled):
        bank[i] = (torch.randn(tokens, hidden, generator=gen) * (0.5 + 2.0 * torch.rand(1, generator=gen))).to(dtype)
    return bank


def mix_weights(hidden: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """proj_w [Hd] with logits of order 1, norm_w [Hd] around 1."""
    proj = torch.randn(hidden, generator=gen) * hidden**-0.5 * 2.0
    norm = 1.0 + 0.3 * torch.randn(hidden, generator=gen)
    return proj, norm


# ------------------------------------------------------------------------------------------------------------
# attn_res_mix
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("num_blocks", [1, 3, 8], ids=lambda n: f"nb{n}")
@pytest.mark.parametrize("tokens, hidden", [(5, 64), (33, 256)], ids=lambda v: str(v))
def test_mix_matches_stacked_softmax(tokens: int, hidden: int, num_blocks: int, dtype: torch.dtype) -> None:
    gen = seeded(100 + num_blocks + hidden)
    bank = make_bank(9, num_blocks, tokens, hidden, dtype, gen)
    partial = torch.randn(tokens, hidden, generator=gen).to(dtype)
    proj, norm = mix_weights(hidden, gen)
    out = attn_res.attn_res_mix(partial, bank, num_blocks, proj, norm)
    assert out.dtype == dtype and out.shape == (tokens, hidden)
    ref = direct_mix([*bank[:num_blocks], partial], proj, norm)
    assert_rel(out, ref, TOL[dtype], name="mix out")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_mix_single_source_returns_partial_exactly(dtype: torch.dtype) -> None:
    gen = seeded(5)
    partial = torch.randn(7, 96, generator=gen).to(dtype)
    bank = make_bank(4, 0, 7, 96, dtype, gen)  # all NaN: must not be read
    proj, norm = mix_weights(96, gen)
    out = attn_res.attn_res_mix(partial, bank, 0, proj, norm)
    assert bit_equal(out, partial)


def test_mix_eps_argument() -> None:
    gen = seeded(6)
    bank = make_bank(3, 2, 4, 32, torch.float32, gen)
    partial = torch.randn(4, 32, generator=gen) * 0.01  # small rms: eps matters
    proj, norm = mix_weights(32, gen)
    out = attn_res.attn_res_mix(partial, bank, 2, proj, norm, 1e-2)
    assert_rel(out, direct_mix([*bank[:2], partial], proj, norm, eps=1e-2), 1e-5, name="mix out (eps=1e-2)")


# ------------------------------------------------------------------------------------------------------------
# attn_res_step
# ------------------------------------------------------------------------------------------------------------
STEP_CASES = {  # (partial given, delta given, write_block)
    "p+d": (True, True, False),
    "p+d-write": (True, True, True),
    "p-only-write": (True, False, True),
    "d-only": (False, True, False),
    "d-only-write": (False, True, True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", list(STEP_CASES), ids=str)
def test_step_is_add_mix_write_rmsnorm(case: str, dtype: torch.dtype) -> None:
    has_p, has_d, write = STEP_CASES[case]
    gen = seeded(200 + len(case))
    tokens, hidden, b_max, num_blocks = 11, 128, 5, 3
    bank = make_bank(b_max, num_blocks, tokens, hidden, dtype, gen)
    bank_before = bank.clone()
    partial = torch.randn(tokens, hidden, generator=gen).to(dtype) if has_p else None
    delta = (0.5 * torch.randn(tokens, hidden, generator=gen)).to(dtype) if has_d else None
    proj, norm = mix_weights(hidden, gen)
    rms_w = 1.0 + 0.2 * torch.randn(hidden, generator=gen)
    out = attn_res.attn_res_step(partial, delta, bank, num_blocks, write_block=write, proj_weight=proj,
                                 norm_weight=norm, rms_weight=rms_w)

    terms = [t.double() for t in (partial, delta) if t is not None]
    p_ref = sum(terms[1:], terms[0]).to(dtype)  # exact sum, rounded once
    assert bit_equal(out.partial, p_ref), "p must be the fp32 sum rounded to the activation dtype"
    x_ref = direct_mix([*bank_before[:num_blocks], p_ref], proj, norm).to(dtype)  # mix output in activation dtype
    assert out.normed.dtype == dtype
    assert_rel(out.normed, direct_rms(x_ref, rms_w), TOL[dtype], name="normed")

    untouched = [i for i in range(b_max) if not (write and i == num_blocks)]
    assert bit_equal(bank[untouched], bank_before[untouched]), "bank rows other than the written one changed"
    if write:
        assert bit_equal(bank[num_blocks], p_ref), "blocks[num_blocks] must hold p after a block write"


def test_step_write_into_last_free_row() -> None:
    gen = seeded(9)
    bank = make_bank(3, 2, 4, 32, torch.bfloat16, gen)
    delta = torch.randn(4, 32, generator=gen).to(torch.bfloat16)
    proj, norm = mix_weights(32, gen)
    out = attn_res.attn_res_step(None, delta, bank, 2, write_block=True, proj_weight=proj, norm_weight=norm,
                                 rms_weight=torch.ones(32))
    assert bit_equal(bank[2], out.partial) and bit_equal(out.partial, delta)


# ------------------------------------------------------------------------------------------------------------
# multi-layer dataflow (K3_SPEC section 5) with block size 2 and 6 layers
# ------------------------------------------------------------------------------------------------------------
class ToyStack:
    """Per-layer parameters and toy sublayers (tanh(x W)) shared by both formulations."""

    def __init__(self, layers: int, hidden: int, gen: torch.Generator) -> None:
        def mixp() -> tuple[torch.Tensor, torch.Tensor]:
            return mix_weights(hidden, gen)

        def vec() -> torch.Tensor:
            return 1.0 + 0.2 * torch.randn(hidden, generator=gen)

        def mat() -> torch.Tensor:
            return torch.randn(hidden, hidden, generator=gen) * hidden**-0.5

        self.attn_res = [mixp() for _ in range(layers)]
        self.mlp_res = [mixp() for _ in range(layers)]
        self.out_res = mixp()
        self.w_in = [vec() for _ in range(layers)]
        self.w_post = [vec() for _ in range(layers)]
        self.w_final = vec()
        self.w_attn = [mat() for _ in range(layers)]
        self.w_mlp = [mat() for _ in range(layers)]

    @staticmethod
    def sublayer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x.float() @ w).to(x.dtype)


def direct_forward(emb: torch.Tensor, stack: ToyStack, layers: int, block: int) -> tuple[torch.Tensor, list]:
    """The pseudo-code of K3_SPEC section 5, verbatim, with mixes/norms in fp64 rounded to the activation dtype."""
    dtype = emb.dtype

    def mix(p: torch.Tensor, blocks: list[torch.Tensor], params: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return direct_mix([*blocks, p], *params).to(dtype)

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return direct_rms(x, w).to(dtype)

    def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a.double() + b.double()).to(dtype)

    blocks: list[torch.Tensor] = []
    p: torch.Tensor | None = emb
    for layer in range(layers):
        x = mix(p, blocks[: -(-layer // block)], stack.attn_res[layer])  # layer 0: x = p
        if layer % block == 0:
            blocks.append(p)
            p = None
        a = stack.sublayer(rms(x, stack.w_in[layer]), stack.w_attn[layer])
        p = a if p is None else add(p, a)
        x = mix(p, blocks, stack.mlp_res[layer])
        p = add(p, stack.sublayer(rms(x, stack.w_post[layer]), stack.w_mlp[layer]))
    h = mix(p, blocks, stack.out_res)
    return rms(h, stack.w_final), blocks


def fused_forward(emb: torch.Tensor, stack: ToyStack, layers: int, block: int, b_max: int) -> tuple[torch.Tensor,
                                                                                                     torch.Tensor, int]:
    """The same stack as a sequence of attn_res_step calls (what the model does)."""
    bank = torch.full((b_max, *emb.shape), float("nan"), dtype=emb.dtype)
    num_blocks = 0
    partial: torch.Tensor | None = emb
    delta: torch.Tensor | None = None
    for layer in range(layers):
        write = layer % block == 0
        proj, norm = stack.attn_res[layer]
        step = attn_res.attn_res_step(partial, delta, bank, num_blocks, write_block=write, proj_weight=proj,
                                      norm_weight=norm, rms_weight=stack.w_in[layer])
        partial = step.partial
        if write:
            num_blocks, partial = num_blocks + 1, None
        delta = stack.sublayer(step.normed, stack.w_attn[layer])
        proj, norm = stack.mlp_res[layer]
        step = attn_res.attn_res_step(partial, delta, bank, num_blocks, write_block=False, proj_weight=proj,
                                      norm_weight=norm, rms_weight=stack.w_post[layer])
        partial, delta = step.partial, stack.sublayer(step.normed, stack.w_mlp[layer])
    proj, norm = stack.out_res
    step = attn_res.attn_res_step(partial, delta, bank, num_blocks, write_block=False, proj_weight=proj,
                                  norm_weight=norm, rms_weight=stack.w_final)
    return step.normed, bank, num_blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_multilayer_dataflow_B2_L6(dtype: torch.dtype) -> None:
    layers, block, tokens, hidden = 6, 2, 9, 64
    gen = seeded(77)
    stack = ToyStack(layers, hidden, gen)
    emb = torch.randn(tokens, hidden, generator=gen).to(dtype)
    ref, ref_blocks = direct_forward(emb, stack, layers, block)
    out, bank, num_blocks = fused_forward(emb, stack, layers, block, b_max=4)
    assert num_blocks == len(ref_blocks) == 3  # snapshots at layers 0 (the embedding), 2 and 4
    assert bit_equal(bank[0], emb), "block 0 must be the token embedding"
    for i in range(1, num_blocks):
        assert_rel(bank[i], ref_blocks[i], TOL[dtype], name=f"block {i}")
    assert torch.isnan(bank[num_blocks:].float()).all(), "rows past the last snapshot must stay untouched"
    assert_rel(out, ref, TOL[dtype], name="final normed")


# ------------------------------------------------------------------------------------------------------------
# named errors
# ------------------------------------------------------------------------------------------------------------
def _mix_args(**over: object) -> dict[str, object]:
    args: dict[str, object] = dict(partial=torch.zeros(4, 8), blocks=torch.zeros(3, 4, 8), num_blocks=2,
                                   proj_weight=torch.ones(8), norm_weight=torch.ones(8))
    args.update(over)
    return args


@pytest.mark.parametrize("over, exc, match", [
    (dict(partial=torch.zeros(2, 4, 8)), ValueError, r"partial must have shape \[T, Hd\], got \[2, 4, 8\]"),
    (dict(partial=torch.zeros(4, 8, dtype=torch.int32)), TypeError, r"partial must have dtype float32"),
    (dict(blocks=torch.zeros(3, 5, 8)), ValueError, r"blocks must have shape \[B_max, T, Hd\] = \[B_max, 4, 8\]"),
    (dict(blocks=torch.zeros(3, 4, 8, dtype=torch.bfloat16)), TypeError, r"blocks dtype torch.bfloat16 must match"),
    (dict(num_blocks=4), ValueError, r"num_blocks must be in \[0, B_max = 3\], got 4"),
    (dict(num_blocks=-1), ValueError, r"num_blocks must be in \[0, B_max = 3\], got -1"),
    (dict(num_blocks=1.0), TypeError, r"num_blocks must be an int"),
    (dict(proj_weight=torch.ones(9)), ValueError, r"proj_weight must have shape \[Hd\] = \[8\], got \[9\]"),
    (dict(norm_weight=torch.ones(8, dtype=torch.int64)), TypeError, r"norm_weight must have dtype"),
    (dict(blocks=torch.zeros(3, 4, 8, device="meta")), ValueError, r"blocks is on meta but partial is on cpu"),
    (dict(partial=[[0.0] * 8] * 4), TypeError, r"partial must be a torch.Tensor, got list"),
], ids=["partial-3d", "partial-int", "blocks-shape", "blocks-dtype", "nb-too-big", "nb-negative", "nb-float",
        "proj-shape", "norm-dtype", "device-mismatch", "partial-list"])
def test_mix_named_errors(over: dict[str, object], exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        attn_res.attn_res_mix(*_mix_args(**over).values())


def _step(partial: object = None, delta: object = None, blocks: object = None, num_blocks: object = 1,
          write_block: object = False, rms_weight: object = None, eps: object = EPS) -> None:
    attn_res.attn_res_step(partial, delta, torch.zeros(3, 4, 8) if blocks is None else blocks, num_blocks,
                           write_block=write_block, proj_weight=torch.ones(8), norm_weight=torch.ones(8),
                           rms_weight=torch.ones(8) if rms_weight is None else rms_weight, eps=eps)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(num_blocks=3, write_block=True, delta=torch.zeros(4, 8)), ValueError, r"bank full"),
    (dict(), ValueError, r"needs partial or delta"),
    (dict(partial=torch.zeros(4, 8), delta=torch.zeros(4, 7)), ValueError, r"delta must have the shape of partial"),
    (dict(partial=torch.zeros(4, 8), delta=torch.zeros(4, 8, dtype=torch.bfloat16)), TypeError,
     r"delta dtype torch.bfloat16 must match partial dtype torch.float32"),
    (dict(delta=torch.zeros(4, 8), rms_weight=torch.ones(4)), ValueError, r"rms_weight must have shape \[Hd\] = \[8\]"),
    (dict(delta=torch.zeros(4, 8), write_block=1), TypeError, r"write_block must be a bool"),
    (dict(delta=torch.zeros(4, 8), eps=0.0), ValueError, r"eps must be finite and > 0"),
    (dict(delta=torch.zeros(4, 8), blocks=torch.zeros(3, 4, 8, dtype=torch.float16)), TypeError,
     r"blocks dtype torch.float16 must match delta dtype torch.float32"),
], ids=["bank-full", "both-none", "delta-shape", "delta-dtype", "rms-shape", "write-not-bool", "eps-zero",
        "blocks-dtype"])
def test_step_named_errors(kwargs: dict[str, object], exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        _step(**kwargs)
