"""The one typed settings module: every environment variable rocm-k3 reads is declared here.

Nothing else in the package reads ``os.environ``. Settings are read when :func:`get_settings` is first
called (never at import time) and can be overridden for a block of code with :func:`override`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Iterator, Mapping

BACKEND_CHOICES = ("auto", "reference", "triton", "flydsl", "aiter")
VLLM_MLA_CHOICES = ("auto", "latent", "expanded")
# how decode steps move expert-parallel picks: "static" (a fixed capacity per rank pair, graph-safe) or "dynamic"
# (the variable-size all-to-all of prefill steps, sized on the host: decode graphs are then off under EP)
EP_DECODE_DISPATCH = ("auto", "static", "dynamic")
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

# The engine's default step budget (--max-num-batched-tokens, new tokens per step): the largest budget measured to
# keep the inter-token p99 of running decodes within 3x of their p50 while long prompts arrive (issue #35). H200,
# 2026-12-04, after the expanded-heads MLA prefill: benchmarks/bench_mixed_load.py (K3-width slice, bf16, Triton,
# 16 decoding requests, 8 prompts of 3,968 tokens, threshold 0; benchmarks/RESULTS.md, docs/scheduling.md):
# 1024 -> p99/p50 1.14 (36.1k prefill tok/s), 1536 -> 1.17 (41.9k, worst step 35.0 ms), 2048 -> 15.5 (43.9k, worst
# step 48.8 ms). A constant, not an environment setting: EngineArgs, EngineConfig and the worker share it.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 1536


@dataclasses.dataclass(frozen=True)
class Settings:
    """Process-wide knobs.

    backend:        ROCM_K3_BACKEND     op backend for every op, or "auto" (per-device priority order).
    cache_dir:      ROCM_K3_CACHE_DIR   where the embedded tiny model and compiled artifacts are written.
    log_level:      ROCM_K3_LOG_LEVEL   logging level of the ``rocm_k3`` logger.
    compile_only:   COMPILE_ONLY        FlyDSL's compile-only mode (build code objects without a GPU).
    flydsl_arch:    ARCH                FlyDSL target arch in compile-only mode (gfx942 or gfx950).
    rocm_path:      ROCM_PATH           ROCm root (FlyDSL links with ``$ROCM_PATH/llvm/bin/ld.lld``).
    triton_interpret: TRITON_INTERPRET  Triton's CPU interpreter (read so tests can tell which tier runs).
    check_values:   ROCM_K3_CHECK_VALUES  validate device-resident index values on every op call, also inside
                                        the model (a host read per call: debugging only).
    vllm_override:  ROCM_K3_VLLM_OVERRIDE  the vLLM plugin replaces vLLM's own Kimi K3 / Kimi Linear classes on every
                                        platform (default: only where vLLM's cannot run, i.e. the CPU).
    vllm_disable:   ROCM_K3_VLLM_DISABLE   the vLLM plugin registers nothing (vLLM's own classes serve).
    vllm_mla:       ROCM_K3_VLLM_MLA    how the vLLM plugin runs MLA: "auto" (vLLM's latent MLA layer where its
                                        MLA backends take the model's page, else expanded heads), "latent" or
                                        "expanded" (forced).
    moe_grouped_scratch_mib: ROCM_K3_MOE_GROUPED_SCRATCH_MIB  the bf16 scratch (MiB) of the MXFP4 MoE's grouped
                                        prefill path (rocm_k3.triton_kernels.moe.grouped): its experts are dequantised
                                        into it in groups of as many as fit (at least one expert per group).
    hf_hub_cache:   HF_HUB_CACHE, else HF_HOME/hub, else XDG_CACHE_HOME/huggingface/hub (huggingface_hub's rule):
                                        the Hugging Face cache where models named by repo id are looked up
                                        (offline: never downloaded).
    """

    backend: str = "auto"
    cache_dir: Path = Path.home() / ".cache" / "rocm_k3"
    log_level: str = "WARNING"
    compile_only: bool = False
    flydsl_arch: str | None = None
    rocm_path: Path | None = None
    triton_interpret: bool = False
    check_values: bool = False
    vllm_override: bool = False
    vllm_disable: bool = False
    vllm_mla: str = "auto"
    moe_grouped_scratch_mib: int = 2048
    hf_hub_cache: Path = Path.home() / ".cache" / "huggingface" / "hub"

    def __post_init__(self) -> None:
        for env, value, choices in (("ROCM_K3_BACKEND", self.backend, BACKEND_CHOICES),
                                    ("ROCM_K3_LOG_LEVEL", self.log_level, _LOG_LEVELS),
                                    ("ROCM_K3_VLLM_MLA", self.vllm_mla, VLLM_MLA_CHOICES)):
            if value not in choices:
                raise ValueError(f"{env}={value!r} is not one of {choices}")
        if isinstance(self.moe_grouped_scratch_mib, bool) or not isinstance(self.moe_grouped_scratch_mib, int) \
                or self.moe_grouped_scratch_mib < 1:
            raise ValueError(f"ROCM_K3_MOE_GROUPED_SCRATCH_MIB={self.moe_grouped_scratch_mib!r} must be a positive int")
        if self.flydsl_arch is not None and self.flydsl_arch not in ("gfx942", "gfx950"):
            raise ValueError(f"ARCH={self.flydsl_arch!r}: rocm-k3 targets gfx942 and gfx950 only")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if env is None else env

        def flag(name: str) -> bool:
            return env.get(name, "0").strip().lower() in ("1", "true", "yes", "on")

        cache = env.get("ROCM_K3_CACHE_DIR")
        rocm = env.get("ROCM_PATH")
        return cls(
            backend=env.get("ROCM_K3_BACKEND", "auto").strip().lower() or "auto",
            cache_dir=Path(cache).expanduser() if cache else cls.cache_dir,
            log_level=env.get("ROCM_K3_LOG_LEVEL", "WARNING").strip().upper(),
            compile_only=flag("COMPILE_ONLY"),
            flydsl_arch=env.get("ARCH") or None,
            rocm_path=Path(rocm) if rocm else None,
            triton_interpret=flag("TRITON_INTERPRET"),
            check_values=flag("ROCM_K3_CHECK_VALUES"),
            vllm_override=flag("ROCM_K3_VLLM_OVERRIDE"),
            vllm_disable=flag("ROCM_K3_VLLM_DISABLE"),
            vllm_mla=env.get("ROCM_K3_VLLM_MLA", "auto").strip().lower() or "auto",
            moe_grouped_scratch_mib=_int(env, "ROCM_K3_MOE_GROUPED_SCRATCH_MIB", cls.moe_grouped_scratch_mib),
            hf_hub_cache=_hf_hub_cache(env),
        )


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer") from None


def _hf_hub_cache(env: Mapping[str, str]) -> Path:
    """huggingface_hub's cache directory for ``env`` (HF_HUB_CACHE > HF_HOME/hub > XDG_CACHE_HOME/huggingface/hub
    > ~/.cache/huggingface/hub)."""
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    xdg = env.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface" / "hub"


_current: Settings | None = None


def get_settings() -> Settings:
    """The process settings, read from the environment on first use."""
    global _current
    if _current is None:
        _current = Settings.from_env()
    return _current


@contextlib.contextmanager
def override(**changes: object) -> Iterator[Settings]:
    """Temporarily replace some settings (tests, the CLI)."""
    global _current
    previous = get_settings()
    _current = dataclasses.replace(previous, **changes)
    try:
        yield _current
    finally:
        _current = previous
