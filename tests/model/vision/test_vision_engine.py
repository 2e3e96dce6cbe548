"""Images end to end on the tiny vision K3 (``write_tiny_checkpoint(..., vision=True)``), CPU, fp32.

- ``LLM.generate`` with image prompts (placeholders, images-first, token ids + positions) gives the greedy tokens
  of a direct computation: the tower + projector run on the preprocessed images outside the engine, their rows
  scattered at the pad positions of the K3 expansion, the text model run step by step on a SimpleCache;
- the decoder's scatter is exactly "these rows' input embeddings replaced" (an embedding-substitution identity);
- different images give different outputs; the prefix cache serves an identical image prompt (no tower run) and
  never an equal-text prompt's pads for another image; caching on and off give the same tokens;
- chunked prefill splitting an image's pads over several chunks encodes each image once, and preemption
  (recomputation with the images re-sent) gives the same tokens;
- the step contract's image checks, the engine's, and the named errors for bad images.
"""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest
import torch

import rocm_k3
from rocm_k3.cache.config import CacheConfig
from rocm_k3.engine.config import EngineConfig
from rocm_k3.engine.multimodal import MultiModalProcessor
from rocm_k3.model.loader import load_model
from simple_cache import SimpleCache
from rocm_k3.model.tiny import write_tiny_checkpoint
from rocm_k3.model.vision.loader import load_vision_model
from rocm_k3.model.vision.preprocess import EmptyImageError, NotAnImageError, PreprocessConfig
from rocm_k3.model.vision.prompt import IMAGE_PLACEHOLDER, ImagePlacementError
from rocm_k3.sampling_params import SamplingParams
from rocm_k3.tokenizers import load_tokenizer
from rocm_k3.worker.step_io import ImageInput, ScheduledChunk, StepInput
from tests.engine_fixtures import core_for
from tests.helpers import seeded
from tests.model_fixtures import one_thread  # noqa: F401 (autouse: one intra-op thread for tiny matmuls)
from tests.vision_engine_fixtures import direct_greedy, expand_directly, noise_image

KNOBS = {"dtype": "float32", "block_size": 16, "match_unit": 8, "alignment": 16, "max_num_batched_tokens": 64,
         "max_num_seqs": 4, "max_model_len": 256}
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PH = IMAGE_PLACEHOLDER


