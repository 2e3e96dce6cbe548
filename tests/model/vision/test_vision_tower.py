"""The K3 tower + projector against an independent formulation written here, and each K3-vs-K2.5 difference.

The formulation below reads the raw ``vision_config`` and the checkpoint-named tensors and computes, in fp64:
the patch conv with ``F.conv2d``; the position table by explicit bilinear / bicubic (Keys, a = -0.75) sampling
loops over output positions; 2-D RoPE by building each token's block-diagonal rotation matrix (pair p turns by
``x * f_{p//2}`` when p is even, ``y * f_{p//2}`` when odd); attention one image, one head, one query at a time;
RMSNorm / LayerNorm / GELU written out; the 2x2 merge by index loops; the projector per its type.

Variants (one field flipped from the tiny K3 config each): norm type, biases, qkv width = hidden, projector type
(merger v1 pre-norm vs v2 post-norm), interpolation mode; plus the whole K2.5 combination. Tolerance 1e-5 relative
in fp32 against fp64 (measured 4.6e-7 to 5.1e-7 over the variants, 2026-12-01). A second test checks that each
flip changes the output (none is a no-op).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from rocm_k3.model.vision.config import K3_VISION_CONFIG, VisionConfig, VisionConfigError, UnsupportedVisionError
from rocm_k3.model.vision.data_parallel import gather_in_order, select_images, split_images
from rocm_k3.model.vision.model import VisionModel
from rocm_k3.model.vision.tower import VisionInputError
from tests.helpers import rel_err, seeded
from tests.vision_fixtures import random_vision_tensors

TEXT = 40
BASE = {**K3_VISION_CONFIG, "vt_hidden_size": 32, "vt_intermediate_size": 48, "vt_num_hidden_layers": 2,
        "vt_num_attention_heads": 2, "qkv_hidden_size": 48, "init_pos_emb_height": 6, "init_pos_emb_width": 8,
        "mm_hidden_size": 32, "text_hidden_size": TEXT}
VARIANTS = {
    "k3": {},
    "layernorm": {"norm_type": "layernorm"},
    "biases": {"attn_bias": True, "linear_bias": True, "patch_embed_proj_bias": True},
    "qkv-eq-hidden": {"qkv_hidden_size": 32},
    "patchmerger-v1": {"mm_projector_type": "patchmerger"},
    "bicubic": {"pos_emb_interpolation_mode": "bicubic"},
    "k2.5": {"norm_type": "layernorm", "attn_bias": True, "linear_bias": True, "patch_embed_proj_bias": True,
             "qkv_hidden_size": 32, "mm_projector_type": "patchmerger", "pos_emb_interpolation_mode": "bicubic"},
}
GRIDS = [(1, 4, 6), (1, 2, 2), (1, 6, 8), (1, 10, 4)]  # table 6 x 8: down-, up-sampled, as is, mixed


# ------------------------------------------------------------------------------ the independent formulation
def _norm(x: torch.Tensor, w: dict, prefix: str, raw: dict, eps: float) -> torch.Tensor:
    if raw.get("norm_type", "layernorm") == "rmsnorm":
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w[prefix + ".weight"]
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w[prefix + ".weight"] + w[prefix + ".bias"]


def _lin(x: torch.Tensor, w: dict, prefix: str) -> torch.Tensor:
    y = x @ w[prefix + ".weight"].T
    return y + w[prefix + ".bias"] if prefix + ".bias" in w else y


def _taps(out_i: int, out_n: int, in_n: int, mode: str) -> list[tuple[int, float]]:
    """(source index, weight) of PyTorch's align_corners=False resampling along one axis, border-clamped."""
    src = (out_i + 0.5) * in_n / out_n - 0.5
    if mode == "bilinear":
        src = max(src, 0.0)
        i0 = int(math.floor(src))
        i1 = min(i0 + 1, in_n - 1)
        f = src - i0
        return [(i0, 1 - f), (i1, f)]
    a = -0.75
    i0 = math.floor(src)
    t = src - i0

    def cubic(d: float) -> float:
        d = abs(d)
        if d <= 1:
            return (a + 2) * d ** 3 - (a + 3) * d ** 2 + 1
        return a * d ** 3 - 5 * a * d ** 2 + 8 * a * d - 4 * a if d < 2 else 0.0

    return [(min(max(i0 + k, 0), in_n - 1), cubic(t - k)) for k in (-1, 0, 1, 2)]


