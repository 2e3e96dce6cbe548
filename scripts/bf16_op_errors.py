"""Where a backend's bf16 logits drift from the fp32 reference model: per position, and per op on the model's own
inputs (session 24's diagnosis of the K3 slice's bf16 logits test, RESULTS.md).

    python scripts/bf16_op_errors.py CHECKPOINT [--backend triton] [--device cuda] [--tokens 48] [--force-routing]

Loads the checkpoint three times (fp32 reference, bf16 reference, bf16 ``--backend``), runs one teacher-forced
prefill of ``--tokens`` random ids through each and prints the logits' relative error against the fp32 model, in
total and per position (expert flips at near-ties show as a few positions far above the rest). Then, for each op
of the backend's model, the call's inputs as the model made them (its first call) go through the backend's op, the
reference op in bf16 and the reference op in fp32: the first two's relative errors against the third (floating
tensors cast to fp32 for the third; tensors inside structures, e.g. gate parameters or expert weights, as they are).
With ``--force-routing`` both bf16 models choose the fp32 model's experts (their own router weights at them), and the
route op is left out of the per-op table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_ROOT), str(_ROOT / "tests")]  # rocm_k3 without an install; simple_cache, forced_routing

OPS = ("kda_prefill", "gated_rms_norm", "short_conv", "fused_moe", "route", "mla_prefill", "rms_norm",
       "add_rms_norm", "attn_res_step", "situ_and_mul")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _first(out):
    """The op's main output tensor (``.o`` of a prefill result, the first of a tuple)."""
    if hasattr(out, "o"):
        return out.o
    return out[0] if isinstance(out, tuple) else out


def _copy(x, fp32: bool = False):
    if not torch.is_tensor(x):
        return x
    return x.float().clone() if fp32 and x.is_floating_point() else x.clone()


def _capture(captured: dict, op: str, impl, args: tuple, kwargs: dict) -> None:
    """Keep the first call of ``op``: its implementation and copies of its tensors (ops write states in place)."""
    if op not in captured:
        captured[op] = (impl, tuple(_copy(x) for x in args), {n: _copy(v) for n, v in kwargs.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--force-routing", action="store_true")
    args = parser.parse_args()
    if args.tokens < 1:
        raise ValueError(f"--tokens: expected >= 1, got {args.tokens}")

    from rocm_k3.ops.registry import _impls
    from forced_routing import teacher_forced_logits, wrap_op

    torch.backends.cuda.matmul.allow_tf32 = False
    ids = torch.randint(0, 256, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    routes: list = []

    def logits(backend: str, dtype: torch.dtype, replay: bool, captured: dict | None = None):
        def capture(model) -> None:  # each op's inputs on its first call, in captured
            for op in OPS:
                if model.backend.candidates.get(op) and not (args.force_routing and op == "route"):
                    wrap_op(model.backend, op, lambda impl, *a, _op=op, **k: (_capture(captured, _op, impl, a, k),
                                                                             impl.fn(*a, **k))[1])

        return teacher_forced_logits(args.checkpoint, backend, dtype, ids, routes if args.force_routing else None,
                                     replay, args.device,
                                     before_forward=capture if captured is not None else None)

    truth = logits("reference", torch.float32, False)
    ref16 = logits("reference", torch.bfloat16, True)
    captured: dict = {}
    got16 = logits(args.backend, torch.bfloat16, True, captured)
    print(f"logits vs fp32 ({args.tokens} tokens, routing {'forced' if args.force_routing else 'free'}): "
          f"bf16 reference {rel(ref16, truth):.3e}, bf16 {args.backend} {rel(got16, truth):.3e}")
    for name, x in (("reference", ref16), (args.backend, got16)):
        per = ((x - truth).norm(dim=-1) / truth.norm(dim=-1)).tolist()
        print(f"  per position, bf16 {name}: " + " ".join(f"{e:.2f}" for e in per))
    print(f"ops on the {args.backend} model's own inputs (first call), relative error against the fp32 reference op:")
    for op, (impl, a, k) in captured.items():
        ref = _impls[op]["reference"].fn
        want = _first(ref(*[_copy(x, True) for x in a], **{n: _copy(v, True) for n, v in k.items()}))
        got = _first(impl.fn(*[_copy(x) for x in a], **{n: _copy(v) for n, v in k.items()}))
        base = _first(ref(*[_copy(x) for x in a], **{n: _copy(v) for n, v in k.items()}))
        print(f"  {op}: {args.backend} {rel(got, want):.3e}, bf16 reference {rel(base, want):.3e}")


if __name__ == "__main__":
    main()
