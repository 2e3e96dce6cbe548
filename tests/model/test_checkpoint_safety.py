"""A checkpoint directory is untrusted input: the loader opens nothing outside it, never blocks on a file that is
not a regular file, and names the file for every unreadable index, config or tokenizer.

- ``model.safetensors.index.json``: shard names that leave the directory (``..``, absolute, a symlink out) are
  refused before anything is opened; a ``weight_map`` that is not an object of strings is named; an index that
  disagrees with the shards' headers (a tensor in another shard than listed, listed but absent, present but not
  listed) is named. A huggingface_hub cache snapshot (files linking into the repository's ``blobs/``) loads.
- A named pipe, directory or socket in place of a weight, index, config or tokenizer file gets a named error at
  once; each such test runs the loader in a forked child and fails (instead of hanging) if the child is still
  running after a bound, then kills it.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

import pytest
from model_fixtures import one_thread  # noqa: F401 (autouse)

from rocm_k3.model.config import ConfigError, ModelConfig
from rocm_k3.model.loader import CorruptCheckpointError, UnsafePathError, load_model
from rocm_k3.model.tiny import write_tiny_checkpoint
from rocm_k3.tokenizers import HF_TOKENIZER_FILE, TOKENIZER_FILE, TokenizerError, load_tokenizer

INDEX = "model.safetensors.index.json"
BOUND_S = 20.0  # a named error takes milliseconds; a blocked open() never returns


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("sharded"), shards=2)


@pytest.fixture
def sharded(sharded_dir: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(sharded_dir, dst)
    return dst


@pytest.fixture(scope="module")
def single_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("single"))


@pytest.fixture
def single(single_dir: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(single_dir, dst)
    return dst


def _index(root: Path) -> dict:
    return json.loads((root / INDEX).read_text())


def _write_index(root: Path, index: object) -> None:
    (root / INDEX).write_text(json.dumps(index))


def _shards(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("model-*.safetensors"))


def _finishes(fn: Callable[[], object]) -> tuple[str, str] | None:
    """Run ``fn`` in a forked child; fail the test if the child is still running after BOUND_S (a blocked open:
    safetensors opens files without releasing the GIL, so a thread could not be timed out), else return the
    (class name, message) of the exception it raised, None if it returned."""
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)

    def child() -> None:
        try:
            fn()
            send.send(None)
        except BaseException as exc:  # noqa: BLE001 (handed to the test)
            send.send((type(exc).__name__, str(exc)))

    proc = ctx.Process(target=child, daemon=True)
    proc.start()
    ready = recv.poll(BOUND_S)
    if not ready:
        proc.kill()
        proc.join()
        pytest.fail(f"still blocked after {BOUND_S} s: the loader opened a non-regular file")
    result = recv.recv()
    proc.join()
    return result


def _names(error: type[Exception]) -> set[str]:
    """The class and its subclasses' names (the child reports the raised class by name)."""
    out, todo = set(), [error]
    while todo:
        cls = todo.pop()
        out.add(cls.__name__)
        todo += cls.__subclasses__()
    return out


# ------------------------------------------------------------------------------------------------ the index
@pytest.mark.parametrize("kind", ["dotdot", "absolute", "nested-dotdot", "symlink-out", "symlinked-dir-out"])
def test_shard_outside_the_directory_is_refused(sharded: Path, tmp_path: Path, kind: str) -> None:
    """A valid shard placed outside the checkpoint is never read: the index naming it is refused."""
    outside = tmp_path / "outside"
    outside.mkdir()
    first = _shards(sharded)[0]
    shutil.move(sharded / first, outside / first)  # a loadable shard, but outside the checkpoint
    if kind == "dotdot":
        name = f"../outside/{first}"
    elif kind == "absolute":
        name = str(outside / first)
    elif kind == "nested-dotdot":
        (sharded / "sub").mkdir()
        name = f"sub/../../outside/{first}"
    elif kind == "symlink-out":
        (sharded / first).symlink_to(outside / first)
        name = first
    else:
        (sharded / "linked").symlink_to(outside, target_is_directory=True)
        name = f"linked/{first}"
    index = _index(sharded)
    index["weight_map"] = {t: (name if f == first else f) for t, f in index["weight_map"].items()}
    _write_index(sharded, index)
    with pytest.raises(UnsafePathError, match="outside the checkpoint directory") as info:
        load_model(sharded, progress=False)
    assert isinstance(info.value, CorruptCheckpointError) and first in str(info.value)


