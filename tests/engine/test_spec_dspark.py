"""K3 DSpark drafters (``model_type`` k3_dspark, the released ``Inferact/Kimi-K3-DSpark`` layout) as the
``draft_model`` proposer, on the embedded tiny K3 (fp32, reference ops, CPU) with small synthetic checkpoints
written in that exact layout (config keys, tensor names; tiny widths, random weights).

Greedy outputs are identical with and without DSpark speculation (prefix caching with preemptions forced, and
without), with acceptance reported; a drafter whose Markov head knows the target's greedy bigrams gets drafts
accepted and rejected; the drafter context a request builds over speculative steps (rejected positions dropped)
equals the one a single prefill of the same tokens builds; the checkpoint loads by Hugging Face repo id from the
local cache; a missing, misshapen or unexpected tensor and a bad config key are named.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rocm_k3.cache.config import CacheConfig
from rocm_k3.engine.config import EngineConfig
from rocm_k3.model.loader import load_model
from rocm_k3.model.tiny import ensure_embedded_model
from rocm_k3.sampling_params import SamplingParams
from rocm_k3.settings import override
from rocm_k3.spec_decode.config import SpeculativeConfig
from rocm_k3.spec_decode.draft_proposer import DraftProposer
from rocm_k3.spec_decode.drafter import load_drafter
from rocm_k3.spec_decode.dspark import DSparkDrafter
from rocm_k3.spec_decode.dspark_config import DSparkConfig, tensor_shapes
from rocm_k3.spec_decode.dspark_load import load_dspark
from rocm_k3.spec_decode.dspark_proposer import DSparkProposer
from tests.engine.test_spec_drafter import _fake_hf_cache
from tests.engine.test_spec_decode_interrupt import Terminated, _interrupt_first_verification, sigterm_raises  # noqa: F401
from tests.engine_fixtures import check_between_steps, core_for, run_checked, run_until_raised, varied_prompts
from tests.model_fixtures import one_thread  # noqa: F401 (autouse: one intra-op thread for tiny matmuls)

REPO = "Inferact/Kimi-K3-DSpark"
COMMIT = "cf6b8244620e7ea4b0651d214f28e89eac75bed6"
TAPS = [0, 2, 3, 4, 5]  # five taps over the six target layers (the released drafter: 2, 23, 47, 71, 89 of 93)


@pytest.fixture(scope="module")
def model():
    return load_model(ensure_embedded_model(), dtype=torch.float32, progress=False)


def _config(model, **overrides) -> dict:
    """A config.json with every key of the released drafter's, at tiny widths for the embedded target."""
    cfg = model.cfg
    raw = {"architectures": ["K3DSparkModel"], "model_type": "k3_dspark", "hidden_size": cfg.hidden_size,
           "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
           "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
           "mla_use_nope": False, "mla_use_output_gate": False, "vocab_size": cfg.vocab_size, "rms_norm_eps": 1e-5,
           "max_position_embeddings": 4096, "rope_theta": 50000.0, "num_target_layers": len(TAPS),
           "target_hidden_size": cfg.hidden_size, "target_num_hidden_layers": cfg.num_hidden_layers,
           "target_layer_ids": TAPS, "mask_token_id": cfg.vocab_size - 3, "bos_token_id": 256, "eos_token_id": 258,
           "pad_token_id": cfg.vocab_size - 1, "markov_rank": 16, "markov_head_type": "vanilla",
           "enable_confidence_head": True, "confidence_head_with_markov": True, "tie_word_embeddings": False,
           "draft_vocab_size": cfg.vocab_size, "_torchspec_version": "0.1.0", "torch_dtype": "bfloat16",
           "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                               "rope_theta": 50000.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                               "mscale_all_dim": 1.0}}
    return {**raw, **overrides}


def _write(root: Path, model, tensors: dict | None = None, **overrides) -> Path:
    """A checkpoint directory: config.json and model.safetensors (random weights in the released layout, plus the
    tensors the served drafter reads past: the target-embedding copy and the confidence head)."""
    raw = _config(model, **overrides)
    cfg = DSparkConfig.from_dict(raw)
    gen = torch.Generator().manual_seed(3)
    if tensors is None:
        tensors = {name: (torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen) * 0.2)
                   for name, shape in tensor_shapes(cfg).items()}
        tensors["embed_tokens.weight"] = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen)
        tensors["confidence_head.proj.weight"] = torch.randn(1, cfg.hidden_size + cfg.markov_rank, generator=gen)
        tensors["confidence_head.proj.bias"] = torch.zeros(1)
    root.mkdir(parents=True, exist_ok=True)
    save_file({n: t.to(torch.bfloat16).contiguous() for n, t in tensors.items()}, str(root / "model.safetensors"),
              metadata={"torchspec_version": "0.1.0"})
    (root / "config.json").write_text(json.dumps(raw, indent=2))
    return root


