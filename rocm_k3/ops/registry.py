"""Backend registry and per-call dispatch for the op interface.

Each op has one public function in ``rocm_k3/ops/<family>.py`` that validates its inputs and then calls
:func:`dispatch`. Backends register an implementation with the same signature plus a ``supports`` check
returning ``(ok, reason)``. Dispatch picks the backend named in the call (or in settings), else the first
in the device's priority order whose ``supports`` accepts the call; every automatic fallback is logged once
per (op, backend, reason).

Backends other than ``reference`` live in their own packages and are imported lazily, the first time an op
asks for them; importing this module imports no kernel toolchain.

The model resolves its ops once: :func:`bind` returns an :class:`OpTable` holding, per op, the implementations
that can run on the model's device (backend availability, imports and the priority order decided once), and
the model passes that table as ``backend=`` to every op call. A table call only runs the candidates'
``supports`` checks (host-side shape tests) and skips the validation that would read index values back from
the device (the runner's host-side plan is built from validated integers); ``ROCM_K3_CHECK_VALUES=1`` turns
those reads back on for debugging.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from typing import Any, Callable

import torch

from rocm_k3.ops.devices import DeviceInfo, device_info
from rocm_k3.settings import BACKEND_CHOICES, get_settings

log = logging.getLogger("rocm_k3.ops")

SupportsFn = Callable[..., "tuple[bool, str]"]

# backend name -> module whose ``register()`` adds its ops (through :func:`register`) and whose
# ``available(dev) -> (ok, reason)`` says whether the backend can run on a device at all.
BACKEND_MODULES: dict[str, str] = {
    "reference": "rocm_k3.ops.reference_backend",
    "triton": "rocm_k3.triton_kernels.backend",
    "flydsl": "rocm_k3.flydsl_kernels.backend",
    "aiter": "rocm_k3.ops.aiter_backend",
}

PRIORITY: dict[str, tuple[str, ...]] = {
    "rocm": ("flydsl", "aiter", "triton", "reference"),
    "cuda": ("triton", "reference"),
    "cpu": ("reference",),
}


class BackendError(RuntimeError):
    """A named backend cannot run a call; the message carries the backend's reason."""


@dataclasses.dataclass(frozen=True)
class OpImpl:
    op: str
    backend: str
    fn: Callable[..., Any]
    supports: SupportsFn | None = None

    def check(self, *args: Any, **kwargs: Any) -> tuple[bool, str]:
        if self.supports is None:
            return True, "supported"
        return self.supports(*args, **kwargs)


_impls: dict[str, dict[str, OpImpl]] = {}
_ops: list[str] = []
_loaded: dict[str, tuple[bool, str]] = {}
_logged: set[tuple[str, str, str]] = set()


def declare_op(name: str) -> None:
    """Record an op name (done by each op family module) so ``rocm-k3 ops`` can list it."""
    if name not in _ops:
        _ops.append(name)


def declared_ops() -> list[str]:
    return list(_ops)


def register(op: str, backend: str, fn: Callable[..., Any], supports: SupportsFn | None = None) -> None:
    if backend not in BACKEND_MODULES:
        raise ValueError(f"unknown backend {backend!r}; known: {sorted(BACKEND_MODULES)}")
    declare_op(op)
    _impls.setdefault(op, {})[backend] = OpImpl(op, backend, fn, supports)


def _load_backend(backend: str) -> tuple[bool, str]:
    """Import a backend module and register its ops, once; returns (ok, reason).

    A kernel backend whose toolchain is missing or fails to initialise (ImportError, or any other exception
    from importing it on a machine it does not fit) is reported unavailable with the exception as the reason,
    so dispatch can fall back. An error while loading the ``reference`` backend other than a missing module
    propagates: there is nothing to fall back to, and the traceback is the useful report.
    """
    if backend in _loaded:
        return _loaded[backend]
    try:
        module = importlib.import_module(BACKEND_MODULES[backend])
        module.register()
        result = (True, "loaded")
    except ImportError as exc:  # toolchain not installed
        result = (False, f"{backend} backend unavailable: {exc}")
    except Exception as exc:
        if backend == "reference":
            raise
        log.warning("%s backend failed to load: %s: %s", backend, type(exc).__name__, exc)
        result = (False, f"{backend} backend failed to load: {type(exc).__name__}: {exc}")
    _loaded[backend] = result
    return result


