"""The ``rocm-k3 make-tiny`` and ``rocm-k3 generate`` commands (in process, and README's command end to end), and
every expected error as a user sees it: ``python -m rocm_k3.cli`` in a subprocess, one line on stderr naming the
problem and a fix, exit status 2, no traceback unless ``--debug`` / ``ROCM_K3_LOG_LEVEL=debug``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from model_fixtures import one_thread  # noqa: F401 (autouse)

from rocm_k3.cli import main
from rocm_k3.model.tiny import embedded_name
from rocm_k3.settings import override
from rocm_k3.tokenizers import TOKENIZER_FILE

REPO = Path(__file__).resolve().parents[2]


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


# ------------------------------------------------------------------------------------------- errors, as a user
def _cli(*args: str, cache: Path, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m rocm_k3.cli ARGS`` in a fresh interpreter with ROCM_K3_CACHE_DIR = ``cache``."""
    full = dict(os.environ, ROCM_K3_CACHE_DIR=str(cache), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    full.pop("ROCM_K3_LOG_LEVEL", None)
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "rocm_k3.cli", *args], cwd=cache.parent, env=full,
                          capture_output=True, text=True, timeout=timeout, check=False)


def _one_error_line(proc: subprocess.CompletedProcess, command: str) -> str:
    """The run failed with status 2 and one error line (the last line of stderr), no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("rocm-k3 ")]
    assert len(errors) == 1 and errors[0] == lines[-1], proc.stderr[-2000:]
    assert errors[0].startswith(f"rocm-k3 {command}: error: "), errors[0]
    return errors[0]


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rocm_k3.model.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("cli") / "tiny")


@pytest.mark.parametrize("backend", ["triton", "aiter"])
def test_backend_that_cannot_run_here(tiny_ckpt: Path, tmp_path: Path, backend: str) -> None:
    if backend == "triton" and torch.cuda.is_available():
        pytest.skip("triton runs on this machine")
    line = _one_error_line(_cli("generate", "--model", str(tiny_ckpt), "--backend", backend, "Hi", cache=tmp_path),
                           "generate")
    assert f"backend '{backend}' cannot" in line and "--backend" in line and "rocm-k3 ops" in line


@pytest.mark.parametrize("how", ["--debug", "--debug-after", "ROCM_K3_LOG_LEVEL=debug"])
def test_debug_shows_the_traceback(tiny_ckpt: Path, tmp_path: Path, how: str) -> None:
    args = ["generate", "--model", str(tiny_ckpt), "--backend", "aiter", "Hi"]
    env = {}
    if how == "--debug":
        args = ["--debug", *args]
    elif how == "--debug-after":
        args = [*args[:1], "--debug", *args[1:]]
    else:
        env["ROCM_K3_LOG_LEVEL"] = "debug"
    proc = _cli(*args, cache=tmp_path, env=env)
    assert proc.returncode != 0 and "Traceback (most recent call last)" in proc.stderr
    assert "BackendError: backend 'aiter' cannot" in proc.stderr


def test_bad_setting_is_one_line(tmp_path: Path) -> None:
    line = _one_error_line(_cli("generate", "Hi", cache=tmp_path, env={"ROCM_K3_LOG_LEVEL": "loud"}), "generate")
    assert "ROCM_K3_LOG_LEVEL='LOUD'" in line


def test_cache_dir_that_is_a_file(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.write_text("not a directory")
    line = _one_error_line(_cli("generate", "Hi", cache=cache), "generate")
    assert f"cache directory {cache}" in line and "ROCM_K3_CACHE_DIR" in line


@pytest.fixture
def read_only_dir(tmp_path: Path):
    """A directory nobody can create files in: chmod 0o555, or (root ignores modes) the immutable attribute."""
    ro = tmp_path / "ro-cache"
    ro.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o555)
        yield ro
        ro.chmod(0o755)
        return
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(ro)], check=False).returncode:
        pytest.skip("running as root without a working chattr: no way to make a directory read-only")
    try:
        yield ro
    finally:
        subprocess.run(["chattr", "-i", str(ro)], check=False)


def test_cache_dir_that_is_read_only(read_only_dir: Path) -> None:
    line = _one_error_line(_cli("generate", "Hi", cache=read_only_dir), "generate")
    assert f"cache directory {read_only_dir}" in line and "ROCM_K3_CACHE_DIR" in line


@pytest.mark.parametrize("damage", ["config-only", "truncated-weights", "no-tokenizer"])
def test_stale_partial_embedded_model_is_rebuilt(tmp_path: Path, damage: str) -> None:
    """A build without its completion marker (interrupted, or damaged later) is rebuilt, not loaded."""
    from rocm_k3.model.tiny import COMPLETE_MARKER, write_tiny_checkpoint

    cache = tmp_path / "cache"
    stale = cache / embedded_name()
    if damage == "config-only":
        stale.mkdir(parents=True)
        (stale / "config.json").write_text((write_tiny_checkpoint(tmp_path / "ref") / "config.json").read_text())
    else:
        write_tiny_checkpoint(stale)  # what an interrupted or older build left: no marker
        if damage == "truncated-weights":
            data = (stale / "model.safetensors").read_bytes()
            (stale / "model.safetensors").write_bytes(data[: len(data) // 3])
        else:
            (stale / TOKENIZER_FILE).unlink()
    proc = _cli("generate", "Hi", "--max-tokens", "2", cache=cache)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "prompt: 'Hi'" in proc.stdout and "token ids" not in proc.stdout  # decoded text: the tokenizer is back
    assert (stale / COMPLETE_MARKER).is_file() and (stale / "model.safetensors").stat().st_size > 1_000_000
    assert sorted(p.name for p in cache.iterdir()) == [embedded_name()]  # no temporary or stale leftovers


def test_make_tiny_shards_bounded(tmp_path: Path) -> None:
    out = tmp_path / "many"
    line = _one_error_line(_cli("make-tiny", str(out), "--shards", "100000", cache=tmp_path), "make-tiny")
    assert "shards: expected an int in [1, " in line and "100000" in line
    assert not out.exists() or not any(out.iterdir())  # nothing written


def test_make_tiny_into_a_file(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    line = _one_error_line(_cli("make-tiny", str(target / "sub"), cache=tmp_path), "make-tiny")
    assert str(target) in line


def test_bad_checkpoint_config_is_one_line(tiny_ckpt: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(tiny_ckpt, bad)
    config = json.loads((bad / "config.json").read_text())
    config["text_config"]["num_shared_experts"] = "2"
    (bad / "config.json").write_text(json.dumps(config))
    line = _one_error_line(_cli("generate", "--model", str(bad), "Hi", cache=tmp_path), "generate")
    assert "num_shared_experts: expected an integer, got '2' (str)" in line