def _bigram_drafter(root: Path, model, base: dict[str, list[int]], prompts) -> Path:
    """A drafter whose Markov head holds the target's greedy bigrams (rank = vocab: markov_w1 one-hot,
    markov_w2[next, prev] = 8 for the most frequent next token after prev) and whose backbone is nearly silent
    (final_norm 0.01): its drafts follow those bigrams, right often enough to be accepted, wrong often enough to be
    rejected."""
    v = model.cfg.vocab_size
    counts = torch.zeros(v, v)
    for i, out in base.items():
        seq = list(prompts[int(i)]) + out
        for a, b in zip(seq, seq[1:]):
            counts[b, a] += 1
    raw = _config(model, markov_rank=v)
    cfg = DSparkConfig.from_dict(raw)
    gen = torch.Generator().manual_seed(4)
    tensors = {name: (torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen) * 0.2)
               for name, shape in tensor_shapes(cfg).items()}
    tensors["final_norm.weight"] = torch.full((cfg.hidden_size,), 0.01)
    tensors["markov_head.markov_w1.weight"] = torch.eye(v)
    best = counts.argmax(dim=0)  # [prev] -> next
    w2 = torch.zeros(v, v)
    w2[best, torch.arange(v)] = 8.0 * (counts.sum(dim=0) > 0)
    tensors["markov_head.markov_w2.weight"] = w2
    return _write(root, model, tensors, markov_rank=v)


def _engine(model, spec, *, caching: bool = True, tight: bool = False):
    cache = CacheConfig(block_size=16, match_unit=8, alignment=16, kda_save_grid=8, enable_prefix_caching=caching,
                        num_blocks=24 if tight else 256, num_state_slots=400)
    cfg = EngineConfig(max_num_batched_tokens=256, max_num_seqs=16, max_model_len=96, cache=cache, speculative=spec)
    return core_for(model, cfg)


def _run(engine, prompts, params) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    return run_checked(engine)


GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def greedy(model):
    prompts = varied_prompts(model.cfg.vocab_size, 24)
    return prompts, _run(_engine(model, None, caching=False), prompts, GREEDY)


def _spec(root, k: int) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft_model", model=str(root), num_speculative_tokens=k)


@pytest.mark.parametrize("k, caching, tight", [(7, True, True), (3, False, False)],
                         ids=["k7-prefix-cache-preempting", "k3-no-cache"])
def test_greedy_identical_with_a_dspark_drafter(model, greedy, tmp_path, k, caching, tight):
    prompts, base = greedy
    eng = _engine(model, _spec(_bigram_drafter(tmp_path / "d", model, base, prompts), k), caching=caching,
                  tight=tight)
    assert isinstance(eng.executor.worker.proposer, DSparkProposer)
    out = _run(eng, prompts, GREEDY)
    differ = [r for r in base if out[r] != base[r]]
    assert not differ, f"{len(differ)} of {len(base)} requests differ, e.g. {differ[:5]}"
    stats = eng.stats()
    print(f"DSpark k={k}: mean accepted tokens per step {stats['spec_mean_accepted_length']:.3f}, acceptance rate "
          f"{stats['spec_acceptance_rate']:.3f}")
    assert stats["spec_num_drafts"] > 0 and 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]
    assert stats["spec_num_accepted_tokens_pos1"] > 0, stats
    if tight:
        assert stats["preemptions"] >= 1, stats
    if caching:
        assert stats["hit_requests"] >= 1, stats


