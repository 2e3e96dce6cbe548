"""``rocm-k3 train-tiny-drafter``: a short seeded run on the embedded tiny K3 lowers the drafter's loss and writes a
drafter that loads and drafts."""

from __future__ import annotations

import json

import torch

from rocm_k3.cli import main
from rocm_k3.model.config import ModelConfig
from rocm_k3.model.tiny import ensure_embedded_model
from rocm_k3.spec_decode.drafter import CONFIG_FILE, WEIGHTS_FILE, load_drafter
from rocm_k3.training.drafter import REPORT_FILE


def test_a_short_seeded_run_lowers_the_loss_and_writes_a_drafter(tmp_path, capsys):
    out = tmp_path / "drafter"
    assert main(["train-tiny-drafter", str(out), "--steps", "40", "--prompts", "6", "--max-new-tokens", "24",
                 "--threads", "1", "--no-measure"]) == 0
    report = json.loads((out / REPORT_FILE).read_text())
    print(f"drafter loss {report['loss_first_tenth']:.3f} -> {report['loss_last_tenth']:.3f}")
    assert report["loss_last_tenth"] < report["loss_first_tenth"] - 0.5, report
    assert (out / CONFIG_FILE).is_file() and (out / WEIGHTS_FILE).stat().st_size < 1_000_000
    cfg = ModelConfig.from_pretrained(ensure_embedded_model())
    drafter = load_drafter(out, target_hidden_size=cfg.hidden_size, target_num_hidden_layers=cfg.num_hidden_layers,
                           vocab_size=cfg.vocab_size, device=torch.device("cpu"))
    assert drafter.cfg.tap_layer_ids == tuple(report["recipe"]["tap_layer_ids"])
    assert "wrote the drafter" in capsys.readouterr().out


def test_bad_arguments_exit_2(tmp_path, capsys):
    assert main(["train-tiny-drafter", str(tmp_path / "bad"), "--steps", "0"]) == 2
    assert "steps" in capsys.readouterr().err