@pytest.fixture(scope="module")
def vision_dir(tmp_path_factory: pytest.TempPathFactory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_vision_k3"), seed=5, vision=True)


@pytest.fixture(scope="module")
def llm(vision_dir):
    return rocm_k3.LLM(vision_dir, enable_prefix_caching=True, **KNOBS)


@pytest.fixture(scope="module")
def vision_model(vision_dir):
    """A second copy of the tower, loaded outside the engine (the direct path's)."""
    return load_vision_model(vision_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def tokenizer(vision_dir):
    return load_tokenizer(vision_dir)


def _images(llm):
    return llm.engine.executor.worker.runner.images


def test_image_prompts_match_the_direct_computation(llm, vision_model, tokenizer) -> None:
    pre = PreprocessConfig.from_dir(llm.path)
    a, b, c = noise_image(1, 100, 90), noise_image(2, 60, 150), noise_image(3, 40, 40)
    ids = tokenizer.encode("token ids prompt")
    prompts = [
        {"prompt": f"Look {PH} and {PH}!", "multi_modal_data": {"image": [a, b]}},  # 75 tokens: B's pads split
        {"prompt": "What is this?", "multi_modal_data": {"image": c}},  # no placeholder: the image goes first
        {"prompt_token_ids": ids, "image_positions": [5], "multi_modal_data": {"image": [a]}},
    ]
    expected_layout = [(tokenizer.encode("Look ") + tokenizer.encode(" and ") + tokenizer.encode("!"), [5, 10],
                        [a, b]),
                       (tokenizer.encode("What is this?"), [0], [c]),
                       (ids, [5], [a])]
    before = _images(llm).num_encoded
    outs = llm.generate(prompts, GREEDY)
    for out, (prompt_ids, positions, images) in zip(outs, expected_layout):
        expanded, processed = expand_directly(tokenizer, prompt_ids, positions, images, pre)
        assert out.prompt_token_ids == expanded.token_ids
        assert out.token_ids == direct_greedy(llm.model, vision_model, expanded.token_ids, expanded.pad_positions,
                                              processed, GREEDY.max_tokens)
    assert _images(llm).num_encoded - before == 4  # each image once (B's pads span two chunks)
    assert _images(llm).held == {}  # nothing kept once the prefills passed the pads
    # the prompt's bytes before the expansion: "Look " is 5 tokens, so A's block starts at 5
    assert outs[0].prompt_token_ids[5] == tokenizer.special_tokens["<|media_begin|>"]


def test_scatter_replaces_exactly_the_input_embeddings(llm) -> None:
    """Image rows that are some tokens' own embeddings give the logits of those tokens in those places."""
    model = llm.model
    vocab = model.cfg.vocab_size
    ids = torch.randint(0, 256, (20,), generator=seeded(0)).tolist()
    rows, substitutes = [3, 4, 11], [17, 200, 65]
    swapped = list(ids)
    for r, t in zip(rows, substitutes):
        swapped[r] = t
    def logits(tokens, images=None):
        cache = SimpleCache(model.cfg, max_model_len=32, dtype=model.dtype)
        batch = cache.prepare([(0, tokens)])
        if images is not None:
            batch = dataclasses.replace(batch, image_embeds=images,
                                        image_rows=torch.tensor(rows, dtype=torch.int64))
        return model.forward(batch, cache)

    with torch.inference_mode():
        embeds = model.embed(torch.tensor(substitutes))  # [3, hidden]
    pad = llm.tokenizer.special_tokens["<|media_pad|>"]
    assert pad < vocab
    with_pads = [pad if i in rows else t for i, t in enumerate(ids)]
    assert torch.equal(logits(with_pads, embeds), logits(swapped))
    assert not torch.equal(logits(with_pads), logits(swapped))


def test_prefix_cache_serves_only_identical_images(vision_dir, llm) -> None:
    off = rocm_k3.LLM(vision_dir, enable_prefix_caching=False, **KNOBS)
    a, b = noise_image(10, 100, 90), noise_image(11, 100, 90)  # same size: the same ids, different pixels
    text = f"Same words {PH} then more words after the image"
    pad_start = len("Same words ") + 1 + len("image 100x90") + 1  # 25; 16 pads
    pad_end = pad_start + 16

    def run(engine, image):
        before, encoded = engine.stats(), _images(engine).num_encoded
        out = engine.generate({"prompt": text, "multi_modal_data": {"image": image}}, GREEDY)[0]
        after = engine.stats()
        return out, after["hit_tokens"] - before["hit_tokens"], _images(engine).num_encoded - encoded

    first_a, _, encoded = run(llm, a)
    assert encoded == 1
    other_b, hit_b, encoded_b = run(llm, b)
    assert 0 < hit_b <= pad_start and encoded_b == 1  # the shared text before the image only
    again_a, hit_a, encoded_a = run(llm, a)
    assert hit_a >= pad_end and encoded_a == 0, (hit_a, encoded_a)  # the image prompt is served: no tower run
    assert again_a.token_ids == first_a.token_ids and again_a.num_cached_tokens == hit_a
    assert other_b.token_ids != first_a.token_ids  # the image changes the output
    for image, out in ((a, first_a), (b, other_b)):
        ref = off.generate({"prompt": text, "multi_modal_data": {"image": image}}, GREEDY)[0]
        assert ref.token_ids == out.token_ids
    assert off.stats()["hit_tokens"] == 0


def _engine(vision_dir, *, budget: int, num_blocks: int, caching: bool = True):
    model = load_model(vision_dir, dtype=torch.float32, progress=False)
    vision = load_vision_model(vision_dir, dtype=torch.float32)
    cache = CacheConfig(block_size=16, match_unit=8, alignment=16, kda_save_grid=8, enable_prefix_caching=caching,
                        num_blocks=num_blocks, num_state_slots=24)
    config = EngineConfig(max_num_batched_tokens=budget, max_num_seqs=4, max_model_len=144, cache=cache)
    return core_for(model, config, vision_model=vision), model, vision


def _run(core, requests) -> dict[str, list[int]]:
    for rid, mm, params in requests:
        core.add_request(rid, mm.token_ids, params, images=mm.images)
    return {rid: out.token_ids for rid, out in core.run_to_completion().items()}


@pytest.mark.parametrize("num_blocks", [64, 10], ids=["chunked", "chunked-preempted"])
def test_chunked_prefill_and_preemption_split_an_images_pads(vision_dir, tokenizer, num_blocks) -> None:
    """Images of 64 pads under a 32-token budget: every image's pads span three chunks. With 10 blocks of 16 the
    three ~100-token requests preempt each other and are recomputed (their images sent again)."""
    core, model, vision = _engine(vision_dir, budget=32, num_blocks=num_blocks)
    processor = MultiModalProcessor.from_checkpoint(vision_dir, tokenizer)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    requests = []
    for i in range(3):
        ids = tokenizer.encode(f"prompt {i} ")
        mm = processor.process_images(ids, [len(ids)], [noise_image(20 + i, 224, 224)])  # 16 x 16 patches: 64 pads
        requests.append((f"r{i}", mm, params))
    outs = _run(core, requests)
    images = core.executor.worker.runner.images
    for rid, mm, _ in requests:
        assert outs[rid] == direct_greedy(model, vision, mm.token_ids, mm.pad_positions, mm.images, 8), rid
    stats = core.stats()
    if num_blocks == 64:
        assert stats["preemptions"] == 0 and images.num_encoded == 3  # once per image over its three chunks
    else:
        # a preempted request resumes from its own cached prefix inside its image's pads (64 of 24..88): the image
        # is sent again and encoded again, and only the rows past the cached prefix are used
        assert stats["preemptions"] >= 1 and stats["hit_tokens"] > 0 and images.num_encoded > 3, stats
    assert images.held == {} and stats["free_blocks"] == num_blocks


def test_step_contract_images_pickle_and_are_checked(llm, tokenizer) -> None:
    mm = llm.process_images(tokenizer.encode("hi"), [2], [noise_image(4, 50, 50)])
    (image,) = mm.images
    chunk = ScheduledChunk("r", tuple(mm.token_ids), 0, True, (0,), 0, True, True, images=mm.images)
    back = pickle.loads(pickle.dumps(StepInput(1, chunks=(chunk,))))
    got = back.chunks[0].images[0]
    assert np.array_equal(got.pixel_values, image.pixel_values) and got.grid_thw == image.grid_thw
    assert (got.pad_start, got.num_tokens, got.content_hash) == (image.pad_start, image.num_tokens,
                                                                  image.content_hash)
    px = image.pixel_values
    bad = {
        "pixel_values": (px.astype(np.float64), "float32"),
        "grid_thw": ((1, 5, 5), "patches"),
        "pad_start": (-1, "pad_start"),
        "num_tokens": (0, "num_tokens"),
        "content_hash": ("abc", "sha256"),
    }
    for field, (value, message) in bad.items():
        kwargs = {f.name: getattr(image, f.name) for f in dataclasses.fields(ImageInput)} | {field: value}
        with pytest.raises(ValueError, match=message):
            ImageInput(**kwargs)


def test_engine_checks_image_spans_and_vision(vision_dir, llm, tokenizer) -> None:
    mm = llm.process_images(tokenizer.encode("two images"), [0, 3], [noise_image(5, 30, 30), noise_image(6, 30, 30)])
    first, second = mm.images
    params = SamplingParams(max_tokens=1)
    overlap = dataclasses.replace(second, pad_start=first.pad_start + 1)
    with pytest.raises(ValueError, match="overlap"):
        llm.engine.add_request("bad-1", mm.token_ids, params, images=[first, overlap])
    outside = dataclasses.replace(second, pad_start=len(mm.token_ids) - 1)
    with pytest.raises(ValueError, match="leave"):
        llm.engine.add_request("bad-2", mm.token_ids, params, images=[first, outside])
    with pytest.raises(TypeError, match="ImageInput"):
        llm.engine.add_request("bad-3", mm.token_ids, params, images=[{"pixels": 1}])
    assert not llm.engine.has_unfinished()
    text_only = rocm_k3.LLM(write_tiny_checkpoint(vision_dir.parent / "text_only", seed=5), **KNOBS)
    with pytest.raises(ValueError, match="no vision tower"):
        text_only.engine.add_request("x", mm.token_ids, params, images=mm.images)
    with pytest.raises(ValueError, match="no vision tower"):
        text_only.generate({"prompt": "x", "multi_modal_data": {"image": noise_image(1, 9, 9)}})
    assert text_only.generate({"prompt": "x"}, params)[0].token_ids  # a dict prompt without images is plain text


def test_bad_images_and_prompt_dicts_are_named(llm) -> None:
    from PIL import Image

    cases = [(b"not an image", NotAnImageError), (b"", EmptyImageError), (Image.new("RGB", (0, 5)), EmptyImageError)]
    for image, error in cases:
        with pytest.raises(error, match="prompt 1: image 0"):
            llm.generate(["fine", {"prompt": "x", "multi_modal_data": {"image": image}}], GREEDY)
    with pytest.raises(ValueError, match="images only"):
        llm.generate({"prompt": "x", "multi_modal_data": {"video": b"..."}})
    with pytest.raises(ValueError, match="exactly one"):
        llm.generate({"prompt": "x", "prompt_token_ids": [1]})
    with pytest.raises(ValueError, match="unknown keys"):
        llm.generate({"prompt": "x", "images": []})
    with pytest.raises(ValueError, match="image_positions"):
        llm.generate({"prompt": f"x {PH}", "image_positions": [0], "multi_modal_data": {"image": noise_image(1, 9, 9)}})
    with pytest.raises(TypeError, match="PIL image"):
        llm.generate({"prompt": "x", "multi_modal_data": {"image": 3}})
    with pytest.raises(ImagePlacementError, match="prompt 0: the prompt has 2 .* markers but 1 images"):
        llm.generate({"prompt": f"{PH}{PH}", "multi_modal_data": {"image": noise_image(1, 9, 9)}})
    assert not llm.engine.has_unfinished()


@pytest.mark.cuda
def test_image_prompts_on_triton_match_the_direct_computation(vision_dir, tokenizer) -> None:
    """The same flow on an NVIDIA GPU with every op on the Triton backend (the tower's varlen attention
    included), fp32: the engine's tokens equal the direct path's on the same device and kernels (eager, the same
    block-table width), and an identical image prompt is served from the prefix cache with the same tokens."""
    knobs = {**KNOBS, "block_size": 128, "match_unit": 64, "alignment": 128, "max_num_batched_tokens": 256,
             "enforce_eager": True}
    llm = rocm_k3.LLM(vision_dir, device="cuda", backend="triton", enable_prefix_caching=True, **knobs)
    vision = load_vision_model(vision_dir, dtype=torch.float32, device="cuda", backend="triton")
    pre = PreprocessConfig.from_dir(vision_dir)
    a, b = noise_image(1, 100, 90), noise_image(2, 224, 224)
    prompts = [{"prompt": f"Look {PH} and {PH}!", "multi_modal_data": {"image": [a, b]}},
               {"prompt": "What is this?", "multi_modal_data": {"image": b}}]
    layout = [(tokenizer.encode("Look ") + tokenizer.encode(" and ") + tokenizer.encode("!"), [5, 10], [a, b]),
              (tokenizer.encode("What is this?"), [0], [b])]
    outs = llm.generate(prompts, GREEDY)
    width = (llm.max_model_len + 127) // 128 + 1  # the runner's block-table width
    for out, (ids, positions, images) in zip(outs, layout):
        expanded, processed = expand_directly(tokenizer, ids, positions, images, pre)
        assert out.prompt_token_ids == expanded.token_ids
        assert out.token_ids == direct_greedy(llm.model, vision, expanded.token_ids, expanded.pad_positions,
                                              processed, GREEDY.max_tokens, max_model_len=width * 128,
                                              block_size=128)
    again = llm.generate(prompts[1], GREEDY)[0]
    assert again.token_ids == outs[1].token_ids and again.num_cached_tokens >= 64


def test_a_rendered_chat_runs_its_images_through_generate(llm, vision_model, tokenizer) -> None:
    """The chat-friendly entry: the K3 renderer reports where each image part goes (a typed placeholder stays
    text) and ``generate`` takes those ids + positions + images. The chat path decodes image parts itself
    (tests/model/vision/test_vision_chat_server.py); a malformed data URL is refused by name, never dropped."""
    messages = [{"role": "user", "content": [{"type": "text", "text": f"typed {PH}:"},
                                             {"type": "image_url", "image_url": {"url": "data:,"}},
                                             {"type": "text", "text": "what is it?"}]}]
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[1\]: a data URL must be"):
        llm.chat(messages, GREEDY)
    rendered = llm.frontend.renderer.render(messages, thinking=False)
    image = noise_image(7, 56, 56)
    out = llm.generate({"prompt_token_ids": rendered.token_ids, "image_positions": list(rendered.image_positions),
                        "multi_modal_data": {"image": image}}, GREEDY)[0]
    expanded, processed = expand_directly(tokenizer, rendered.token_ids, rendered.image_positions, [image],
                                          PreprocessConfig.from_dir(llm.path))
    assert out.prompt_token_ids == expanded.token_ids
    assert out.prompt_token_ids.count(tokenizer.special_tokens["<|media_begin|>"]) == 1
    assert out.token_ids == direct_greedy(llm.model, vision_model, expanded.token_ids, expanded.pad_positions,
                                          processed, GREEDY.max_tokens)


def test_async_engine_takes_images(vision_dir, llm, tokenizer) -> None:
    """The server's path: AsyncLLM.add_request with the processor's ids and ImageInputs gives generate's tokens."""
    import asyncio

    from rocm_k3.args import EngineArgs
    from rocm_k3.engine.async_llm import AsyncLLM
    from rocm_k3.engine.assembly import assemble_engine

    core = assemble_engine(EngineArgs(model=str(vision_dir), **KNOBS)).core
    engine = AsyncLLM(core)
    mm = llm.process_images(tokenizer.encode("async"), [5], [noise_image(8, 70, 42)])

    async def run() -> list[int]:
        tokens = []
        async for delta in engine.generate(mm.token_ids, GREEDY, "a-1", images=mm.images):
            tokens += delta.new_token_ids
        return tokens

    try:
        got = asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        engine.shutdown()
    ref = llm.generate({"prompt_token_ids": tokenizer.encode("async"), "image_positions": [5],
                        "multi_modal_data": {"image": noise_image(8, 70, 42)}}, GREEDY)[0]
    assert got == ref.token_ids and ref.prompt_token_ids == mm.token_ids
