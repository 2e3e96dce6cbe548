"""The ``rocm-k3 make-tiny`` and ``rocm-k3 generate`` commands (in process, and README's command end to end)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from model_fixtures import one_thread  # noqa: F401 (autouse)

from rocm_k3.cli import main
from rocm_k3.model.tiny import embedded_name
from rocm_k3.settings import override
from rocm_k3.tokenizers import TOKENIZER_FILE

REPO = Path(__file__).resolve().parents[1]


def test_make_tiny_then_generate(tmp_path, capsys: pytest.CaptureFixture) -> None:
    ckpt = tmp_path / "tiny"
    assert main(["make-tiny", str(ckpt), "--shards", "2"]) == 0
    assert "wrote the tiny K3 checkpoint" in capsys.readouterr().out
    assert (ckpt / "model.safetensors.index.json").is_file() and (ckpt / TOKENIZER_FILE).is_file()
    assert main(["generate", "--model", str(ckpt), "--max-tokens", "4", "--show-ids", "Hello", "World"]) == 0
    out = capsys.readouterr().out
    assert out.count("output: ") == 2 and "prompt: 'World'" in out and "finish_reason=length" in out
    assert out.count("token ids: [") == 2
    assert main(["make-tiny", str(ckpt)]) == 0  # rewriting as one file drops the shards and their index
    assert sorted(p.name for p in ckpt.glob("*.safetensors")) == ["model.safetensors"]
    assert main(["generate", "--model", str(ckpt), "--max-tokens", "2", "Hello"]) == 0


def test_generate_token_ids_without_tokenizer(tmp_path, capsys: pytest.CaptureFixture) -> None:
    ckpt = tmp_path / "bare"
    assert main(["make-tiny", str(ckpt)]) == 0
    (ckpt / TOKENIZER_FILE).unlink()
    assert main(["generate", "--model", str(ckpt), "--token-ids", "--max-tokens", "3", "72,105"]) == 0
    assert "token ids: [" in capsys.readouterr().out


def test_generate_reports_errors(tmp_path, capsys: pytest.CaptureFixture) -> None:
    with override(cache_dir=tmp_path):
        rc = main(["generate", "--max-model-len", "3", "a long prompt"])
    assert rc == 2
    assert "exceed max_model_len=3" in capsys.readouterr().err
    assert (tmp_path / embedded_name() / "config.json").is_file()  # the embedded model was installed on first use


def test_readme_command_on_a_fresh_cache(tmp_path) -> None:
    """``rocm-k3 generate "Hello"`` with an empty cache directory: installs the embedded model and generates."""
    env = dict(os.environ, ROCM_K3_CACHE_DIR=str(tmp_path), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "rocm_k3.cli", "generate", "Hello", "--max-tokens", "4"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "prompt: 'Hello'" in proc.stdout and "output: " in proc.stdout


def test_generate_engine_flags(tmp_path, capsys: pytest.CaptureFixture) -> None:
    """Engine knobs reach the LLM: caching off gives the same greedy text as on; a bad block size is named."""
    with override(cache_dir=tmp_path):
        assert main(["generate", "--max-tokens", "4", "--max-num-seqs", "4", "Hi", "Hello"]) == 0
        cached = capsys.readouterr().out
        assert main(["generate", "--max-tokens", "4", "--no-prefix-caching", "Hi", "Hello"]) == 0
        assert capsys.readouterr().out == cached
        assert main(["generate", "--block-size", "48", "Hi"]) == 2
    assert "match_unit=64 must divide block_size=48" in capsys.readouterr().err