def backend_available(backend: str, dev: DeviceInfo) -> tuple[bool, str]:
    ok, reason = _load_backend(backend)
    if not ok:
        return ok, reason
    module = importlib.import_module(BACKEND_MODULES[backend])
    return module.available(dev)


def _call_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def resolve(op: str, backend: str | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> OpImpl:
    """Choose the implementation of ``op`` for this call (see module docstring)."""
    requested = backend if backend is not None else get_settings().backend
    if requested not in BACKEND_CHOICES:
        raise ValueError(f"unknown backend {requested!r}; choose one of {BACKEND_CHOICES}")
    dev = device_info(_call_device(args, kwargs))
    if requested != "auto":
        return _explicit(op, requested, dev, args, kwargs)
    reasons = []
    for name in PRIORITY.get(dev.kind, ("reference",)):
        ok, reason = backend_available(name, dev)
        impl = _impls.get(op, {}).get(name) if ok else None
        if ok and impl is None:
            ok, reason = False, f"{name} has no {op} kernel"
        if ok:
            ok, reason = impl.check(*args, **kwargs)
        if ok:
            if reasons:
                _log_fallback(op, name, "; ".join(reasons))
            return impl
        reasons.append(f"{name}: {reason}")
    raise BackendError(f"no backend can run {op} on {dev.describe()}: " + "; ".join(reasons))


def _explicit(op: str, name: str, dev: DeviceInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> OpImpl:
    ok, reason = backend_available(name, dev)
    if not ok:
        raise BackendError(f"backend {name!r} cannot run {op} on {dev.describe()}: {reason}")
    impl = _impls.get(op, {}).get(name)
    if impl is None:
        raise BackendError(f"backend {name!r} has no implementation of {op}")
    ok, reason = impl.check(*args, **kwargs)
    if not ok:
        raise BackendError(f"backend {name!r} cannot run this {op} call: {reason}")
    return impl


def _log_fallback(op: str, chosen: str, why: str) -> None:
    key = (op, chosen, why)
    if key not in _logged:
        _logged.add(key)
        log.info("%s: using %s backend (%s)", op, chosen, why)


def dispatch(op: str, backend: "str | OpTable | None", *args: Any, **kwargs: Any) -> Any:
    """Run ``op`` on the backend chosen by :func:`resolve` (or by a bound :class:`OpTable`)."""
    if isinstance(backend, OpTable):
        return backend.run(op, args, kwargs)
    return resolve(op, backend, args, kwargs).fn(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class OpTable:
    """The ops of one model, bound to one device (see the module docstring).

    device: where the model runs; backend: the requested backend ("auto" or a name); candidates: per op, the
    implementations that may serve it here, in priority order (one for an explicitly named backend).
    """

    device: torch.device
    backend: str
    candidates: dict[str, tuple[OpImpl, ...]]

    def run(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        impls = self.candidates.get(op)
        if not impls:
            raise BackendError(f"no backend can run {op} on {self.device}: none was bound for it "
                               f"(backend {self.backend!r})")
        reasons = []
        for impl in impls:
            ok, reason = impl.check(*args, **kwargs)
            if ok:
                if reasons:
                    _log_fallback(op, impl.backend, "; ".join(reasons))
                return impl.fn(*args, **kwargs)
            reasons.append(f"{impl.backend}: {reason}")
        if self.backend != "auto":
            raise BackendError(f"backend {self.backend!r} cannot run this {op} call: {'; '.join(reasons)}")
        raise BackendError(f"no backend can run {op} on {self.device}: " + "; ".join(reasons))

    def chosen(self, op: str) -> str | None:
        """The first candidate backend of ``op`` (the one used unless its ``supports`` declines a call)."""
        impls = self.candidates.get(op)
        return impls[0].backend if impls else None


def bind(device: torch.device | str, backend: str | None = None) -> OpTable:
    """Resolve every declared op for ``device`` once. A named backend that cannot run here raises BackendError
    with its reason; in auto mode the device's priority order keeps the backends that load and have the op."""
    import rocm_k3.ops as ops_pkg  # every family module declares its ops on import

    for family in ("quant", "norm", "moe", "kda", "attn_res", "mla", "vision_attention", "comm"):
        importlib.import_module(f"{ops_pkg.__name__}.{family}")
    requested = backend if backend is not None else get_settings().backend
    if requested not in BACKEND_CHOICES:
        raise ValueError(f"unknown backend {requested!r}; choose one of {BACKEND_CHOICES}")
    device = torch.device(device)
    dev = device_info(device)
    if requested != "auto":
        ok, reason = backend_available(requested, dev)
        if not ok:
            raise BackendError(f"backend {requested!r} cannot run on {dev.describe()}: {reason}")
        names: tuple[str, ...] = (requested,)
    else:
        names = tuple(n for n in PRIORITY.get(dev.kind, ("reference",)) if backend_available(n, dev)[0])
    candidates = {op: tuple(_impls[op][n] for n in names if n in _impls.get(op, {})) for op in declared_ops()}
    return OpTable(device, requested, candidates)


def checks_values(backend: "str | OpTable | None") -> bool:
    """Whether an op call should validate index values that live on the device (a host read): yes for direct
    calls, no for calls through a bound table (unless ``ROCM_K3_CHECK_VALUES`` is set)."""
    return not isinstance(backend, OpTable) or get_settings().check_values


def prepare_weights(weights: Any, backend: "str | OpTable | None", device: torch.device) -> Any:
    """Run the ``prepare_weights`` hook of the backend that serves ``device`` (named, or first available).

    In auto mode a backend whose hook rejects the weights (ValueError: e.g. FlyDSL's MoE takes MXFP4 experts with
    K, N multiples of 128 only) is passed over, so its ``fused_moe`` declines them and the next backend serves them.
    """
    if isinstance(backend, OpTable):
        backend = backend.backend
    requested = backend if backend is not None else get_settings().backend
    if requested not in BACKEND_CHOICES:
        raise ValueError(f"unknown backend {requested!r}; choose one of {BACKEND_CHOICES}")
    dev = device_info(device)
    names = PRIORITY.get(dev.kind, ("reference",)) if requested == "auto" else (requested,)
    for name in names:
        ok, reason = backend_available(name, dev)
        if not ok:
            if requested != "auto":
                raise BackendError(f"backend {name!r} cannot prepare weights on {dev.describe()}: {reason}")
            continue
        hook = getattr(importlib.import_module(BACKEND_MODULES[name]), "prepare_weights", None)
        if hook is None:
            return weights
        try:
            return hook(weights)
        except ValueError as exc:  # weights this backend's kernels cannot take (format, shape)
            if requested != "auto":
                raise BackendError(f"backend {name!r} cannot prepare these weights: {exc}") from exc
            _log_fallback("prepare_weights", f"the next backend after {name}", str(exc))
    return weights


def explain(op: str, dev: DeviceInfo) -> tuple[str | None, list[str]]:
    """For ``rocm-k3 ops``: which backend ``op`` resolves to on ``dev`` without arguments, and why.

    Lists the backends tried in order (with the reason each was passed over), then the backends outside this
    device's priority order with the reason they cannot serve it (e.g. why flydsl is not used on NVIDIA).
    Call-specific ``supports`` checks need real arguments, so this reports device-level availability only.
    """
    requested = get_settings().backend
    order = PRIORITY.get(dev.kind, ("reference",)) if requested == "auto" else (requested,)
    lines, chosen = [], None
    for name in order:
        ok, reason = backend_available(name, dev)
        if ok and name not in _impls.get(op, {}):
            ok, reason = False, f"no {op} kernel in this backend"
        lines.append(f"{name}: {'ok' if ok else reason}")
        if ok:
            chosen = name
            break
    for name in BACKEND_MODULES:
        if name not in order:
            ok, reason = backend_available(name, dev)
            if ok and name not in _impls.get(op, {}):
                reason = f"no {op} kernel in this backend"
            elif ok:
                reason = f"available, but not in the {dev.kind} priority order {order}"
            lines.append(f"{name}: not used: {reason}")
    return chosen, lines
