"""The K2.5 variant against transformers' independent formulation (``transformers.models.kimi_k25``).

Tower + projector: one tiny random checkpoint in the released K2.5 layout (``vision_tower.encoder.blocks.{i}.wqkv``,
``norm0``/``norm1``, ``mlp.fc0``/``fc1``, ``mm_projector.pre_norm`` / ``proj.0`` / ``proj.2``, all with biases)
is loaded by rocm-k3's vision loader and by ``Kimi_K25ForConditionalGeneration.from_pretrained``, whose own
conversion (q/k/v split, RoPE permutation of q and k into its rotate-half layout, renames) reads the same file.
Both run the same packed images (several sizes, the table up- and down-sampled and used as is) in fp32.
Measured relative errors (rel_err, fp64 norms; 2026-12-01, CPU): tower hidden states 5.2e-7, merged tokens 5.2e-7,
projector output 6.9e-7; tolerance 1e-5 each.

Preprocessing: transformers' K2.5 image processor runs on torchvision, which has no CPU wheel for this torch on
PyPI. The CPU test therefore runs transformers' own ``navit_resize`` and ``patchify`` (loaded from the installed
source file, not copied) against rocm-k3's resize plan and patches on the same images; with torchvision installed
(a GPU host) the whole processor is compared too. Known difference: transformers resizes with torchvision's
antialiased bicubic on tensors, rocm-k3 (like vLLM's K3 processor) with PIL BICUBIC, so images that need no
resize agree exactly and resized ones only to a tolerance; patches, grids, padding and normalisation agree exactly.
"""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from rocm_k3.model.vision.config import K25_VISION_CONFIG
from rocm_k3.model.vision.loader import load_vision_model
from rocm_k3.model.vision.preprocess import PreprocessConfig, plan_resize, preprocess_image
from tests.helpers import rel_err, seeded
from tests.vision_fixtures import random_vision_tensors, write_vision_checkpoint

transformers = pytest.importorskip("transformers")

D, HEADS, LAYERS, INTER, TABLE, TEXT = 48, 2, 2, 64, 8, 32
GRIDS = [(1, 4, 6), (1, 16, 12), (1, 8, 8), (1, 2, 10)]  # down/up-sampled table, the table as is, mixed


def _k25_raw() -> dict:
    return {**K25_VISION_CONFIG, "vt_hidden_size": D, "vt_intermediate_size": INTER, "vt_num_hidden_layers": LAYERS,
            "vt_num_attention_heads": HEADS, "init_pos_emb_height": TABLE, "init_pos_emb_width": TABLE,
            "mm_hidden_size": D, "text_hidden_size": TEXT}


def _hf_config() -> dict:
    text = {"model_type": "deepseek_v3", "hidden_size": TEXT, "num_hidden_layers": 1, "vocab_size": 128,
            "intermediate_size": 64, "moe_intermediate_size": 16, "num_attention_heads": 2, "num_key_value_heads": 2,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "kv_lora_rank": 16,
            "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
            "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}
    vision = {"hidden_size": D, "num_attention_heads": HEADS, "num_hidden_layers": LAYERS, "intermediate_size": INTER,
              "pos_emb_height": TABLE, "pos_emb_width": TABLE, "patch_size": 14, "merge_kernel_size": [2, 2]}
    return {"model_type": "kimi_k25", "architectures": ["Kimi_K25ForConditionalGeneration"],
            "projection_hidden_size": D, "projection_layer_norm_eps": 1e-5, "vision_config": vision,
            "text_config": text}


@pytest.fixture(scope="module")
def k25_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("k25_vision")
    tensors = random_vision_tensors(_k25_raw(), seed=11, bias_scale=0.1)
    write_vision_checkpoint(root, tensors, _hf_config(), dtype=torch.float32)
    return root


def test_k25_tower_and_projector_match_transformers(k25_checkpoint: Path) -> None:
    from transformers import Kimi_K25ForConditionalGeneration

    hf, info = Kimi_K25ForConditionalGeneration.from_pretrained(str(k25_checkpoint), dtype=torch.float32,
                                                                output_loading_info=True)
    vision_keys = [k for k in info["missing_keys"] if "vision_tower" in k or "mm_projector" in k]
    assert not vision_keys and not info["unexpected_keys"], (vision_keys, info["unexpected_keys"])
    hf.eval()
    ours = load_vision_model(k25_checkpoint, _k25_raw(), dtype=torch.float32)
    n = sum(t * h * w for t, h, w in GRIDS)
    pixels = torch.randn(n, 3, 14, 14, generator=seeded(12))
    grid = torch.tensor(GRIDS, dtype=torch.long)
    with torch.no_grad():
        theirs = hf.model.vision_tower(pixels, grid_thw=grid)
        feats = hf.model.get_image_features(pixels, grid).pooler_output  # per image [n_i, TEXT]
        hidden = ours.vision_tower.hidden_states(pixels, GRIDS)
        merged = ours.vision_tower(pixels, GRIDS)
        embeds = ours(pixels, GRIDS)
    errs = {
        "hidden": rel_err(hidden, theirs.last_hidden_state),
        "merged": rel_err(torch.cat(merged), theirs.pooler_output),
        "projected": rel_err(torch.cat(embeds), torch.cat(feats)),
    }
    print(f"K2.5 vs transformers (fp32): {errs}")
    assert [e.shape for e in embeds] == [f.shape for f in feats]
    for name, err in errs.items():
        assert err <= 1e-5, f"{name}: relative error {err:.3e} > 1e-5"


def _hf_source_function(name: str, class_name: str | None = None):
    """A function of transformers' installed K2.5 image processor source, executed from that file."""
    src = Path(transformers.__file__).parent / "models" / "kimi_k25" / "image_processing_kimi_k25.py"
    tree = ast.parse(src.read_text())
    nodes = tree.body
    if class_name is not None:
        nodes = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name).body
    fn = next(n for n in nodes if isinstance(n, ast.FunctionDef) and n.name == name)
    fn.returns = None
    for arg in fn.args.args + fn.args.kwonlyargs:
        arg.annotation = None
    namespace = {"math": math, "torch": torch}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(src), "exec"), namespace)  # noqa: S102
    return namespace[name]