def test_graph_layouts_and_split_steps_draft_the_same(model, greedy, tmp_path):
    """Verifications through the decode graphs' padded (batch, k) layout (replayed eagerly on the CPU), and steps
    where a prefill shares a step with verifications (two forwards, taps concatenated), tap the same token rows:
    the greedy tokens and every acceptance count equal the plain eager run's."""
    from tests.worker.test_verify_graphs import EagerGraphs
    from rocm_k3.worker.cuda_graph import graph_buckets

    prompts, base = greedy
    root = _bigram_drafter(tmp_path / "d", model, base, prompts)
    late = [(i * 11) % model.cfg.vocab_size for i in range(150)]  # three prefill chunks of a 64-token budget

    def run(graphs: bool):
        cache = CacheConfig(block_size=16, match_unit=8, alignment=16, kda_save_grid=8, num_blocks=64,
                            num_state_slots=60)
        core = core_for(model, EngineConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=256,
                                            cache=cache, speculative=_spec(root, 3)))
        worker = core.executor.worker
        if graphs:
            g = EagerGraphs(worker.stage, worker.runner.pools, worker.geometry.table_width, graph_buckets(4),
                            max_drafts=3, taps=worker.model)
            g.capture()
            worker.runner.graphs = g
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        for i in range(3):
            core.add_request(str(i), prompts[i], params)
        done, steps = {}, 0
        while core.has_unfinished():
            steps += 1
            if steps == 4:
                core.add_request("late", late, params)
            for delta in core.step():
                if delta.finished:
                    done[delta.request_id] = delta.output.token_ids
        return done, core.stats(), (worker.runner.graphs.verify_replays if graphs else 0)

    eager, eager_stats, _ = run(False)
    graphed, stats, replays = run(True)
    assert {r: eager[r] for r in map(str, range(3))} == {r: base[r] for r in map(str, range(3))}
    assert graphed == eager and replays > 0
    counts = [k for k in stats if k.startswith("spec_num_accepted_tokens") or k == "spec_num_drafts"]
    assert {k: stats[k] for k in counts} == {k: eager_stats[k] for k in counts}
    assert stats["spec_num_accepted_tokens"] > 0, stats


def test_random_drafter_keeps_greedy_identical_and_reports_acceptance(model, greedy, tmp_path):
    prompts, base = greedy
    eng = _engine(model, _spec(_write(tmp_path / "d", model), 7))
    assert _run(eng, prompts[:6], GREEDY) == {r: base[r] for r in map(str, range(6))}
    stats = eng.stats()
    assert 0 < stats["spec_num_draft_tokens"] <= 7 * stats["spec_num_drafts"]  # drafts trimmed near max_tokens
    assert 0 <= stats["spec_acceptance_rate"] <= 1 and "spec_acceptance_rate_pos6" in stats


