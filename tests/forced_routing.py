"""Teacher-forced MoE routing for accuracy comparisons: one model records the experts its ``route`` op chose, another
chooses the same experts again (its own router weights at them), so a bf16-vs-fp32 comparison measures rounding
instead of expert flips at near-ties (session 24, RESULTS.md). Used by test_triton_model's bf16 logits test and
``scripts/bf16_op_errors.py``."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch


def wrap_op(table, op: str, fn) -> None:
    """Replace every bound implementation of ``op`` in a model's op table by ``fn(impl, *args, **kwargs)`` (each
    candidate wrapped, so a fallback from the first one is wrapped too)."""
    table.candidates[op] = tuple(dataclasses.replace(impl, fn=lambda *a, _impl=impl, **k: fn(_impl, *a, **k))
                                 for impl in table.candidates[op])


def route_through(table, routes: list, replay: bool) -> Callable[[], int]:
    """Wrap the bound ``route`` op: every call's expert ids [T, k] are appended to ``routes`` (record), or
    (``replay``) the ids of the same call in the recorded order are chosen again, their weights taken from this
    model's own router logits as the op defines them (sigmoid at the ids, renormalised, scaled; the correction bias
    only chooses). Returns a function giving how many recorded calls are not replayed yet (0 after a replayed
    forward that routed as the recording did)."""
    recorded = list(routes)
    used = [0]

    def fn(impl, router_logits, top_k, *, correction_bias=None, renormalize=True, scaling_factor=1.0):
        out = impl.fn(router_logits, top_k, correction_bias=correction_bias, renormalize=renormalize,
                      scaling_factor=scaling_factor)
        if not replay:
            routes.append(out.ids.clone())
            return out
        if used[0] >= len(recorded):
            raise ValueError(f"replayed routing: call {used[0] + 1} routes, {len(recorded)} were recorded")
        ids = recorded[used[0]].to(out.ids.device)
        used[0] += 1
        if ids.shape != out.ids.shape:
            raise ValueError(f"replayed routing: recorded ids {tuple(ids.shape)} for a call routing "
                             f"{tuple(out.ids.shape)}: the two runs saw different tokens or layers")
        w = torch.sigmoid(router_logits).gather(1, ids.long())  # [T, k]
        if renormalize:
            w = w / w.sum(dim=-1, keepdim=True)
        return out._replace(weights=(w * scaling_factor).float().contiguous(), ids=ids)

    wrap_op(table, "route", fn)
    return lambda: len(recorded) - used[0] if replay else 0


def teacher_forced_logits(path, backend: str, dtype: torch.dtype, ids: list[int], routes: list | None = None,
                          replay: bool = False, device: str = "cuda",
                          before_forward: Callable | None = None) -> torch.Tensor:
    """Logits [T, vocab] (fp32) at every position of ``ids`` in one prefill of the checkpoint at ``path`` (None: the
    embedded model), no sampling, so no divergence cascade. With ``routes`` the MoE routing is teacher-forced too
    (:func:`route_through`: recorded into it, or with ``replay`` taken from it; a recording the run did not use up is
    a ValueError). ``before_forward(model)`` runs after the routing is wrapped, before the forward (e.g. wrap_op
    captures)."""
    from rocm_k3.model.loader import load_model
    from rocm_k3.model.tiny import ensure_embedded_model
    from simple_cache import SimpleCache

    model = load_model(path or ensure_embedded_model(), dtype=dtype, device=device, backend=backend, progress=False)
    unreplayed = route_through(model.backend, routes, replay) if routes is not None else (lambda: 0)
    if before_forward is not None:
        before_forward(model)
    cache = SimpleCache(model.cfg, max_model_len=len(ids), dtype=model.dtype, device=device)
    batch = cache.prepare([(0, ids)])
    batch.logits_indices = torch.arange(batch.num_tokens, device=device)
    with torch.inference_mode():
        out = model.forward(batch, cache).float()  # [T, vocab]
    if unreplayed():
        raise ValueError(f"{unreplayed()} recorded routing calls were not replayed: the runs routed differently")
    return out
