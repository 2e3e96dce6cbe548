"""Training from scratch (``slow``): a few steps lower the loss and are reproducible; ``rocm-k3 train-tiny`` writes
a checkpoint that ``rocm_k3.LLM`` serves."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from model_fixtures import one_thread  # noqa: F401 (autouse)

import rocm_k3
from rocm_k3.cli import main
from rocm_k3.model.config import ModelConfig
from rocm_k3.tokenizers.byte import embedded_byte_tokenizer
from rocm_k3.training.corpus import CorpusConfig, build_corpus
from rocm_k3.training.export import REPORT_FILE
from rocm_k3.training.loop import TrainConfig, train
from rocm_k3.training.recipe import trained_config

TOKENIZER = embedded_byte_tokenizer()
DOCS = [(f"mod.f{i}", text) for i, text in enumerate((
    "Return the number of items in a container. The result is never negative.",
    "Open the file and read every line of it into a list of strings.",
    "Write the given text to the stream and return the number of characters written.",
    "Close the connection and release every resource that it holds.",
))]


@pytest.mark.slow
def test_a_few_steps_lower_the_loss_reproducibly() -> None:
    corpus = build_corpus(CorpusConfig(seed=0, chats=6, heldout_chats=1, heldout_every=1000), TOKENIZER, DOCS)
    cfg = ModelConfig.from_hf_dict(trained_config())
    config = TrainConfig(seed=0, steps=10, drill_steps=3, batch_tokens=2048, warmup_fraction=0.2, log_every=100)
    runs = [train(cfg, corpus.train, config, TOKENIZER.pad_token_id, log=lambda _line: None, drills=corpus.drills)
            for _ in range(2)]
    first, again = runs
    assert first.losses == again.losses
    assert all(torch.equal(first.params[n], again.params[n]) for n in first.params)
    start, end = sum(first.losses[:3]) / 3, sum(first.losses[-3:]) / 3
    assert end < 0.8 * start, first.losses
    other = train(cfg, corpus.train, dataclasses.replace(config, seed=1, steps=2, drill_steps=0),
                  TOKENIZER.pad_token_id, log=lambda _line: None)
    assert other.losses != first.losses[:2]
    with pytest.raises(ValueError, match="drills"):
        train(cfg, corpus.train, config, TOKENIZER.pad_token_id, log=lambda _line: None)  # no drill rows
    with pytest.raises(ValueError, match="drill_steps"):
        TrainConfig(steps=10, drill_steps=11)


@pytest.mark.slow
def test_train_tiny_command_writes_a_servable_checkpoint(tmp_path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "trained"
    assert main(["train-tiny", str(out), "--steps", "2", "--chats", "8", "--threads", "1", "--no-measure"]) == 0
    assert "wrote the trained tiny K3 checkpoint" in capsys.readouterr().out
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "rocm_k3_tokenizer.json",
                                                REPORT_FILE}
    report = json.loads((out / REPORT_FILE).read_text())
    assert report["recipe"]["train"]["steps"] == 2 and set(report["heldout_nats_per_token"]) == {
        "fp32", "fp32_mxfp4_experts", "checkpoint"}
    llm = rocm_k3.LLM(out, dtype="float32")
    assert llm.config.expert_format == "mxfp4"
    assert len(llm.generate("Hello", rocm_k3.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
               .token_ids) == 3
    assert main(["train-tiny", str(tmp_path / "bad"), "--steps", "0"]) == 2