def test_the_context_after_speculative_steps_equals_one_prefills(model, greedy, tmp_path):
    """The context a request built over verifications (rejected positions dropped, positions contiguous) is the one
    a single prefill of the same tokens builds (fp32; the target's prefill and decode paths differ by rounding)."""
    prompts, base = greedy
    root = _bigram_drafter(tmp_path / "d", model, base, prompts)
    eng = _engine(model, _spec(root, 7), caching=False)
    eng.add_request("0", prompts[0], GREEDY)
    out = run_checked(eng)["0"]
    ctx = eng.executor.worker.proposer.contexts["0"]  # held until the next step reports the request finished
    assert eng.stats()["spec_num_accepted_tokens"] > 0
    tokens = list(prompts[0]) + out[:-1]  # the last token was the anchor of the last (unused) block
    assert ctx.positions.tolist() == list(range(len(tokens)))
    one = _engine(model, _spec(root, 7), caching=False)
    one.add_request("0", tokens, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    run_checked(one)
    want = one.executor.worker.proposer.contexts["0"]
    assert want.positions.tolist() == list(range(len(tokens)))
    torch.testing.assert_close(ctx.keys, want.keys, rtol=1e-4, atol=1e-4)
    one.add_request("1", tokens[:5], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    run_checked(one)  # the step that admits "1" reports "0" finished: its context is dropped
    assert "0" not in one.executor.worker.proposer.contexts


def test_standing_rows_become_context_and_the_anchor_follows_them(model):
    """One step of two chunks: a prefill chunk that does not sample (all 4 rows stand) and a verification of 3
    drafts of which 1 is accepted (2 of its 4 rows stand): the context holds exactly the standing positions, and the
    block starts at the position after them with the sampled token."""
    from types import SimpleNamespace

    from rocm_k3.worker.step_io import SampledToken, ScheduledChunk

    cfg = DSparkConfig.from_dict(_config(model))
    fake = SimpleNamespace(tap_layers=(), tap_outputs=False, embed=model.embed, lm_head=model.lm_head, tapped=None)
    proposer = DSparkProposer(DSparkDrafter(cfg), fake, 3)
    assert fake.tap_layers == tuple(TAPS) and fake.tap_outputs
    calls = []
    real = proposer.drafter.propose
    proposer.drafter.propose = lambda ctx, anchor, position, k, embed, head: (
        calls.append((ctx.shape[1], anchor, position, k)) or real(ctx, anchor, position, k, embed, head))
    chunks = (ScheduledChunk("p", (1, 2, 3, 4), 0, True, (), 0, True, False),
              ScheduledChunk("v", (9, 5, 6, 7), 10, False, (), 1, False, True, num_draft=3))
    # "v" has no context yet: its context starts at 10 (a prefix the target did not run, as after a cache hit)
    fake.tapped = torch.randn(8, len(TAPS), cfg.target_hidden_size)
    out = proposer.attach(chunks, (SampledToken("v", 42, None, "", accepted=(5,)),))
    assert proposer.contexts["p"].positions.tolist() == [0, 1, 2, 3]
    assert proposer.contexts["v"].positions.tolist() == [10, 11]
    torch.testing.assert_close(proposer.contexts["v"].keys,
                               proposer.drafter.context(fake.tapped[4:6], torch.tensor([10, 11])))
    assert calls == [(2, 42, 12, 3)] and len(out[0].draft_token_ids) == 3
    # the next verification starts at 12: nothing before it is dropped, the rejected rows never entered
    fake.tapped = torch.randn(2, len(TAPS), cfg.target_hidden_size)
    proposer.attach((ScheduledChunk("v", (42, 8), 12, False, (), 1, False, True, num_draft=1),),
                    (SampledToken("v", 3, None, ""),))
    assert proposer.contexts["v"].positions.tolist() == [10, 11, 12]
    assert calls[-1] == (3, 3, 13, 3)
    proposer.drop("v")
    assert "v" not in proposer.contexts


def test_the_markov_head_chains_each_draft_on_the_previous_one(model, tmp_path):
    """A silent backbone (final_norm 0) leaves only the Markov bias: markov_w2 @ markov_w1[prev] maps token t to
    t + 1, so the drafts after anchor a are a + 1, a + 2, ..."""
    v = model.cfg.vocab_size
    cfg = DSparkConfig.from_dict(_config(model, markov_rank=v))
    drafter = DSparkDrafter(cfg)
    with torch.no_grad():
        drafter.final_norm.weight.zero_()
        drafter.markov_head.markov_w1.weight.copy_(torch.eye(v))
        drafter.markov_head.markov_w2.weight.copy_(torch.roll(torch.eye(v), 1, dims=0))
    ctx = drafter.context(torch.randn(4, len(TAPS), cfg.target_hidden_size), torch.arange(4))
    assert ctx.shape == (cfg.num_hidden_layers, 4, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    drafts = drafter.propose(ctx, 40, 4, 7, model.embed, model.lm_head)
    assert drafts == list(range(41, 48))


# ---- loading: by name, and every problem named -------------------------------------------------------------
def test_loads_by_repo_id_from_the_local_hf_cache(model, tmp_path):
    root = _write(tmp_path / "d", model)
    with override(hf_hub_cache=_fake_hf_cache(tmp_path, root, REPO, COMMIT)):
        proposer = DraftProposer.for_model(SpeculativeConfig(method="draft_model", model=REPO,
                                                             num_speculative_tokens=7), model)
    try:
        assert isinstance(proposer, DSparkProposer) and proposer.k == 7
        assert model.tap_layers == tuple(TAPS) and model.tap_outputs
        want = load_file(str(root / "model.safetensors"))
        got = proposer.drafter.state_dict()
        assert set(got) == set(want) - {"embed_tokens.weight", "confidence_head.proj.weight",
                                        "confidence_head.proj.bias"}
        assert all(torch.equal(got[n], want[n].float()) for n in got)
    finally:
        model.tap_layers, model.tap_outputs = (), False


def _load(root, model):
    cfg = model.cfg
    return load_dspark(root, "draft model 'x'", target_hidden_size=cfg.hidden_size,
                       target_num_hidden_layers=cfg.num_hidden_layers, vocab_size=cfg.vocab_size,
                       device=torch.device("cpu"), dtype=torch.float32)


def test_a_missing_misshapen_or_unexpected_tensor_is_named(model, tmp_path):
    root = _write(tmp_path / "d", model)
    good = load_file(str(root / "model.safetensors"))
    _load(root, model)
    _write(root, model, {n: t for n, t in good.items() if n != "layers.1.self_attn.kv_b_proj.weight"})
    with pytest.raises(ValueError, match=r"missing \['layers.1.self_attn.kv_b_proj.weight'\], unexpected \[\]"):
        _load(root, model)
    _write(root, model, {**good, "markov_head.markov_w2.weight": torch.zeros(model.cfg.vocab_size, 8)})
    with pytest.raises(ValueError, match=r"tensor 'markov_head.markov_w2.weight' has shape \[272, 8\], its "
                                         r"config.json needs \[272, 16\]"):
        _load(root, model)
    _write(root, model, {**good, "layers.0.self_attn.kv_b_proj.weight": torch.zeros(60, 32)})
    with pytest.raises(ValueError, match=r"'layers.0.self_attn.kv_b_proj.weight' has shape \[60, 32\].*\[64, 32\]"):
        _load(root, model)
    _write(root, model, {**good, "layers.2.mlp.up_proj.weight": torch.zeros(96, model.cfg.hidden_size)})
    with pytest.raises(ValueError, match=r"missing \[\], unexpected \['layers.2.mlp.up_proj.weight'\]"):
        _load(root, model)


@pytest.mark.parametrize("overrides, message", [
    ({"mask_token_id": None}, r"missing keys \['mask_token_id'\]"),
    ({"target_layer_ids": [0, 2, 3, 4, 6]}, r"target_layer_ids: expected distinct ascending layer indices in 0..5"),
    ({"target_layer_ids": [3, 2, 4, 5, 0]}, r"target_layer_ids"),
    ({"markov_head_type": "gated"}, r"markov_head_type='gated' is not supported"),
    ({"mla_use_nope": True}, r"mla_use_nope=True is not supported"),
    ({"num_target_layers": 4}, r"num_target_layers=4, but target_layer_ids \[0, 2, 3, 4, 5\] names 5 layers"),
    ({"rope_parameters": {"rope_type": "longrope"}}, r"rope_type 'longrope' is not supported"),
    ({"target_num_hidden_layers": 93, "target_layer_ids": [2, 23, 47, 71, 89]},
     r"target_num_hidden_layers=93 in its config.json, but the target model has 6"),
    ({"hidden_size": 64}, r"hidden_size=64 .* differs from the target's hidden size 128"),
    ({"vocab_size": 300, "draft_vocab_size": 300}, r"vocab_size=300"),
    # JSON allows NaN / Infinity (Python's json reads them): never a NaN RoPE; a YaRN theta of 1 divides by log 1
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": float("nan")}}, r"rope theta"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": float("inf")}}, r"rope factor"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": float("nan")}}, r"rope beta_fast"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "mscale": float("nan")}}, r"rope mscale"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1.0}}, r"rope theta"),
    ({"rope_parameters": None, "rope_theta": float("inf")}, r"rope theta"),
    ({"rms_norm_eps": float("nan")}, r"rms_norm_eps"),
])
def test_a_bad_config_is_named(model, tmp_path, overrides, message):
    root = _write(tmp_path / "d", model)
    raw = {k: v for k, v in _config(model, **overrides).items() if v is not None}
    (root / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=message):
        _load(root, model)


def test_a_shard_outside_the_checkpoint_directory_is_refused(model, tmp_path):
    """The index's shard names and the files' symlinks stay inside the drafter directory (as for the target's
    checkpoint, rocm_k3.checkpoint_io): a weight_map naming ``../`` or a shard linked out of it is refused."""
    outside = _write(tmp_path / "outside", model)
    root = _write(tmp_path / "d", model)
    names = list(load_file(str(root / "model.safetensors")))
    (root / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {n: "../outside/model.safetensors" for n in names}}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"outside the checkpoint directory"):
        _load(root, model)
    (root / "model.safetensors.index.json").unlink()
    (root / "model.safetensors").symlink_to(outside / "model.safetensors")
    with pytest.raises(ValueError, match=r"outside the checkpoint directory"):
        _load(root, model)


