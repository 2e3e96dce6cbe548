"""Shared test helpers: the one relative-error metric, poisoning, seeded inputs."""

from __future__ import annotations

import math

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in fp64; NaN or Inf anywhere in ``out`` gives inf (never passes)."""
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    if out64.shape != ref64.shape:
        raise AssertionError(f"shape mismatch: out {tuple(out64.shape)} vs ref {tuple(ref64.shape)}")
    if not torch.isfinite(out64).all():
        return math.inf
    denom = ref64.norm().item()
    num = (out64 - ref64).norm().item()
    if denom == 0.0:
        return num
    return num / denom


def assert_rel(out: torch.Tensor, ref: torch.Tensor, tol: float, name: str = "output") -> None:
    err = rel_err(out, ref)
    assert err <= tol, f"{name}: relative error {err:.3e} > tolerance {tol:.1e}"


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    """An output buffer full of NaN (or max int), so an unwritten element can never pass."""
    if t.dtype.is_floating_point:
        return torch.full_like(t, float("nan"))
    return torch.full_like(t, torch.iinfo(t.dtype).max)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def run_interpret_tier(test_file: str) -> None:
    """Re-run the ``interpret``-marked tests of ``test_file`` in a subprocess with TRITON_INTERPRET=1 (for a process
    that imported triton compiled); fails with the tail of its output."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", test_file, "-q", "-m", "interpret", "-p", "no:cacheprovider"],
                          capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def run_compile_driver(script: str) -> dict:
    """Run ``tests/<script>`` in a fresh interpreter without TRITON_INTERPRET (Triton decides at import whether
    kernels are interpreted) and return its JSON ``{"<kernel>/<target>": summary}``."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(root / "tests" / script)],
                          capture_output=True, text=True, env=env, cwd=root, timeout=600, check=False)
    if proc.returncode != 0:
        raise AssertionError(f"{script} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)


def mxfp4_experts(e: int, n: int, k: int, kout: int, gen: torch.Generator, device: str = "cpu"):
    """Random MoE experts (w13 [E, 2N, K], w2 [E, Kout, N]) quantised by the reference MXFP4 quantiser (ct rule)."""
    from rocm_k3.ops.moe import ExpertWeights
    from rocm_k3.quant.mxfp4 import quantize_mxfp4_reference

    w13, s13 = quantize_mxfp4_reference(torch.randn(e, 2 * n, k, generator=gen) * 0.05, "ct")
    w2, s2 = quantize_mxfp4_reference(torch.randn(e, kout, n, generator=gen) * 0.05, "ct")
    return ExpertWeights("mxfp4", w13.to(device), s13.to(device), w2.to(device), s2.to(device))


def moe_routing(t: int, e: int, k: int, gen: torch.Generator, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, k] softmax-normalised, ids int32 [T, k] distinct experts per token)."""
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(torch.int32)  # [T, k] distinct
    w = torch.softmax(torch.randn(t, k, generator=gen), dim=1)
    return w.to(device), ids.to(device)
