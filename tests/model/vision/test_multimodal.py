"""The image input processor (rocm_k3/engine/multimodal.py) without a model: where images go in raw prompts, token
ids and chat renderings, the prefix-cache key, named errors; and the ForwardBatch's image fields."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rocm_k3.engine.multimodal import MultiModalProcessor, as_image_list, multi_modal_images
from rocm_k3.model.config import ModelConfig
from simple_cache import SimpleCache
from rocm_k3.model.tiny import tiny_config
from rocm_k3.model.vision.preprocess import ImageTooLargeError, NotAnImageError, PreprocessConfig
from rocm_k3.model.vision.prompt import (
    IMAGE_PLACEHOLDER,
    MEDIA_KEY_BASE,
    ImagePlacementError,
    MediaTokenInPromptError,
    MediaTokens,
)
from rocm_k3.formats import K3ChatRenderer
from rocm_k3.tokenizers import embedded_byte_tokenizer
from tests.vision_engine_fixtures import noise_image

TOK = embedded_byte_tokenizer()
MEDIA = MediaTokens.from_lookup(TOK.special_tokens.get)
PH = IMAGE_PLACEHOLDER


@pytest.fixture(scope="module")
def processor() -> MultiModalProcessor:
    return MultiModalProcessor(MEDIA, TOK.encode, PreprocessConfig(in_patch_limit=1024, patch_limit_on_one_side=32))


def _block(tokens: int, size: tuple[int, int]) -> list[int]:
    return [MEDIA.begin, *TOK.encode(f"image {size[0]}x{size[1]}"), MEDIA.content, *[MEDIA.pad] * tokens, MEDIA.end]


def test_raw_prompt_placeholders_mark_the_images(processor) -> None:
    a, b = noise_image(0, 56, 28), noise_image(1, 30, 30)  # 2 and 4 tokens
    mm = processor.process_prompt(f"A{PH}B {PH}", [a, b])
    assert mm.token_ids == [*TOK.encode("A"), *_block(2, (56, 28)), *TOK.encode("B "), *_block(4, (30, 30))]
    first = 1 + 1 + len("image 56x28") + 1
    assert [im.pad_start for im in mm.images] == [first, first + 2 + 1 + 2 + 1 + len("image 30x30") + 1]
    assert mm.pad_positions == [p for im in mm.images for p in range(im.pad_start, im.pad_end)]
    assert all(mm.token_ids[p] == MEDIA.pad for p in mm.pad_positions)
    assert [im.num_tokens for im in mm.images] == [2, 4] and mm.images[0].grid_thw == (1, 2, 4)
    with pytest.raises(ImagePlacementError, match="2 .* markers but 1 images"):
        processor.process_prompt(f"{PH}{PH}", [a])
    with pytest.raises(ImagePlacementError, match="1 .* markers but 0 images"):
        processor.process_prompt(f"x{PH}", [])


def test_prompts_without_markers_or_positions_get_the_images_first(processor) -> None:
    a = noise_image(0, 56, 28)
    text = processor.process_prompt("describe", a)  # one image, not a list
    assert text.token_ids == [*_block(2, (56, 28)), *TOK.encode("describe")]
    ids = processor.process_images(TOK.encode("describe"), None, [a])
    assert ids.token_ids == text.token_ids and ids.image_hashes == text.image_hashes
    at_end = processor.process_images(TOK.encode("xy"), [2], [a])
    assert at_end.token_ids == [*TOK.encode("xy"), *_block(2, (56, 28))]
    with pytest.raises(ImagePlacementError, match="outside"):
        processor.process_images(TOK.encode("xy"), [3], [a])
    with pytest.raises(MediaTokenInPromptError):  # ids that already hold a media token get no image
        processor.process_images([MEDIA.pad, 5], [0], [a])


def test_chat_images_go_where_the_renderer_put_them_typed_placeholders_stay_text(processor) -> None:
    renderer = K3ChatRenderer(TOK)
    image_part = {"type": "image_url", "image_url": {"url": "data:,"}}
    chat = [{"role": "user", "content": [{"type": "text", "text": f"typed {PH} here:"}, image_part,
                                         {"type": "text", "text": "?"}]}]
    rendered = renderer.render(chat, thinking=False)
    mm = processor.process_images(rendered.token_ids, rendered.image_positions, [noise_image(2, 56, 28)])
    assert len(mm.images) == 1 and mm.token_ids.count(MEDIA.begin) == 1
    start = rendered.image_positions[0]
    assert mm.token_ids[:start] == rendered.token_ids[:start]
    assert mm.token_ids[start:start + len(_block(2, (56, 28)))] == _block(2, (56, 28))
    assert TOK.decode(mm.token_ids[:start]).endswith(f"typed {PH} here:")  # the typed marker: plain bytes
    with pytest.raises(ImagePlacementError, match="1 images but 0 image positions"):  # no part, no slot
        processor.process_images(renderer.render([{"role": "user", "content": f"{PH}"}]).token_ids, [],
                                 [noise_image(2, 56, 28)])


def test_cache_key_salts_the_pads_with_the_image_hash(processor) -> None:
    a, a_again, b = noise_image(3, 56, 28), noise_image(3, 56, 28), noise_image(4, 56, 28)
    mm_a, mm_a2, mm_b = (processor.process_prompt(f"x{PH}y", im) for im in (a, a_again, b))
    assert mm_a.cache_key_ids == mm_a2.cache_key_ids and mm_a.image_hashes == mm_a2.image_hashes
    assert mm_a.token_ids == mm_b.token_ids and mm_a.image_hashes != mm_b.image_hashes
    differ = [i for i, (p, q) in enumerate(zip(mm_a.cache_key_ids, mm_b.cache_key_ids)) if p != q]
    assert differ == mm_a.pad_positions  # same text: only the pads differ
    assert all(mm_a.cache_key_ids[p] >= MEDIA_KEY_BASE for p in mm_a.pad_positions)
    assert [k for i, k in enumerate(mm_a.cache_key_ids) if i not in differ] == \
        [t for i, t in enumerate(mm_a.token_ids) if i not in differ]


def test_bad_images_are_named(processor) -> None:
    small = MultiModalProcessor(MEDIA, TOK.encode, PreprocessConfig(max_image_pixels=100))
    with pytest.raises(ImageTooLargeError, match="image 1: .*exceeds the limit"):
        small.process_prompt("x", [noise_image(0, 5, 5), noise_image(0, 20, 20)])
    with pytest.raises(NotAnImageError, match="image 0"):
        processor.process_prompt("x", [b"GIF89a but not really"])
    assert issubclass(ImageTooLargeError, ValueError) and issubclass(NotAnImageError, ValueError)
    with pytest.raises(TypeError, match="PIL image"):
        as_image_list({"url": "x"})
    assert multi_modal_images(None, "p") == [] and len(multi_modal_images({"image": [b"a", b"b"]}, "p")) == 2
    with pytest.raises(ValueError, match="images only"):
        multi_modal_images({"audio": b""}, "p")


def test_forward_batch_image_fields_are_validated() -> None:
    cfg = ModelConfig.from_hf_dict(tiny_config())
    batch = SimpleCache(cfg, max_model_len=16, dtype=torch.float32).prepare([(0, [1, 2, 3, 4])])
    rows = torch.tensor([1, 2], dtype=torch.int64)
    ok = dataclasses.replace(batch, image_embeds=torch.zeros(2, cfg.hidden_size), image_rows=rows)
    assert ok.image_rows is rows
    with pytest.raises(ValueError, match="both"):
        dataclasses.replace(batch, image_embeds=torch.zeros(2, cfg.hidden_size))
    with pytest.raises(TypeError, match="image_rows"):
        dataclasses.replace(batch, image_embeds=torch.zeros(2, cfg.hidden_size), image_rows=rows.int())
    with pytest.raises(ValueError, match="image_rows"):
        dataclasses.replace(batch, image_embeds=torch.zeros(3, cfg.hidden_size), image_rows=rows)
    with pytest.raises(ValueError, match="floating-point"):
        dataclasses.replace(batch, image_embeds=torch.zeros(2, dtype=torch.int64), image_rows=rows)