def test_a_pipe_for_config_json_is_refused_not_waited_on(model, tmp_path):
    """A named pipe in place of config.json (untrusted input) is a ValueError at once, for the loader and for the
    proposer's pick of the drafter kind: reading it would block until someone writes (bounded here: a thread,
    unblocked by a writer if it hangs)."""
    import os
    import threading

    root = _write(tmp_path / "d", model)
    name = "config.json"
    (root / name).unlink()
    os.mkfifo(root / name)
    spec = SpeculativeConfig(method="draft_model", model=str(root), num_speculative_tokens=2)
    for load in (lambda: _load(root, model), lambda: DraftProposer.for_model(spec, model)):
        result: list[BaseException | None] = []

        def run(load=load):
            try:
                load()
                result.append(None)
            except BaseException as e:  # noqa: BLE001 (handed to the test thread)
                result.append(e)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(timeout=20)
        if thread.is_alive():  # it opened the pipe and waits: unblock it, then fail
            fd = os.open(root / name, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
            thread.join(timeout=20)
            pytest.fail(f"reading a pipe named {name} blocked")
        model.tap_layers, model.tap_outputs = (), False
        assert isinstance(result[0], ValueError) and "not a regular file" in str(result[0]), result


def test_more_drafts_than_the_block_holds_are_refused(model, tmp_path):
    spec = SpeculativeConfig(method="draft_model", model=str(_write(tmp_path / "d", model)), num_speculative_tokens=8)
    with pytest.raises(ValueError, match="num_speculative_tokens=8, but a K3 DSpark drafter drafts at most 7"):
        DraftProposer.for_model(spec, model)


def test_the_tap_drafter_loader_points_at_the_dspark_one(model, tmp_path):
    root = _write(tmp_path / "d", model)
    cfg = model.cfg
    with pytest.raises(ValueError, match=r"a K3 DSpark drafter \(K3DSparkModel\): load_dspark loads it"):
        load_drafter(root, target_hidden_size=cfg.hidden_size, target_num_hidden_layers=cfg.num_hidden_layers,
                     vocab_size=cfg.vocab_size, device=torch.device("cpu"))
    raw = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**raw, "architectures": ["Qwen3DSparkModel"],
                                                  "model_type": "qwen3"}))
    with pytest.raises(ValueError, match=r"'Qwen3DSparkModel'.*a DSpark / DFlash drafter of another layout.*"
                                         r"'K3DSparkModel' \(model_type 'k3_dspark'"):
        load_drafter(root, target_hidden_size=cfg.hidden_size, target_num_hidden_layers=cfg.num_hidden_layers,
                     vocab_size=cfg.vocab_size, device=torch.device("cpu"))


