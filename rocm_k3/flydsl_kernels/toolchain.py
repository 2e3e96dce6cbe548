"""Compile FlyDSL launchers for gfx942/gfx950 on a machine without an AMD GPU, and collect their ISA.

FlyDSL takes its compile options from environment variables that it re-reads on every compile
(``flydsl.utils.env``): ``COMPILE_ONLY`` (trace and lower, never launch), ``ARCH`` (target chip),
``ROCM_PATH`` (it links with ``$ROCM_PATH/llvm/bin/ld.lld``), ``FLYDSL_DEBUG_DUMP_ASM`` and
``FLYDSL_DUMP_DIR`` (write the final ISA listing). There is no API to pass them, so this module is
the ONE place in rocm-k3 that writes ``os.environ``: :func:`flydsl_compile_env` sets exactly those
variables for the duration of one compile, under a lock, and restores the previous values afterwards.
rocm-k3's own reading of ``COMPILE_ONLY``/``ARCH``/``ROCM_PATH`` goes through ``rocm_k3.settings``.

``ROCM_PATH`` for compile-only runs: a ROCm install is not needed, only an ``ld.lld`` that understands
AMDGPU code objects. Debian's ``lld-19`` works (PLATFORM.md); :func:`toolchain_root` uses
``settings.rocm_path`` if it holds ``llvm/bin/ld.lld`` and otherwise builds a folder
``<cache_dir>/flydsl-toolchain/llvm/bin/ld.lld -> /usr/lib/llvm-19/bin/ld.lld``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rocm_k3.flydsl_kernels.isa import KernelIsa, read_isa_dir
from rocm_k3.settings import get_settings

TARGET_ARCHES = ("gfx942", "gfx950")
DEBIAN_LLD = Path("/usr/lib/llvm-19/bin/ld.lld")

_env_lock = threading.Lock()


class ToolchainError(RuntimeError):
    """No usable linker for compile-only builds, or a compile produced no ISA."""


def find_lld() -> Path | None:
    """The ``ld.lld`` used for compile-only links: ``$ROCM_PATH/llvm/bin/ld.lld``, else Debian's lld-19."""
    rocm = get_settings().rocm_path
    if rocm is not None and (rocm / "llvm" / "bin" / "ld.lld").exists():
        return rocm / "llvm" / "bin" / "ld.lld"
    if DEBIAN_LLD.exists():
        return DEBIAN_LLD
    return None


def toolchain_root() -> Path:
    """A folder laid out as FlyDSL expects ``ROCM_PATH`` (``llvm/bin/ld.lld``), created on first use."""
    rocm = get_settings().rocm_path
    if rocm is not None and (rocm / "llvm" / "bin" / "ld.lld").exists():
        return rocm
    if not DEBIAN_LLD.exists():
        raise ToolchainError(
            f"no ld.lld for FlyDSL compile-only links: ROCM_PATH={rocm} has no llvm/bin/ld.lld and "
            f"{DEBIAN_LLD} is missing (install Debian's lld-19: scripts/ensure_lld.sh)"
        )
    root = get_settings().cache_dir / "flydsl-toolchain"
    link = root / "llvm" / "bin" / "ld.lld"
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        tmp = link.with_name(f"ld.lld.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(DEBIAN_LLD)
        tmp.replace(link)
    return root


@contextlib.contextmanager
def flydsl_compile_env(arch: str, dump_dir: Path) -> Iterator[None]:
    """Set FlyDSL's compile-only variables for one compile (see module docstring), then restore them."""
    if arch not in TARGET_ARCHES:
        raise ValueError(f"arch must be one of {TARGET_ARCHES}, got {arch!r}")
    values = {
        "COMPILE_ONLY": "1",
        "ARCH": arch,
        "ROCM_PATH": str(toolchain_root()),
        "FLYDSL_DEBUG_DUMP_ASM": "1",
        "FLYDSL_DUMP_DIR": str(dump_dir),
    }
    with _env_lock:
        saved = {key: os.environ.get(key) for key in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for key, old in saved.items():
                if old is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = old


@contextlib.contextmanager
def _captured_stderr(sink: Path) -> Iterator[None]:
    """Redirect file descriptor 2 (where LLVM prints its diagnostics) into ``sink`` for the block."""
    saved = os.dup(2)
    try:
        with open(sink, "wb") as out:
            os.dup2(out.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)


@dataclasses.dataclass(frozen=True)
class CompileResult:
    """The kernels one launcher call compiled for one arch, the ISA listing text of each, and what the
    compiler printed to stderr (LLVM reports some codegen failures, e.g. a missing libcall, only there)."""

    arch: str
    kernels: tuple[KernelIsa, ...]
    listings: tuple[str, ...]
    diagnostics: str

    @property
    def llvm_errors(self) -> list[str]:
        return [line for line in self.diagnostics.splitlines() if "error:" in line]

    def kernel(self, prefix: str) -> KernelIsa:
        found = [k for k in self.kernels if k.name.startswith(prefix)]
        if len(found) != 1:
            raise KeyError(f"expected one kernel named {prefix}*, found {[k.name for k in self.kernels]}")
        return found[0]


def compile_launcher(
    launcher: Callable[..., Any], args: tuple[Any, ...], arch: str, kwargs: dict[str, Any] | None = None
) -> CompileResult:
    """Trace and compile ``launcher(*args, **kwargs)`` for ``arch`` without a GPU; return its ISA facts.

    ``args`` may be CPU torch tensors of the real shapes and dtypes (compile-only mode never launches).
    Everything written to file descriptor 2 during the compile is returned in ``diagnostics``
    (the Python exception of a failed trace still propagates). Each call compiles afresh (FlyDSL's disk cache is bypassed while dumping); callers that need a
    kernel more than once cache the result themselves.
    """
    with tempfile.TemporaryDirectory(prefix="rocm_k3_flydsl_") as tmp:
        dump = Path(tmp)
        log = dump / "stderr.txt"
        with flydsl_compile_env(arch, dump), _captured_stderr(log):
            launcher(*args, **(kwargs or {}))
        diagnostics = log.read_text(encoding="utf-8", errors="replace")
        files = sorted(dump.rglob("*_final_isa.s"))
        if not files:
            raise ToolchainError(f"FlyDSL produced no final ISA for {arch} (is ld.lld usable? see toolchain_root())")
        listings = tuple(f.read_text(encoding="utf-8") for f in files)
        kernels = tuple(read_isa_dir(files))
    wrong = [k.name for k in kernels if k.arch != arch]
    if wrong:
        raise ToolchainError(f"kernels {wrong} were compiled for another arch than {arch}")
    return CompileResult(arch=arch, kernels=kernels, listings=listings, diagnostics=diagnostics)
