"""Prompt expansion, image hashes, the prefix-cache key and embedding scatter (rocm_k3/model/vision/prompt.py)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from rocm_k3.model.vision.preprocess import preprocess_image
from rocm_k3.tokenizers.byte import embedded_byte_tokenizer
from rocm_k3.model.vision.prompt import (
    IMAGE_PLACEHOLDER,
    K3_MEDIA_TOKENS,
    MEDIA_KEY_BASE,
    ImagePlacementError,
    MediaTokenInPromptError,
    MediaTokens,
    expand_prompt,
    image_block,
    image_content_hash,
    prefix_cache_key,
    raw_prompt_image_positions,
    scatter_image_embeddings,
)

TOK = embedded_byte_tokenizer()  # the embedded tiny model's: bytes, then K3's specials (media 262..265)
MEDIA = MediaTokens.from_lookup(TOK.special_tokens.get)
B, C, E, P = MEDIA.begin, MEDIA.content, MEDIA.end, MEDIA.pad


def _enc(text: str) -> list[int]:
    return TOK.encode(text)


def _image(w: int, h: int, colour: tuple[int, int, int] = (10, 20, 30)):
    return preprocess_image(Image.new("RGB", (w, h), colour))


def test_k3_and_k25_blocks() -> None:
    k3 = image_block(K3_MEDIA_TOKENS, 3, (640, 480), _enc, "k3")
    assert k3 == [163602, *b"image 640x480", 163603, 163605, 163605, 163605, 163604]
    k25 = image_block(K3_MEDIA_TOKENS, 2, (640, 480), _enc, "k25")
    assert k25 == [163602, *b"image", 163603, 163605, 163605, 163604]
    with pytest.raises(ValueError, match="style"):
        image_block(MEDIA, 1, (1, 1), _enc, "k2")
    with pytest.raises(ValueError, match="num_tokens"):
        image_block(MEDIA, 0, (1, 1), _enc)


def test_expand_prompt_positions_and_pads() -> None:
    a, b = _image(30, 45), _image(100, 60, (200, 0, 0))  # 4 and 12 tokens
    prompt = _enc("Look: and then")
    out = expand_prompt(prompt, [6, len(prompt)], [a, b], MEDIA, _enc)
    block_a = [B, *b"image 30x45", C, *[P] * 4, E]
    block_b = [B, *b"image 100x60", C, *[P] * 12, E]
    assert out.token_ids == [*b"Look: ", *block_a, *b"and then", *block_b]
    sa, sb = out.slots
    assert (sa.block_start, sa.block_end, sa.num_tokens) == (6, 6 + len(block_a), 4)
    assert [out.token_ids[p] for p in out.pad_positions] == [P] * 16
    assert out.pad_positions == [*range(sa.pad_start, sa.pad_start + 4), *range(sb.pad_start, sb.pad_start + 12)]
    assert out.token_ids[sa.pad_start - 1] == C and out.token_ids[sb.pad_start + 12] == E
    # two images at one position keep their order; an image at 0 comes before all text
    both = expand_prompt(prompt, [0, 0], [b, a], MEDIA, _enc)
    assert both.token_ids[:len(block_b)] == block_b and both.slots[1].block_start == len(block_b)
    assert both.image_hashes == [out.image_hashes[1], out.image_hashes[0]]


def test_placement_errors() -> None:
    a = _image(28, 28)
    prompt = _enc("hi")
    with pytest.raises(ImagePlacementError, match="1 images but 2"):
        expand_prompt(prompt, [0, 1], [a], MEDIA, _enc)
    with pytest.raises(ImagePlacementError, match="outside"):
        expand_prompt(prompt, [3], [a], MEDIA, _enc)
    with pytest.raises(ImagePlacementError, match="non-decreasing"):
        expand_prompt(prompt, [2, 1], [a, a], MEDIA, _enc)
    typed = TOK.encode("h<|media_pad|>i", allow_special=True)  # a tokenizer that maps typed specials to ids
    assert typed == [ord("h"), P, ord("i")]
    with pytest.raises(MediaTokenInPromptError, match="positions \\[1\\]"):
        expand_prompt(typed, [0], [a], MEDIA, _enc)
    with pytest.raises(MediaTokenInPromptError):  # even without images
        expand_prompt([B], [], [], MEDIA, _enc)


def test_typed_placeholder_text_gets_no_slot() -> None:
    """The renderer places the image; placeholder text a user typed stays ordinary text ids."""
    user_text = f"what is {IMAGE_PLACEHOLDER} here?"
    ids = _enc(user_text)
    out = expand_prompt(ids, [len(ids)], [_image(28, 28)], MEDIA, _enc)
    assert len(out.slots) == 1 and out.slots[0].block_start == len(ids)
    assert out.token_ids[:len(ids)] == ids and out.pad_positions == [out.slots[0].pad_start]
    assert TOK.decode(out.token_ids[:len(ids)]) == user_text


def test_raw_prompt_placeholders() -> None:
    ids, pos = raw_prompt_image_positions(f"A{IMAGE_PLACEHOLDER}B{IMAGE_PLACEHOLDER}", 2, _enc)
    assert ids == [ord("A"), ord("B")] and pos == [1, 2]
    ids, pos = raw_prompt_image_positions("no marker", 3, _enc)  # images go before the text
    assert ids == _enc("no marker") and pos == [0, 0, 0]
    with pytest.raises(ImagePlacementError, match="2 .* markers but 1 images"):
        raw_prompt_image_positions(f"{IMAGE_PLACEHOLDER}{IMAGE_PLACEHOLDER}", 1, _enc)


def test_content_hash_and_cache_key() -> None:
    a1, a2, b = _image(40, 40), _image(40, 40), _image(40, 40, (11, 20, 30))
    assert a1.pixel_values is not a2.pixel_values
    assert image_content_hash(a1.pixel_values, a1.grid_thw) == image_content_hash(a2.pixel_values, a2.grid_thw)
    assert image_content_hash(a1.pixel_values, a1.grid_thw) != image_content_hash(b.pixel_values, b.grid_thw)
    # same bytes, different grid: different hash
    assert a1.grid_thw == (1, 4, 4)
    assert image_content_hash(a1.pixel_values, (1, 2, 8)) != image_content_hash(a1.pixel_values, (1, 4, 4))
    prompt = _enc("same text")
    pa, pa2, pb = (expand_prompt(prompt, [0], [im], MEDIA, _enc) for im in (a1, a2, b))
    assert pa.token_ids == pb.token_ids  # the model's ids cannot tell the images apart ...
    ka, ka2, kb = (prefix_cache_key(p.token_ids, p.slots) for p in (pa, pa2, pb))
    assert ka == ka2 and ka != kb  # ... the cache key does
    pads = set(pa.pad_positions)
    assert all(ka[i] == t for i, t in enumerate(pa.token_ids) if i not in pads)
    assert all(ka[i] >= MEDIA_KEY_BASE for i in pads) and ka[pa.slots[0].block_start] == B


def test_media_tokens_from_lookup() -> None:
    table = {"<|media_begin|>": 1, "<|media_content|>": 2, "<|media_end|>": 3, "<|media_pad|>": 4}
    assert MediaTokens.from_lookup(table.get) == MediaTokens(1, 2, 3, 4)
    with pytest.raises(ValueError, match="media_pad"):
        MediaTokens.from_lookup({k: v for k, v in table.items() if k != "<|media_pad|>"}.get)
    with pytest.raises(ValueError, match="must differ"):
        MediaTokens(1, 1, 2, 3)


def test_scatter_image_embeddings() -> None:
    embeds = torch.zeros(10, 4)
    img = torch.arange(12, dtype=torch.float32).view(3, 4)
    out = scatter_image_embeddings(embeds, [2, 3, 7], img)
    assert torch.equal(out[[2, 3, 7]], img) and out[[0, 1, 4, 5, 6, 8, 9]].abs().sum() == 0
    assert embeds.abs().sum() == 0  # the input is not modified
    parts = scatter_image_embeddings(embeds, torch.tensor([7, 2, 3]), [img[:1], img[1:]])
    assert torch.equal(parts[7], img[0]) and torch.equal(parts[3], img[2])
    assert scatter_image_embeddings(embeds.bfloat16(), [1], img[:1]).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="2 <\\|media_pad\\|> positions but 3"):
        scatter_image_embeddings(embeds, [1, 2], img)
    with pytest.raises(ValueError, match="outside"):
        scatter_image_embeddings(embeds, [1, 2, 10], img)
    with pytest.raises(ValueError, match="repeat"):
        scatter_image_embeddings(embeds, [1, 1, 2], img)
    with pytest.raises(ValueError, match=r"\[N, 4\]"):
        scatter_image_embeddings(embeds, [1, 2, 3], torch.zeros(3, 5))
    with pytest.raises(ValueError, match=r"\[T, hidden\]"):
        scatter_image_embeddings(embeds[0], [1], img[:1])