# ---- the drafter's arithmetic against a naive transcription ------------------------------------------------
def _naive_block_attention(attn, x, positions, context, drafter) -> torch.Tensor:
    """DeepSeek MLA written out: keys / values expanded from every latent row, scores over context + block."""
    cfg = attn.cfg
    n, dn, p, r, dv = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank,
                       cfg.v_head_dim)
    q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(-1, n, dn + p)
    angles = positions.float()[:, None] * drafter.inv_freq[None]  # [S, P / 2]
    cos, sin = angles.cos() * drafter.rope_scale, angles.sin() * drafter.rope_scale
    q_pe = torch.empty(q.shape[0], n, p)
    q_pe[..., 0::2] = q[..., dn::2] * cos[:, None] - q[..., dn + 1::2] * sin[:, None]
    q_pe[..., 1::2] = q[..., dn + 1::2] * cos[:, None] + q[..., dn::2] * sin[:, None]
    kv = attn.kv_a_proj_with_mqa(x)
    k_pe = torch.empty(x.shape[0], p)
    k_pe[:, 0::2] = kv[:, r::2] * cos - kv[:, r + 1::2] * sin
    k_pe[:, 1::2] = kv[:, r + 1::2] * cos + kv[:, r::2] * sin
    latent = torch.cat([context, torch.cat([attn.kv_a_layernorm(kv[:, :r]), k_pe], dim=-1)])  # [C + S, R + P]
    expanded = attn.kv_b_proj(latent[:, :r]).view(-1, n, dn + dv)
    keys = torch.cat([expanded[..., :dn], latent[:, None, r:].expand(-1, n, p)], dim=-1)  # [C + S, n, Dn + P]
    scores = torch.einsum("shd,chd->hsc", torch.cat([q[..., :dn], q_pe], dim=-1), keys) * drafter.softmax_scale
    out = torch.einsum("hsc,chd->shd", scores.softmax(-1), expanded[..., dn:]).reshape(x.shape[0], n * dv)
    return attn.o_proj(out)


