"""The ``draft_model`` method: the drafter shipped beside the embedded tiny K3 (``embedded-drafter``) is accepted
(a measured property of the committed weights), a draft checkpoint is validated when it loads, and the method is
refused where it cannot run. Greedy identity, no overshoot and seeded reproducibility with the drafter are in
``test_spec_decode.py`` (parametrized over both methods)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rocm_k3.distributed.context import ParallelConfig
from rocm_k3.model.config import ModelConfig
from rocm_k3.model.tiny import ensure_embedded_model
from rocm_k3.spec_decode.config import EMBEDDED_DRAFTER, SpeculativeConfig
from rocm_k3.spec_decode.drafter import (CONFIG_FILE, EMBEDDED_DRAFTER_DIR, WEIGHTS_FILE, DrafterConfig, TapDrafter,
                                         load_drafter, resolve_drafter_path, save_drafter)
from rocm_k3.training.drafter import acceptance_prompts, measure_acceptance
from rocm_k3.settings import Settings, override
from rocm_k3.worker.worker import WorkerConfig
from tests.model_fixtures import one_thread  # noqa: F401 (autouse: one intra-op thread for tiny matmuls)

MIN_MEAN_ACCEPTED = 1.3  # the bar for the embedded drafter


@pytest.fixture(scope="module")
def target_cfg() -> ModelConfig:
    return ModelConfig.from_pretrained(ensure_embedded_model())


def _load(path, cfg: ModelConfig, revision: str | None = None) -> TapDrafter:
    return load_drafter(path, target_hidden_size=cfg.hidden_size, target_num_hidden_layers=cfg.num_hidden_layers,
                        vocab_size=cfg.vocab_size, device=torch.device("cpu"), revision=revision)


def test_the_embedded_drafter_is_small_and_loads(target_cfg):
    size = sum(f.stat().st_size for f in EMBEDDED_DRAFTER_DIR.iterdir() if f.is_file())
    assert size < 1_000_000, size
    drafter = _load(EMBEDDED_DRAFTER, target_cfg)
    assert drafter.cfg.tap_layer_ids[-1] <= target_cfg.num_hidden_layers


def test_the_embedded_drafter_accepts_more_than_1_3_tokens_per_step():
    stats = measure_acceptance(ensure_embedded_model(), EMBEDDED_DRAFTER, k=3, prompts=acceptance_prompts())
    mean = stats["spec_mean_accepted_length"]
    print(f"embedded drafter, k=3, {len(acceptance_prompts())} prompts: mean accepted tokens per step {mean:.3f}, "
          f"acceptance rate {stats['spec_acceptance_rate']:.3f}, per position "
          f"{[round(stats[f'spec_acceptance_rate_pos{j}'], 3) for j in range(3)]}")
    assert stats["spec_num_drafts"] > 50
    assert mean > MIN_MEAN_ACCEPTED, stats


def _written(tmp_path, cfg: ModelConfig, **overrides):
    dcfg = DrafterConfig(**{"tap_layer_ids": (2, 6), "target_hidden_size": cfg.hidden_size,
                            "target_num_hidden_layers": cfg.num_hidden_layers, "vocab_size": cfg.vocab_size,
                            "hidden_size": 16, **overrides})
    return save_drafter(TapDrafter(dcfg), tmp_path / "d")


def test_a_written_drafter_round_trips(tmp_path, target_cfg):
    root = _written(tmp_path, target_cfg)
    drafter = _load(root, target_cfg)
    taps = torch.randn(3, 2, target_cfg.hidden_size)
    drafts = drafter.propose(taps, torch.tensor([1, 2, 3]), 4)
    assert drafts.shape == (3, 4) and drafts.dtype == torch.int64


@pytest.mark.parametrize("overrides, message", [
    ({"target_hidden_size": 64}, "target_hidden_size=64"),
    ({"vocab_size": 300}, "vocab_size=300"),
    ({"target_num_hidden_layers": 8, "tap_layer_ids": (2, 8)}, r"tap_layer_ids \[2, 8\].* depths \[8\] outside"),
    ({"target_num_hidden_layers": 8, "tap_layer_ids": (2, 5)}, "target_num_hidden_layers=8"),
])
def test_a_drafter_for_another_target_is_refused(tmp_path, target_cfg, overrides, message):
    root = _written(tmp_path, target_cfg, **overrides)
    with pytest.raises(ValueError, match=message):
        _load(root, target_cfg)


def test_bad_drafter_files_are_named(tmp_path, target_cfg):
    with pytest.raises(ValueError, match="train-tiny-drafter"):
        _load(tmp_path / "missing", target_cfg)
    root = _written(tmp_path, target_cfg)
    tensors = load_file(str(root / WEIGHTS_FILE))
    tensors["head.weight"] = tensors["head.weight"][:, :8].contiguous()
    save_file(tensors, str(root / WEIGHTS_FILE))
    with pytest.raises(ValueError, match="'head.weight' has shape"):
        _load(root, target_cfg)
    del tensors["head.bias"]
    save_file(tensors, str(root / WEIGHTS_FILE))
    with pytest.raises(ValueError, match=r"missing \['head.bias'\]"):
        _load(root, target_cfg)
    raw = json.loads((root / CONFIG_FILE).read_text())
    (root / CONFIG_FILE).write_text(json.dumps({**raw, "tap_layer_ids": [6, 2]}))
    with pytest.raises(ValueError, match="tap_layer_ids"):
        _load(root, target_cfg)
    (root / CONFIG_FILE).write_text(json.dumps({k: v for k, v in raw.items() if k != "hidden_size"}))
    with pytest.raises(ValueError, match=r"missing keys \['hidden_size'\]"):
        _load(root, target_cfg)
    (root / CONFIG_FILE).write_text("{oops")
    with pytest.raises(ValueError, match="not valid JSON"):
        _load(root, target_cfg)


def test_draft_model_with_pipeline_parallelism_is_refused():
    """Refused at the boundary (EngineArgs, so LLM / generate / serve name it before any process starts) and in
    the worker's config; n-gram speculation is not refused with pipeline stages."""
    from rocm_k3.args import EngineArgs
    from rocm_k3.engine.llm import LLM

    combo = r"method 'draft_model' with pipeline_parallel_size=2 is not supported"
    spec = SpeculativeConfig(method="draft_model", model=EMBEDDED_DRAFTER, num_speculative_tokens=3)
    with pytest.raises(ValueError, match=combo):
        WorkerConfig(model_path=ensure_embedded_model(), dtype=torch.float32, device=torch.device("cpu"),
                     parallel=ParallelConfig(pipeline_parallel_size=2), speculative=spec)
    raw = {"method": "draft_model", "model": EMBEDDED_DRAFTER, "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match=combo):
        EngineArgs(pipeline_parallel_size=2, speculative_config=json.dumps(raw)).validated()
    with pytest.raises(ValueError, match=combo):
        LLM(dtype="float32", device="cpu", pipeline_parallel_size=2, speculative_config=raw)
    EngineArgs(pipeline_parallel_size=2, speculative_config={"method": "ngram"}).validated()
    EngineArgs(pipeline_parallel_size=1, speculative_config=raw).validated()


def test_generate_shows_the_acceptance_out_of_the_box(capsys):
    from rocm_k3.cli import main

    spec = json.dumps({"method": "draft_model", "model": EMBEDDED_DRAFTER, "num_speculative_tokens": 3})
    assert main(["generate", "--speculative-config", spec, "--max-tokens", "24", "--dtype", "float32",
                 "--backend", "reference", "The file"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("speculative decoding:"))
    assert "mean accepted tokens per step" in line
    assert float(line.rsplit(" ", 1)[1]) > 1.0, line


def test_requests_with_penalties_speculate_with_the_drafter():
    from rocm_k3.engine.llm import LLM
    from rocm_k3.sampling_params import SamplingParams

    prompts = acceptance_prompts()[:2]
    params = SamplingParams(temperature=0.0, max_tokens=16, presence_penalty=0.5, repetition_penalty=1.2)
    outs = []
    for spec in (None, {"method": "draft_model", "model": EMBEDDED_DRAFTER, "num_speculative_tokens": 3}):
        llm = LLM(ensure_embedded_model(), dtype="float32", backend="reference", speculative_config=spec)
        outs.append(([o.token_ids for o in llm.generate(prompts, params)], llm.stats()))
    (base, _), (spec_out, stats) = outs
    assert spec_out == base
    assert stats["spec_num_drafts"] > 0 and stats["spec_num_accepted_tokens"] > 0, stats


def test_fit_drafter_is_seeded():
    from rocm_k3.training.drafter import DrafterRecipe, fit_drafter

    cfg = DrafterConfig(tap_layer_ids=(1, 2), target_hidden_size=8, target_num_hidden_layers=2, vocab_size=11,
                        hidden_size=8)
    gen = torch.Generator().manual_seed(3)
    taps, inputs = torch.randn(64, 2, 8, generator=gen), torch.randint(0, 11, (64, 3), generator=gen)
    targets = torch.randint(0, 11, (64, 3), generator=gen)
    recipe = DrafterRecipe(steps=5, batch=16, unroll=3)
    runs = [fit_drafter(cfg, taps, inputs, targets, recipe, log=lambda _: None) for _ in range(2)]
    assert runs[0][1] == runs[1][1]
    for (n, a), b in zip(runs[0][0].state_dict().items(), runs[1][0].state_dict().values()):
        assert torch.equal(a, b), n


# ---- draft checkpoints by name: a Hugging Face repo id in the local cache (offline) ----------------------------
REPO = "acme/k3-tiny-drafter"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _fake_hf_cache(tmp_path, source, repo_id: str = REPO, commit: str = COMMIT) -> Path:
    """huggingface_hub's cache layout with ``source``'s files as the snapshot of ``repo_id`` at ``commit`` (branch
    main): ``models--acme--k3-tiny-drafter/{refs/main, blobs/<file>, snapshots/<commit>/<file> -> ../../blobs/<file>}``."""
    hub = tmp_path / "hub"
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    (repo / "refs").mkdir(parents=True)
    (repo / "blobs").mkdir()
    snap.mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    for f in (p.name for p in Path(source).iterdir() if p.is_file()):
        shutil.copyfile(Path(source) / f, repo / "blobs" / f)
        (snap / f).symlink_to(Path("..") / ".." / "blobs" / f)
    return hub


def test_a_drafter_loads_by_repo_id_from_the_local_hf_cache(tmp_path, target_cfg):
    hub = _fake_hf_cache(tmp_path, _written(tmp_path, target_cfg))
    with override(hf_hub_cache=hub):
        assert resolve_drafter_path(REPO) == hub / ("models--" + REPO.replace("/", "--")) / "snapshots" / COMMIT
        assert resolve_drafter_path(REPO, COMMIT) == resolve_drafter_path(REPO, "main")
        drafter = _load(REPO, target_cfg)
    want = load_file(str(tmp_path / "d" / WEIGHTS_FILE))
    assert all(torch.equal(drafter.state_dict()[n], t.float()) for n, t in want.items())


def test_hf_cache_location_follows_huggingface_hubs_environment(tmp_path):
    assert Settings.from_env({"HF_HUB_CACHE": str(tmp_path / "a")}).hf_hub_cache == tmp_path / "a"
    assert Settings.from_env({"HF_HOME": str(tmp_path / "h")}).hf_hub_cache == tmp_path / "h" / "hub"
    assert Settings.from_env({"XDG_CACHE_HOME": str(tmp_path)}).hf_hub_cache == tmp_path / "huggingface" / "hub"


def test_a_draft_model_by_repo_id_speculates_end_to_end(tmp_path):
    from rocm_k3.engine.llm import LLM
    from rocm_k3.sampling_params import SamplingParams

    hub = _fake_hf_cache(tmp_path, EMBEDDED_DRAFTER_DIR)
    with override(hf_hub_cache=hub):
        llm = LLM(ensure_embedded_model(), dtype="float32", speculative_config={
            "method": "draft_model", "model": REPO, "revision": "main", "num_speculative_tokens": 3})
        llm.generate(["The cat sat on the mat. The cat sat on the"], SamplingParams(temperature=0.0, max_tokens=16))
        stats = llm.stats()
    assert stats["spec_num_draft_tokens"] > 0 and stats["spec_num_accepted_tokens"] > 0, stats


def test_a_missing_draft_model_names_where_it_looked(tmp_path, target_cfg):
    hub = _fake_hf_cache(tmp_path, _written(tmp_path, target_cfg))
    with override(hf_hub_cache=hub):
        with pytest.raises(ValueError, match=r"'acme/other'.*no directory at .*acme/other.*Hugging Face cache "
                                             r".*models--acme--other"):
            _load("acme/other", target_cfg)
        with pytest.raises(ValueError, match="at revision 'v9'"):
            _load(REPO, target_cfg, revision="v9")
    with pytest.raises(ValueError, match="revision"):
        SpeculativeConfig(method="ngram", revision="main")


def test_a_checkpoint_of_another_drafter_architecture_is_refused_by_name(tmp_path, target_cfg):
    root = _written(tmp_path, target_cfg)
    raw = json.loads((root / CONFIG_FILE).read_text())
    (root / CONFIG_FILE).write_text(json.dumps({**raw, "architectures": ["DSparkForCausalLM"]}))
    with override(hf_hub_cache=_fake_hf_cache(tmp_path, root)):
        with pytest.raises(ValueError, match=r"'acme/k3-tiny-drafter'.*architectures.*'DSparkForCausalLM'"):
            _load(REPO, target_cfg)


@pytest.mark.parametrize("config, missing", [
    # config.json fields of the released K3 DSpark drafters as public serving code reads them (TokenSpeed's
    # KimiK3DSparkConfig: model_type k3_dspark, sometimes without an architectures field), short of the rest
    ({"model_type": "k3_dspark", "hidden_size": 7168, "num_hidden_layers": 5, "target_layer_ids": [2, 23, 47, 71, 89],
      "num_target_layers": 5, "markov_rank": 256, "markov_head_type": "vanilla", "vocab_size": 163840},
     "'intermediate_size', 'num_attention_heads', 'q_lora_rank'"),
    ({"architectures": ["K3DSparkModel"], "model_type": "k3_dspark", "target_layer_ids": [2, 23, 47, 71, 89]},
     "'hidden_size', 'intermediate_size'"),
], ids=["model-type-only", "architectures"])
def test_a_k3_dspark_config_short_of_its_keys_names_them(tmp_path, target_cfg, config, missing):
    """A K3 DSpark checkpoint by repo id goes to the DSpark loader (tests/engine/test_spec_dspark.py), which names
    the config keys it lacks before any weight file is read; load_drafter points at that loader."""
    from rocm_k3.spec_decode.dspark_load import load_dspark

    root = tmp_path / "Kimi-K3-DSpark"
    root.mkdir()
    (root / CONFIG_FILE).write_text(json.dumps(config))
    (root / WEIGHTS_FILE).write_bytes(b"not read")  # refused on the config alone
    with override(hf_hub_cache=_fake_hf_cache(tmp_path, root)):
        with pytest.raises(ValueError, match=r"'acme/k3-tiny-drafter': a K3 DSpark drafter \(K3DSparkModel\): "
                                             r"load_dspark loads it"):
            _load(REPO, target_cfg)
        with pytest.raises(ValueError, match=r"'acme/k3-tiny-drafter': DSpark config: missing keys \[" + missing):
            load_dspark(resolve_drafter_path(REPO), f"draft model {REPO!r}", target_hidden_size=target_cfg.hidden_size,
                        target_num_hidden_layers=target_cfg.num_hidden_layers, vocab_size=target_cfg.vocab_size,
                        device=torch.device("cpu"), dtype=torch.float32)