SIZES = [(1, 1), (13, 13), (29, 57), (640, 480), (14, 7200), (7300, 20), (3000, 2000), (20000, 15000), (7168, 7168)]


@pytest.mark.parametrize("limit", [65536, 16384], ids=["K3-limit", "K2.5-limit"])
def test_resize_rule_matches_transformers(limit: int) -> None:
    navit_resize = _hf_source_function("navit_resize")
    cfg = PreprocessConfig(in_patch_limit=limit)
    for w, h in SIZES:
        (new_h, new_w), (pad_h, pad_w) = navit_resize(height=h, width=w, patch_size=14, merge_kernel_size=2,
                                                      max_patches=limit, max_size_per_side=512)
        plan = plan_resize(w, h, cfg)
        assert plan.resized_size == (new_w, new_h), (w, h)
        assert plan.padded_size == (pad_w, pad_h), (w, h)
        assert plan.grid_thw == (1, pad_h // 14, pad_w // 14)
        assert (plan.resized_size[0] // 14) * (plan.resized_size[1] // 14) <= limit  # the budget, before padding


def _rgb_image(w: int, h: int, seed: int) -> Image.Image:
    data = torch.randint(0, 256, (h, w, 3), generator=seeded(seed), dtype=torch.uint8)
    return Image.fromarray(data.numpy(), "RGB")


@pytest.mark.parametrize("size", [(30, 45), (56, 28), (200, 150), (1, 1)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_patches_match_transformers_patchify(size: tuple[int, int]) -> None:
    """Same resized image -> transformers' pad (zeros), rescale + normalise (0.5/0.5) and patchify == ours."""
    patchify = _hf_source_function("patchify", "Kimi_K25ImageProcessor")
    image = _rgb_image(*size, seed=sum(size))
    ours = preprocess_image(image)
    new_w, new_h = ours.plan.resized_size
    pad_w, pad_h = ours.plan.padded_size
    resized = image.resize((new_w, new_h), Image.Resampling.BICUBIC)
    rgb = torch.frombuffer(bytearray(resized.tobytes()), dtype=torch.uint8)
    chw = rgb.view(new_h, new_w, 3).permute(2, 0, 1)
    padded = F.pad(chw, (0, pad_w - new_w, 0, pad_h - new_h)).float()  # zeros right and bottom
    normed = (padded * (1 / 255) - 0.5) / 0.5
    patches, gh, gw = patchify(None, normed[None], 14)
    assert (1, gh, gw) == ours.grid_thw
    assert (ours.pixel_values - patches[0]).abs().max() <= 1e-6


def test_whole_processor_matches_transformers() -> None:
    """With torchvision: transformers' processor end to end (its antialiased tensor bicubic vs PIL BICUBIC)."""
    pytest.importorskip("torchvision")
    from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor

    proc = Kimi_K25ImageProcessor(max_patches=65536)
    for size, resized in (((300, 200), False), ((56, 84), False), ((9000, 500), True)):
        image = _rgb_image(*size, seed=size[0])
        out = proc(images=[image], return_tensors="pt")
        ours = preprocess_image(image)
        assert tuple(out["image_grid_thw"][0].tolist()) == ours.grid_thw
        diff = (ours.pixel_values - out["pixel_values"]).abs()
        if resized:
            assert rel_err(ours.pixel_values, out["pixel_values"]) <= 5e-2, "resampling kernels differ beyond 5%"
        else:
            assert diff.max() <= 1e-6


def test_k25_config_reads_released_names() -> None:
    from rocm_k3.model.vision.config import VisionConfig

    cfg = VisionConfig.from_hf_dict(K25_VISION_CONFIG)
    assert (cfg.norm_type, cfg.attn_bias, cfg.linear_bias, cfg.patch_embed_proj_bias) == ("layernorm", True, True, True)
    assert (cfg.head_dim, cfg.qkv_hidden_size, cfg.pos_emb_interpolation_mode) == (72, 1152, "bicubic")
    assert cfg.projector_type == "patchmerger" and cfg.norm_eps == 1e-5
    assert json.loads(json.dumps(K25_VISION_CONFIG)) == K25_VISION_CONFIG