def _table(table: torch.Tensor, h: int, w: int, mode: str) -> torch.Tensor:
    out = torch.zeros(h * w, table.shape[-1], dtype=table.dtype)
    for r in range(h):
        for c in range(w):
            for ri, wr in _taps(r, h, table.shape[0], mode):
                for ci, wc in _taps(c, w, table.shape[1], mode):
                    out[r * w + c] += wr * wc * table[ri, ci]
    return out


def _rotation(r: int, c: int, head_dim: int, theta: float) -> torch.Tensor:
    rot = torch.zeros(head_dim, head_dim, dtype=torch.float64)
    for p in range(head_dim // 2):
        f = 1.0 / theta ** (4 * (p // 2) / head_dim)
        a = (c if p % 2 == 0 else r) * f  # x = column on even pairs, y = row on odd pairs
        rot[2 * p:2 * p + 2, 2 * p:2 * p + 2] = torch.tensor([[math.cos(a), -math.sin(a)],
                                                             [math.sin(a), math.cos(a)]], dtype=torch.float64)
    return rot


def naive_vision(raw: dict, tensors: dict, pixels: torch.Tensor, grids: list) -> list[torch.Tensor]:
    w = {k: v.double() for k, v in tensors.items()}
    d, heads = raw["vt_hidden_size"], raw["vt_num_attention_heads"]
    q_width = raw.get("qkv_hidden_size", d)
    hd = q_width // heads
    eps = raw.get("norm_eps") or (1e-5 if raw.get("norm_type", "layernorm") == "layernorm"
                                  else torch.finfo(torch.float32).eps)  # the model runs fp32 here
    mode = raw.get("pos_emb_interpolation_mode", "bicubic")
    outputs, start = [], 0
    for _, h, wd in grids:
        n = h * wd
        x = F.conv2d(pixels[start:start + n].double(), w["vision_tower.patch_embed.proj.weight"],
                     w.get("vision_tower.patch_embed.proj.bias"), stride=raw["patch_size"]).reshape(n, d)
        start += n
        x = x + _table(w["vision_tower.patch_embed.pos_emb.weight"], h, wd, mode)
        rots = [_rotation(t // wd, t % wd, hd, 10000.0) for t in range(n)]
        for i in range(raw["vt_num_hidden_layers"]):
            b = f"vision_tower.encoder.blocks.{i}."
            qkv = _lin(_norm(x, w, b + "norm0", raw, eps), w, b + "wqkv")
            q, k, v = (qkv[:, j * q_width:(j + 1) * q_width].reshape(n, heads, hd) for j in range(3))
            q = torch.stack([torch.stack([rots[t] @ q[t, hh] for hh in range(heads)]) for t in range(n)])
            k = torch.stack([torch.stack([rots[t] @ k[t, hh] for hh in range(heads)]) for t in range(n)])
            attn = torch.zeros(n, heads, hd, dtype=torch.float64)
            for hh in range(heads):
                for t in range(n):
                    p = torch.softmax(k[:, hh] @ q[t, hh] / math.sqrt(hd), dim=0)
                    attn[t, hh] = p @ v[:, hh]
            x = x + _lin(attn.reshape(n, q_width), w, b + "wo")
            y = _lin(_norm(x, w, b + "norm1", raw, eps), w, b + "mlp.fc0")
            y = 0.5 * y * (1 + torch.tanh(math.sqrt(2 / math.pi) * (y + 0.044715 * y ** 3)))
            x = x + _lin(y, w, b + "mlp.fc1")
        x = _norm(x, w, "vision_tower.encoder.final_layernorm", raw, eps)
        merged = torch.stack([torch.stack([x[(2 * r + i) * wd + 2 * c + j] for i in range(2) for j in range(2)])
                              for r in range(h // 2) for c in range(wd // 2)])  # [n/4, 4, d]
        if raw.get("mm_projector_type", "patchmerger") == "patchmerger":
            merged = _norm_ln(merged, w, "mm_projector.pre_norm", raw["projector_ln_eps"])
        y = _lin(merged.reshape(merged.shape[0], 4 * d), w, "mm_projector.proj.0")
        y = 0.5 * y * (1 + torch.erf(y / math.sqrt(2)))
        y = _lin(y, w, "mm_projector.proj.2")
        if raw.get("mm_projector_type") == "patchmergerv2":
            rms = torch.sqrt((y * y).mean(-1, keepdim=True) + raw["projector_ln_eps"])
            y = y / rms * w["mm_projector.post_norm.weight"]
        outputs.append(y)
    return outputs


def _norm_ln(x: torch.Tensor, w: dict, prefix: str, eps: float) -> torch.Tensor:
    return _norm(x, w, prefix, {"norm_type": "layernorm"}, eps)


# ------------------------------------------------------------------------------------------------------ tests
def _model(raw: dict, tensors: dict, backend: str | None = "reference") -> VisionModel:
    model = VisionModel(VisionConfig.from_hf_dict(raw), backend=backend, dtype=torch.float32)
    model.load_state_dict(tensors, strict=True)
    return model.eval()


def _pixels(grids: list, seed: int) -> torch.Tensor:
    return torch.randn(sum(t * h * w for t, h, w in grids), 3, 14, 14, generator=seeded(seed))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_independent_formulation(variant: str) -> None:
    raw = {**BASE, **VARIANTS[variant]}
    tensors = random_vision_tensors(raw, seed=3)
    pixels = _pixels(GRIDS, seed=4)
    with torch.no_grad():
        ours = _model(raw, tensors)(pixels, GRIDS)
    ref = naive_vision(raw, tensors, pixels, GRIDS)
    assert [o.shape for o in ours] == [r.shape for r in ref] == [(h * w // 4, TEXT) for _, h, w in GRIDS]
    err = rel_err(torch.cat(ours), torch.cat(ref))
    print(f"{variant} vs the independent formulation: {err:.2e}")
    assert err <= 1e-5, f"{variant}: relative error {err:.3e}"


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "k3"])
def test_each_difference_changes_the_output(variant: str) -> None:
    """Flipping K3 fields to K2.5 on shared weights moves the output: each field drives a real path (the
    tensors both configs have in the same shape are shared; the rest come from the K3 draw)."""
    raw = {**BASE, **VARIANTS[variant]}
    tensors = random_vision_tensors(raw, seed=3)
    k3_tensors = random_vision_tensors(BASE, seed=3)
    shared = {k: tensors[k] if k in tensors and tensors[k].shape == v.shape else v for k, v in k3_tensors.items()}
    pixels = _pixels(GRIDS, 4)
    with torch.no_grad():
        flipped = torch.cat(_model(raw, tensors)(pixels, GRIDS))
        k3 = torch.cat(_model(BASE, shared)(pixels, GRIDS))
    assert rel_err(flipped, k3) > 1e-3, f"{variant} did not change the output"


def test_images_are_independent_and_order_is_kept() -> None:
    raw = dict(BASE)
    model = _model(raw, random_vision_tensors(raw, seed=5))
    pixels = _pixels(GRIDS, seed=6)
    with torch.no_grad():
        together = model(pixels, GRIDS)
        alone = [model(*select_images(pixels, GRIDS, [i]))[0] for i in range(len(GRIDS))]
    for a, b in zip(together, alone):
        assert rel_err(a, b) <= 1e-6


def test_bf16_close_to_fp32() -> None:
    raw = dict(BASE)
    tensors = random_vision_tensors(raw, seed=7)
    pixels = _pixels(GRIDS, seed=8)
    fp32 = _model(raw, tensors)
    bf16 = VisionModel(VisionConfig.from_hf_dict(raw), backend="reference", dtype=torch.bfloat16)
    bf16.load_state_dict({k: v.bfloat16() for k, v in tensors.items()})
    with torch.no_grad():
        err = rel_err(torch.cat(bf16(pixels, GRIDS)).float(), torch.cat(fp32(pixels, GRIDS)))
    assert err <= 5e-2, f"bf16 tower: relative error {err:.3e}"  # bf16 weights and activations through 2 blocks


def test_rmsnorm_eps_is_the_activation_dtype_eps() -> None:
    cfg = VisionConfig.from_hf_dict(BASE)
    assert cfg.norm_eps is None
    norm = VisionModel(cfg, dtype=torch.float32).vision_tower.encoder.final_layernorm
    assert norm.resolved_eps(torch.bfloat16) == 2 ** -7 and norm.resolved_eps(torch.float32) == 2 ** -23
    assert VisionConfig.from_hf_dict({**BASE, "norm_eps": 1e-6}).norm_eps == 1e-6
    assert VisionConfig.from_hf_dict({**BASE, "norm_type": "layernorm"}).norm_eps == 1e-5


def test_input_errors() -> None:
    model = _model(BASE, random_vision_tensors(BASE, seed=9))
    with pytest.raises(VisionInputError, match="rocm-k3 serves images"):
        model(_pixels([(2, 2, 2)], 0), [(2, 2, 2)])
    with pytest.raises(VisionInputError, match="multiples of the merge kernel"):
        model(_pixels([(1, 3, 2)], 0), [(1, 3, 2)])
    with pytest.raises(VisionInputError, match=r"pixel_values must have shape \[sum\(t\*h\*w\), 3, 14, 14\]"):
        model(_pixels([(1, 2, 2)], 0), [(1, 2, 4)])
    with pytest.raises(ValueError, match="exceeds the RoPE table"):
        model(torch.zeros(2 * 514, 3, 14, 14), [(1, 2, 514)])
    assert model(torch.zeros(0, 3, 14, 14), []) == []


@pytest.mark.parametrize("change,error,match", [
    ({"norm_type": "batchnorm"}, UnsupportedVisionError, "norm_type"),
    ({"mm_projector_type": "mlp"}, UnsupportedVisionError, "mm_projector_type"),
    ({"merge_type": "sd3"}, UnsupportedVisionError, "merge_type"),
    ({"pos_emb_type": "rope"}, UnsupportedVisionError, "pos_emb_type"),
    ({"qkv_hidden_size": 51}, VisionConfigError, "not divisible"),
    ({"qkv_hidden_size": 44}, VisionConfigError, "multiple of 4"),
    ({"vt_hidden_size": 0}, VisionConfigError, "hidden_size"),
    ({"attn_bias": "yes"}, VisionConfigError, "attn_bias"),
    ({"mm_hidden_size": 64}, VisionConfigError, "mm_hidden_size"),
    ({"pos_emb_interpolation_mode": "nearest"}, UnsupportedVisionError, "interpolation"),
    ({"merge_kernel_size": [2]}, VisionConfigError, "merge_kernel_size"),
], ids=lambda v: str(v)[:30])
def test_config_errors(change: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        VisionConfig.from_hf_dict({**BASE, **change})


def test_config_text_hidden_size_checks() -> None:
    raw = {k: v for k, v in BASE.items() if k != "text_hidden_size"}
    with pytest.raises(VisionConfigError, match="text_hidden_size"):
        VisionConfig.from_hf_dict(raw)
    assert VisionConfig.from_hf_dict(raw, text_hidden_size=64).text_hidden_size == 64
    with pytest.raises(VisionConfigError, match="disagrees"):
        VisionConfig.from_hf_dict(BASE, text_hidden_size=64)
    full = VisionConfig.from_hf_dict(K3_VISION_CONFIG)
    assert (full.head_dim, full.merged_hidden_size, full.text_hidden_size) == (128, 4096, 7168)


# -------------------------------------------------------------------------------- encoder data parallelism (CPU)
def test_split_images_balances_patches() -> None:
    counts = [4096, 140, 1536, 4, 900, 900, 64, 2000]
    for world in (1, 2, 3, 8, 12):
        split = split_images(counts, world)
        assert sorted(i for r in split.ranks for i in r) == list(range(len(counts)))
        assert split.loads == [sum(counts[i] for i in r) for r in split.ranks]
        assert max(split.loads) <= max(sum(counts) / world + max(counts), max(counts))  # LPT bound
        assert split == split_images(counts, world)  # every rank computes the same split
    # largest first onto the least-loaded rank: 4096 | 2000 + 1536 + 900 = 4436, then 900 -> rank 0, rest -> rank 1
    assert split_images(counts, 2).ranks == [[0, 5], [1, 2, 3, 4, 6, 7]]
    assert split_images(counts, 2).loads == [4996, 4644]
    assert split_images([], 4).ranks == [[], [], [], []]
    with pytest.raises(ValueError, match="world_size"):
        split_images(counts, 0)
    with pytest.raises(ValueError, match="patch_counts"):
        split_images([3, -1], 2)


def test_split_run_gather_equals_one_run() -> None:
    """Each 'rank' runs its images alone; gathered in order they equal the single-process forward."""
    grids = GRIDS + [(1, 2, 6), (1, 4, 4)]
    model = _model(BASE, random_vision_tensors(BASE, seed=10))
    pixels = _pixels(grids, seed=11)
    split = split_images([t * h * w for t, h, w in grids], 3)
    with torch.no_grad():
        per_rank = [model(*select_images(pixels, grids, idx)) if idx else [] for idx in split.ranks]
        whole = model(pixels, grids)
    gathered = gather_in_order(split, per_rank)
    assert len(gathered) == len(whole)
    for a, b in zip(gathered, whole):
        assert rel_err(a, b) <= 1e-6
    with pytest.raises(ValueError, match="returned"):
        gather_in_order(split, [per_rank[0][:-1], *per_rank[1:]])
    with pytest.raises(ValueError, match="patches but grid_thws"):
        select_images(pixels[:-1], grids, [0])


# ----------------------------------------------------------------------------------------------------- cuda tier
@pytest.mark.cuda
def test_k3_width_tower_triton_vs_reference_cuda() -> None:
    """K3 widths (1024 stream, 12 x 128 heads, 4096 MLP, 7168 projector) with 2 blocks, bf16, random weights:
    the Triton attention against the reference backend on the GPU, images of 4 to 2304 patches; 2e-2."""
    raw = {**K3_VISION_CONFIG, "vt_num_hidden_layers": 2}
    tensors = {k: v.to("cuda", torch.bfloat16) for k, v in random_vision_tensors(raw, seed=12).items()}
    cfg = VisionConfig.from_hf_dict(raw)
    grids = [(1, 2, 2), (1, 48, 48), (1, 20, 34), (1, 64, 8)]
    pixels = _pixels(grids, seed=13).to("cuda", torch.bfloat16)
    outs = {}
    for backend in ("reference", "triton"):
        model = VisionModel(cfg, backend=backend, dtype=torch.bfloat16, device="cuda")
        model.load_state_dict(tensors)
        with torch.no_grad():
            outs[backend] = torch.cat(model(pixels, grids)).float()
    assert rel_err(outs["triton"], outs["reference"]) <= 2e-2
