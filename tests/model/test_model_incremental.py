"""Cached generation equals one full-sequence forward, for both variants.

A prompt processed as prefill chunks and then decoded token by token (decode steps take the absorbed-MLA and
recurrent-KDA paths) must give the logits of one full forward over the whole sequence. Every step crosses the
KDA/MLA boundaries (K3 tiny: KDA 1-2, MLA 3; Kimi Linear tiny: KDA 1, MLA 2) and, for K3, the AttnRes block
boundaries (blocks of 2 layers). Tolerances (fp32): 1e-5 relative on logits and saved states.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_rel, seeded
from model_fixtures import one_thread, write_kimi_linear_checkpoint  # noqa: F401 (autouse)

from rocm_k3.model.loader import load_model
from simple_cache import SimpleCache
from rocm_k3.model.tiny import write_tiny_checkpoint

TOL = 1e-5


@pytest.fixture(scope="module", params=["k3", "kimi_linear"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "k3":
        write_tiny_checkpoint(root, seed=5)
    else:
        write_kimi_linear_checkpoint(root, seed=5)
    return load_model(root, dtype=torch.float32, progress=False)


def _ids(model, n: int, seed: int) -> list[int]:
    return torch.randint(0, model.cfg.vocab_size, (n,), generator=seeded(seed)).tolist()


def _all_rows(cache: SimpleCache, steps, model) -> torch.Tensor:
    batch = cache.prepare(steps)
    batch.logits_indices = torch.arange(batch.num_tokens)
    return model.forward(batch, cache)


def test_chunked_prefill_then_decode_matches_full(model) -> None:
    ids = _ids(model, 14, seed=1)
    full = _all_rows(SimpleCache(model.cfg, max_model_len=14, dtype=model.dtype), [(0, ids)], model)
    cache = SimpleCache(model.cfg, max_model_len=14, block_size=4, dtype=model.dtype)
    first = _all_rows(cache, [(0, ids[:6])], model)  # prefill, fresh state
    second = _all_rows(cache, [(0, ids[6:10])], model)  # prefill continuing cached KDA state and MLA pages
    decode = []
    for token in ids[10:]:
        batch = cache.prepare([(0, [token])])
        assert batch.is_decode
        decode.append(model.forward(batch, cache))
    assert_rel(first, full[:6], TOL, "first prefill chunk")
    assert_rel(second, full[6:10], TOL, "second prefill chunk")
    assert_rel(torch.cat(decode), full[10:], TOL, "decode steps")


def test_varlen_batch_matches_single_sequences(model) -> None:
    a, b = _ids(model, 9, seed=2), _ids(model, 5, seed=3)
    extra_a, extra_b = _ids(model, 3, seed=4), _ids(model, 3, seed=5)
    cache = SimpleCache(model.cfg, max_seqs=2, max_model_len=12, block_size=4, dtype=model.dtype)
    logits = [model.forward(cache.prepare([(0, a), (1, b)]), cache)]  # [2, vocab]: last prompt token of each
    for ta, tb in zip(extra_a, extra_b):
        batch = cache.prepare([(1, [tb]), (0, [ta])])  # rows in the other order: slots, not rows, identify seqs
        assert batch.is_decode
        logits.append(model.forward(batch, cache).flip(0))
    batched = torch.stack(logits)  # [steps, 2, vocab]
    for row, (prompt, extra) in enumerate(((a, extra_a), (b, extra_b))):
        seq = prompt + extra
        single = _all_rows(SimpleCache(model.cfg, max_model_len=len(seq), dtype=model.dtype), [(0, seq)], model)
        wanted = single[len(prompt) - 1:]  # last prompt position, then each fed-back token
        assert_rel(batched[:, row], wanted, TOL, f"sequence {row}")


def test_mixed_prefill_and_decode_step(model) -> None:
    """Continuous batching: one sequence decodes while another starts its prefill in the same (non-decode) step."""
    a, b = _ids(model, 7, seed=8), _ids(model, 6, seed=9)
    cache = SimpleCache(model.cfg, max_seqs=2, max_model_len=8, block_size=4, dtype=model.dtype)
    model.forward(cache.prepare([(0, a[:6])]), cache)
    batch = cache.prepare([(1, b), (0, a[6:])])
    assert not batch.is_decode
    mixed = model.forward(batch, cache)  # [2, vocab]: last token of b, then a's decode token
    for row, seq in ((0, b), (1, a)):
        single = _all_rows(SimpleCache(model.cfg, max_model_len=len(seq), dtype=model.dtype), [(0, seq)], model)
        assert_rel(mixed[row], single[-1], TOL, f"row {row}")


def test_saved_kda_states_equal_prefix_states(model) -> None:
    ids = _ids(model, 12, seed=6)
    cache = SimpleCache(model.cfg, max_model_len=12, spare_slots=2, dtype=model.dtype)
    model.forward(cache.prepare([(0, ids)], save=[(0, 2, 1), (0, 7, 2)]), cache)
    for p, slot in ((2, 1), (7, 2)):
        prefix = SimpleCache(model.cfg, max_model_len=p, dtype=model.dtype)
        model.forward(prefix.prepare([(0, ids[:p])]), prefix)
        for layer in range(len(model.cfg.kda_layers)):
            assert_rel(cache.kda_state(layer)[slot], prefix.kda_state(layer)[0], TOL, f"state p={p} kda{layer}")
            assert_rel(cache.conv_state(layer)[slot], prefix.conv_state(layer)[0], TOL, f"conv p={p} kda{layer}")


def test_saves_in_a_continuing_prefill_equal_prefix_states(model) -> None:
    """Saves in a step that continues a cached sequence (p < W - 1 takes the conv snapshot partly from the old
    history) beside a fresh sequence whose early save has no history (zeros), rows in another order than the slots:
    every saved KDA and conv state equals the state after that prefix alone."""
    a, b = _ids(model, 11, seed=10), _ids(model, 6, seed=11)
    cache = SimpleCache(model.cfg, max_seqs=2, max_model_len=11, spare_slots=5, dtype=model.dtype)
    model.forward(cache.prepare([(0, a[:5])]), cache)
    for layer in range(len(model.cfg.kda_layers)):  # b's stale slot 1 (no history) and the save slots: NaN
        cache.conv_state(layer)[1:].fill_(float("nan"))
    saves = [(1, 1, 2), (1, 2, 3), (0, 1, 4), (1, 6, 5), (0, 4, 6)]  # (step row, p, slot); row 0 is b, row 1 a
    model.forward(cache.prepare([(1, b), (0, a[5:])], save=saves), cache)
    for row, p, slot in saves:
        ids = b[:p] if row == 0 else a[: 5 + p]
        prefix = SimpleCache(model.cfg, max_model_len=len(ids), dtype=model.dtype)
        model.forward(prefix.prepare([(0, ids)]), prefix)
        for layer in range(len(model.cfg.kda_layers)):
            assert_rel(cache.kda_state(layer)[slot], prefix.kda_state(layer)[0], TOL, f"state {ids} kda{layer}")
            assert_rel(cache.conv_state(layer)[slot], prefix.conv_state(layer)[0], TOL, f"conv {ids} kda{layer}")


def test_bf16_close_to_fp32(tmp_path) -> None:
    # Every expert is routed (top-k = E) so no near-tie in the router can flip between dtypes: the comparison
    # measures rounding only. bf16 (8-bit mantissa) through 6 random layers gives a few percent (measured
    # 1-4% per position); 0.1 separates that from a broken bf16 path (unrelated logits differ by ~1.4).
    root = write_tiny_checkpoint(tmp_path, seed=7, text_overrides={"num_experts_per_token": 8})
    ids = list(b"bf16 vs fp32")
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        m = load_model(root, dtype=dtype, progress=False)
        out[dtype] = _all_rows(SimpleCache(m.cfg, max_model_len=len(ids), dtype=dtype), [(0, ids)], m)
        assert out[dtype].dtype == torch.float32  # logits are fp32 whatever the model dtype
    assert_rel(out[torch.bfloat16], out[torch.float32], 1e-1, "bf16 logits")
