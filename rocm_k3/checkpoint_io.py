"""Opening the files of a checkpoint directory, which is untrusted input.

Every file rocm-k3 reads from a checkpoint (``config.json``, the safetensors index and shards, the tokenizer
files) goes through this module:

- :func:`member` maps a name to its path and refuses (:class:`UnsafePathError`) a name that is absolute or
  contains ``..``, and a path whose resolved location (every symlink followed) lies outside the directory. The
  one exception is huggingface_hub's cache layout, where ``<repo>/snapshots/<rev>/<file>`` are symlinks into
  ``<repo>/blobs/``: there ``blobs/`` counts as inside.
- :func:`file_kind` / :func:`require_regular` look at ``stat`` before anything is opened: a named pipe would
  block ``open`` forever, and a directory, socket or device is not a checkpoint file.
- :func:`read_text` / :func:`read_json` open with ``O_NONBLOCK`` and check the opened descriptor again
  (``fstat``), so even a file swapped for a pipe after the check cannot block, and decode UTF-8 / JSON, raising
  the caller's error class with the file's path.

safetensors opens shard files itself (memory-mapped), so shards are checked by ``stat`` right before each open;
a file replaced by a pipe between that check and the open is the one case left to the filesystem's owner.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path, PurePosixPath
from typing import Any

from rocm_k3.checkpoint_errors import UnsafePathError

_KINDS = ((stat.S_ISFIFO, "fifo"), (stat.S_ISDIR, "directory"), (stat.S_ISSOCK, "socket"),
          (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"))


def member(root: Path, name: str, what: str = "file") -> Path:
    """``root / name`` after checking that it stays inside ``root`` (see the module docstring).

    ``what`` describes the name in the error (e.g. "shard named by model.safetensors.index.json").
    """
    if not isinstance(name, str) or not name or "\x00" in name:
        raise UnsafePathError(f"{what} {name!r}: expected a non-empty file name")
    pure = PurePosixPath(name)
    if pure.is_absolute() or ".." in pure.parts or "\\" in name:
        raise UnsafePathError(
            f"{what} {name!r} is outside the checkpoint directory {root} (absolute, or it uses '..'); shard "
            "names must be plain file names inside the directory"
        )
    path = root / name
    real = Path(os.path.realpath(path))
    allowed = _allowed_roots(Path(os.path.realpath(root)))
    if not any(real == r or real.is_relative_to(r) for r in allowed):
        raise UnsafePathError(
            f"{what} {name!r} resolves to {real}, outside the checkpoint directory {root} (a symlink out of "
            "it); copy the file into the checkpoint directory"
        )
    return path


def _allowed_roots(root: Path) -> tuple[Path, ...]:
    """The resolved checkpoint directory, plus ``<repo>/blobs`` for a huggingface_hub cache snapshot."""
    blobs = root.parent.parent / "blobs"
    if root.parent.name == "snapshots" and blobs.is_dir():
        return root, Path(os.path.realpath(blobs))
    return (root,)


def file_kind(path: Path) -> str | None:
    """``"file"`` for a regular file (symlinks followed), None when nothing is there, else its kind."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    return _kind(mode)


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    return next((name for test, name in _KINDS if test(mode)), "special file")


def require_regular(path: Path, error: type[Exception]) -> bool:
    """True for a regular file, False when ``path`` does not exist; raises ``error`` for any other kind."""
    kind = file_kind(path)
    if kind is None:
        return False
    if kind != "file":
        raise error(f"{path}: not a regular file ({kind}); a checkpoint file must be a plain file")
    return True


def read_text(path: Path, error: type[Exception]) -> str:
    """The UTF-8 text of a regular file, read without ever blocking on a pipe; ``error`` names the path."""
    data = read_bytes(path, error)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from exc


def read_bytes(path: Path, error: type[Exception]) -> bytes:
    """The bytes of a regular file, read without ever blocking on a pipe; ``error`` names the path."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise error(f"{path}: cannot open ({exc.strerror or exc})") from exc
    try:
        kind = _kind(os.fstat(fd).st_mode)
        if kind != "file":
            raise error(f"{path}: not a regular file ({kind}); a checkpoint file must be a plain file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read()
    except OSError as exc:
        raise error(f"{path}: cannot read ({exc.strerror or exc})") from exc
    finally:
        os.close(fd)
    return data


def read_json(path: Path, error: type[Exception]) -> Any:
    """The parsed JSON of a regular file (see :func:`read_text`); ``error`` names the path."""
    text = read_text(path, error)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from exc
