"""Boundary checks of the KDA public ops: shapes and dtypes (ValueError / TypeError naming the argument).

Checks of index *contents* (cu_seqlens, state_indices, intermediate_positions) read the tensors on the host,
one small copy each; they are skipped while a CUDA graph is being captured, where a host read is not allowed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CONV_ACTIVATIONS = ("silu", None)


def _dims(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def tensor(op: str, name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def rank(op: str, name: str, t: object, expected_rank: int, layout: str) -> torch.Tensor:
    t = tensor(op, name, t)
    if t.dim() != expected_rank:
        raise ValueError(f"{op}: {name} must be {expected_rank}-D {layout}, got shape {_dims(t.shape)}")
    return t


def shape(op: str, name: str, t: object, expected: Sequence[int], layout: str) -> torch.Tensor:
    t = rank(op, name, t, len(expected), layout)
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{op}: {name} must have shape {layout} = {_dims(expected)}, got {_dims(t.shape)}")
    return t


def dtype(op: str, name: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if t.dtype not in allowed:
        names = " or ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"{op}: {name} must be {names}, got {str(t.dtype).replace('torch.', '')}")


def activation_dtype(op: str, name: str, t: torch.Tensor) -> None:
    dtype(op, name, t, ACTIVATION_DTYPES)


def same_dtype(op: str, tensors: dict[str, torch.Tensor]) -> None:
    dtypes = {name: t.dtype for name, t in tensors.items()}
    if len(set(dtypes.values())) > 1:
        given = ", ".join(f"{n}={str(d).replace('torch.', '')}" for n, d in dtypes.items())
        raise TypeError(f"{op}: {', '.join(dtypes)} must share one dtype, got {given}")


def same_device(op: str, tensors: dict[str, torch.Tensor | None]) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        given = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"{op}: all tensors must be on one device, got {given}")


def finite_float(op: str, name: str, value: object, *, negative: bool = False, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{op}: {name} must be a float, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{op}: {name} must be finite, got {value}")
    if negative and not value < 0:
        raise ValueError(f"{op}: {name} must be < 0, got {value}")
    if positive and not value > 0:
        raise ValueError(f"{op}: {name} must be > 0, got {value}")
    return float(value)


def lower_bound(op: str, value: object) -> None:
    if value is not None:
        finite_float(op, "lower_bound", value, negative=True)


def conv_activation(op: str, value: object) -> None:
    if value not in CONV_ACTIVATIONS:
        raise ValueError(f"{op}: activation must be 'silu' or None, got {value!r}")


def conv_inputs(op: str, x: object, weight: object, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The activations ``x`` (2-d, ``layout`` e.g. "[T, C]") and depthwise taps ``weight [C, W]`` of a short conv."""
    x = rank(op, "x", x, 2, layout)
    activation_dtype(op, "x", x)
    weight = rank(op, "weight", weight, 2, "[C, W]")
    shape(op, "weight", weight, (x.shape[1], weight.shape[1]), "[C, W]")
    activation_dtype(op, "weight", weight)
    return x, weight


def conv_state(op: str, t: object, channels: int, width: int) -> torch.Tensor:
    """A conv state pool [S, C, W-1] in an activation dtype."""
    t = rank(op, "conv_state", t, 3, "[S, C, W-1]")
    shape(op, "conv_state", t, (t.shape[0], channels, width - 1), "[S, C, W-1]")
    activation_dtype(op, "conv_state", t)
    return t


def _host_values(t: torch.Tensor, values: bool = True) -> list | None:
    """The tensor's values on the host, or None when value checks are off (calls through a bound op table) or
    while a CUDA graph is being captured (no host reads then)."""
    if not values or (t.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    return t.tolist()


def cu_seqlens(op: str, t: object, total_tokens: int, values: bool = True) -> int:
    """Check cu_seqlens int32 [N+1] (starts at 0, nondecreasing, ends at T); returns N."""
    t = rank(op, "cu_seqlens", t, 1, "[N+1]")
    dtype(op, "cu_seqlens", t, (torch.int32,))
    if t.numel() < 2:
        raise ValueError(f"{op}: cu_seqlens must hold N+1 >= 2 offsets, got shape {_dims(t.shape)}")
    values = _host_values(t, values)
    if values is not None:
        if values[0] != 0:
            raise ValueError(f"{op}: cu_seqlens must start at 0, got {values[0]}")
        bad = [i for i in range(len(values) - 1) if values[i + 1] < values[i]]
        if bad:
            i = bad[0]
            raise ValueError(
                f"{op}: cu_seqlens must be nondecreasing, got cu_seqlens[{i}]={values[i]} > "
                f"cu_seqlens[{i + 1}]={values[i + 1]}"
            )
        if values[-1] != total_tokens:
            raise ValueError(f"{op}: cu_seqlens[-1] must equal the token count T={total_tokens}, got {values[-1]}")
    return t.numel() - 1


def state_indices(op: str, t: object, num_seqs: int, num_slots: int, name: str = "state_indices",
                  values: bool = True) -> None:
    """int32 [N], every value in [0, S), no slot twice (each call writes each slot at most once)."""
    t = shape(op, name, t, (num_seqs,), "[N]")
    dtype(op, name, t, (torch.int32,))
    values = _host_values(t, values)
    if values is None:
        return
    out_of_range = [x for x in values if not 0 <= x < num_slots]
    if out_of_range:
        raise ValueError(f"{op}: {name} must lie in [0, {num_slots}) (S state slots), got {out_of_range[0]}")
    if len(set(values)) != len(values):
        dupes = sorted({x for x in values if values.count(x) > 1})
        raise ValueError(f"{op}: {name} must not repeat a slot within one call, got duplicates {dupes}")


def has_initial_state(op: str, t: object, num_seqs: int) -> None:
    t = shape(op, "has_initial_state", t, (num_seqs,), "[N]")
    dtype(op, "has_initial_state", t, (torch.bool,))


def intermediate_positions(op: str, t: object, cu: torch.Tensor, values: bool = True) -> None:
    """int32 [M, 2] rows (i, p) with 0 <= i < N and 1 <= p <= len_i."""
    t = tensor(op, "intermediate_positions", t)
    if t.dim() != 2 or t.shape[1] != 2:
        raise ValueError(f"{op}: intermediate_positions must have shape [M, 2], got {_dims(t.shape)}")
    dtype(op, "intermediate_positions", t, (torch.int32,))
    rows, bounds = _host_values(t, values), _host_values(cu, values)
    if rows is None or bounds is None:
        return
    num_seqs = len(bounds) - 1
    for m, (seq, pos) in enumerate(rows):
        if not 0 <= seq < num_seqs:
            raise ValueError(f"{op}: intermediate_positions[{m}] names sequence {seq}, but N={num_seqs}")
        length = bounds[seq + 1] - bounds[seq]
        if not 1 <= pos <= length:
            raise ValueError(
                f"{op}: intermediate_positions[{m}] = ({seq}, {pos}): p must be in [1, {length}] "
                f"(the length of sequence {seq} in this call)"
            )