def test_absorbed_attention_matches_the_expanded_one(model):
    cfg = DSparkConfig.from_dict(_config(model))
    torch.manual_seed(5)
    drafter = DSparkDrafter(cfg)
    for prm in drafter.parameters():
        torch.nn.init.normal_(prm, std=0.3)
    attn = drafter.layers[1].self_attn
    context = drafter.context(torch.randn(11, len(TAPS), cfg.target_hidden_size), torch.arange(11))[1]
    x, positions = torch.randn(8, cfg.hidden_size), torch.arange(300, 308)  # past original_max (256): YaRN range
    with torch.inference_mode():
        got = attn(x, positions, context, drafter.inv_freq, drafter.rope_scale, drafter.softmax_scale)
        want = _naive_block_attention(attn, x, positions, context, drafter)
    assert torch.isfinite(got).all()
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 1e-5, rel  # fp32, same math in another order


def test_yarn_frequencies_and_rope_are_relative():
    """YaRN keeps the fast dims' frequencies, divides the slow dims' by the factor, ramps between; the rotation
    makes q . k depend on the position difference only; mscale follows DeepSeek's 0.1 * m * ln(factor) + 1."""
    from rocm_k3.spec_decode.dspark import apply_rope, rope_inv_freq, yarn_mscale
    from rocm_k3.spec_decode.dspark_config import YarnRope

    rope = YarnRope(theta=50000.0, factor=32.0, original_max_position_embeddings=32768, beta_fast=32, beta_slow=1,
                    mscale=1.0, mscale_all_dim=1.0)
    plain = 1.0 / 50000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    inv = rope_inv_freq(rope, 64).double()
    # correction dims for 32 / 1 rotations over 32768 positions: 15.06 -> 15 and 25.3 -> 26 of the 32 pairs
    assert torch.allclose(inv[:15], plain[:15]) and torch.allclose(inv[26:], plain[26:] / 32)
    assert not torch.allclose(inv[16:25], plain[16:25]) and not torch.allclose(inv[16:25], plain[16:25] / 32)
    assert ((inv <= plain * (1 + 1e-6)) & (inv >= plain / 32 * (1 - 1e-6))).all()
    assert torch.allclose(rope_inv_freq(YarnRope(theta=50000.0), 64).double(), plain)
    assert yarn_mscale(32.0, 1.0) == pytest.approx(0.1 * torch.log(torch.tensor(32.0)).item() + 1)
    q, k = torch.randn(1, 64), torch.randn(1, 64)

    def dot(m: int, n: int) -> float:
        return float((apply_rope(q, torch.tensor([m]), inv.float(), 1.0)
                      * apply_rope(k, torch.tensor([n]), inv.float(), 1.0)).sum())

    assert dot(40, 35) == pytest.approx(dot(1005, 1000), rel=1e-4, abs=1e-4)
    assert dot(40, 35) != pytest.approx(dot(40, 20), rel=1e-3)


@pytest.mark.usefixtures("sigterm_raises")
def test_sigterm_during_a_dspark_verification_then_abort_leaks_nothing(model, greedy, tmp_path):
    """A SIGTERM lands in the executor right after a step that verified DSpark drafts ran: the step is abandoned
    (recomputed), nothing leaks, an abort of one of its requests then goes through, and every other request still
    gets the tokens of decoding without speculation."""
    prompts, base = greedy
    eng = _engine(model, _spec(_write(tmp_path / "d", model), 3))
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, GREEDY)
    verifying = _interrupt_first_verification(eng, "after")
    done = run_until_raised(eng, Terminated)
    assert verifying, "no step verified drafts"
    check_between_steps(eng)
    victim = verifying[0]
    assert eng.abort(victim)
    done.update(run_checked(eng))
    assert victim not in done
    assert done == {r: t for r, t in base.items() if r != victim}