def test_single_file_symlinked_out_is_refused(single: Path, tmp_path: Path) -> None:
    (tmp_path / "elsewhere.safetensors").write_bytes((single / "model.safetensors").read_bytes())
    (single / "model.safetensors").unlink()
    (single / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(UnsafePathError, match="model.safetensors"):
        load_model(single, progress=False)


def test_config_symlinked_out_is_refused(single: Path, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((single / "config.json").read_text())
    (single / "config.json").unlink()
    (single / "config.json").symlink_to(tmp_path / "config.json")
    with pytest.raises(UnsafePathError, match="config.json"):
        ModelConfig.from_pretrained(single)


def test_huggingface_cache_snapshot_loads(sharded: Path, tmp_path: Path) -> None:
    """huggingface_hub's cache layout: snapshots/<rev>/<file> are symlinks to ../../blobs/<hash>."""
    repo = tmp_path / "models--moonshotai--tiny"
    blobs, snap = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(sharded.iterdir())):
        shutil.copy(f, blobs / f"blob{i}")
        (snap / f.name).symlink_to(Path("../../blobs") / f"blob{i}")
    model = load_model(snap, progress=False)
    assert model.cfg.is_k3


@pytest.mark.parametrize("weight_map, match", [
    ([["a", "b"]], r"'weight_map' must be an object .* got list"),
    ("model-00001-of-00002.safetensors", r"'weight_map' must be an object .* got str"),
    ({"language_model.lm_head.weight": 3}, r"weight_map\['language_model.lm_head.weight'\] must be a shard file "
                                           r"name \(a string\), got int"),
    ({"language_model.lm_head.weight": ["a.safetensors"]}, r"must be a shard file name \(a string\), got list"),
    ({}, r"weight_map is empty"),
], ids=["list", "string", "int-value", "list-value", "empty"])
def test_weight_map_of_the_wrong_type_is_named(sharded: Path, weight_map: object, match: str) -> None:
    _write_index(sharded, {"metadata": {}, "weight_map": weight_map})
    with pytest.raises(CorruptCheckpointError, match=match) as info:
        load_model(sharded, progress=False)
    assert INDEX in str(info.value)


@pytest.mark.parametrize("content, match", [
    (b"[1, 2]", r"expected a JSON object"),
    (b'{"metadata": {}}', r"no 'weight_map'"),
    (b"{not json", r"not valid JSON"),
    (b'{"weight_map": {"\xff\xfe": "x"}}', r"not valid UTF-8"),
], ids=["array", "no-map", "bad-json", "bad-utf8"])
def test_unreadable_index_is_named(sharded: Path, content: bytes, match: str) -> None:
    (sharded / INDEX).write_bytes(content)
    with pytest.raises(CorruptCheckpointError, match=match) as info:
        load_model(sharded, progress=False)
    assert INDEX in str(info.value)


def test_index_naming_the_wrong_shard(sharded: Path) -> None:
    index = _index(sharded)
    a, b = _shards(sharded)
    moved = next(t for t, f in sorted(index["weight_map"].items()) if f == a)
    index["weight_map"][moved] = b
    _write_index(sharded, index)
    with pytest.raises(CorruptCheckpointError, match=rf"{moved}.*index names {b}.*but it is in {a}"):
        load_model(sharded, progress=False)


def test_index_listing_an_absent_tensor(sharded: Path) -> None:
    index = _index(sharded)
    index["weight_map"]["language_model.model.layers.0.self_attn.extra.weight"] = _shards(sharded)[0]
    _write_index(sharded, index)
    with pytest.raises(CorruptCheckpointError, match=r"lists 1 tensors? that no shard holds: "
                                                     r"language_model\.model\.layers\.0\.self_attn\.extra\.weight"):
        load_model(sharded, progress=False)


def test_index_omitting_a_tensor(sharded: Path) -> None:
    index = _index(sharded)
    dropped = sorted(index["weight_map"])[3]
    del index["weight_map"][dropped]
    _write_index(sharded, index)
    with pytest.raises(CorruptCheckpointError, match=rf"does not list 1 tensors? that .* hold: {dropped}"):
        load_model(sharded, progress=False)


# ------------------------------------------------------------------------------ files that are not regular
def _make_special(path: Path, kind: str) -> list[socket.socket]:
    """Put a fifo, directory or socket at ``path``; returns sockets to keep open."""
    if path.exists() or path.is_symlink():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
        return []
    if kind == "directory":
        path.mkdir()
        return []
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    return [sock]


@pytest.mark.parametrize("kind", ["fifo", "directory", "socket"])
def test_weight_file_that_is_not_regular(single: Path, kind: str) -> None:
    keep = _make_special(single / "model.safetensors", kind)
    try:
        exc = _finishes(lambda: load_model(single, progress=False))
    finally:
        for sock in keep:
            sock.close()
    assert exc is not None and exc[0] in _names(CorruptCheckpointError), exc
    assert "model.safetensors" in exc[1] and f"not a regular file ({kind})" in exc[1], exc


def test_shard_named_by_the_index_that_is_a_fifo(sharded: Path) -> None:
    shard = sharded / _shards(sharded)[1]
    _make_special(shard, "fifo")
    exc = _finishes(lambda: load_model(sharded, progress=False))
    assert exc is not None and exc[0] in _names(CorruptCheckpointError), exc
    assert shard.name in exc[1] and "not a regular file (fifo)" in exc[1], exc


@pytest.mark.parametrize("name, error", [("config.json", ConfigError), (INDEX, CorruptCheckpointError)])
def test_config_or_index_that_is_a_fifo(sharded: Path, name: str, error: type[Exception]) -> None:
    _make_special(sharded / name, "fifo")
    exc = _finishes(lambda: load_model(sharded, progress=False))
    assert exc is not None and exc[0] in _names(error) and name in exc[1], exc
    assert "not a regular file (fifo)" in exc[1], exc


@pytest.mark.parametrize("name", [TOKENIZER_FILE, HF_TOKENIZER_FILE])
def test_tokenizer_that_is_a_fifo(single: Path, name: str) -> None:
    (single / TOKENIZER_FILE).unlink()
    _make_special(single / name, "fifo")
    exc = _finishes(lambda: load_tokenizer(single))
    assert exc is not None and exc[0] in _names(TokenizerError) and name in exc[1], exc
    assert "not a regular file (fifo)" in exc[1], exc


# ---------------------------------------------------------------------------- unreadable config / tokenizer
@pytest.mark.parametrize("content, match", [
    (b'{"model_type": "kimi_k3", "x": "\xff"}', "not valid UTF-8"),
    (b'{"model_type": ', "not valid JSON"),
    (b"\xef\xbb\xbf{}", "not valid JSON"),  # a UTF-8 byte-order mark is not JSON either
], ids=["bad-utf8", "truncated-json", "bom"])
def test_unreadable_config_names_the_file(single: Path, content: bytes, match: str) -> None:
    (single / "config.json").write_bytes(content)
    with pytest.raises(ConfigError, match=match) as info:
        load_model(single, progress=False)
    assert str(single / "config.json") in str(info.value)


@pytest.mark.parametrize("content, match", [
    (b'{"type": "byte", "vocab_size": 264, "x": "\xff"}', "not valid UTF-8"),
    (b'{"type": "byte", ', "not valid JSON"),
    (b'["byte"]', "expected a JSON object"),
    (b'{"type": "byte", "vocab_size": "264"}', r"missing field|vocab_size"),
    (b'{"type": "byte", "vocab_size": 264, "merges": []}', r"unknown fields \['merges'\]"),
], ids=["bad-utf8", "bad-json", "array", "string-vocab", "unknown-key"])
def test_unreadable_byte_tokenizer_names_the_file(single: Path, content: bytes, match: str) -> None:
    (single / TOKENIZER_FILE).write_bytes(content)
    with pytest.raises(TokenizerError, match=match) as info:
        load_tokenizer(single)
    assert str(single / TOKENIZER_FILE) in str(info.value)


def test_unreadable_hf_tokenizer_names_the_file(single: Path) -> None:
    pytest.importorskip("tokenizers")
    (single / TOKENIZER_FILE).unlink()
    (single / HF_TOKENIZER_FILE).write_text('{"version": "1.0", "model": 42}')
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        load_tokenizer(single)


def test_config_implying_a_billion_experts_fails_fast(single: Path) -> None:
    """The tensor list a config implies is checked against what the shards hold as it is built, so a hostile
    num_experts cannot make the loader enumerate 10**9 experts."""
    config = json.loads((single / "config.json").read_text())
    config["text_config"]["num_experts"] = 10**9
    (single / "config.json").write_text(json.dumps(config))
    exc = _finishes(lambda: load_model(single, progress=False))
    assert exc is not None and exc[0] == "MissingTensorError", exc
    assert "the config implies more than" in exc[1] and "1000000000 experts" in exc[1], exc
