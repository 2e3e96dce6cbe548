"""Cross-compile a ``@triton.jit`` kernel for sm_90, gfx942 or gfx950 on a machine without a GPU.

``triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget(...))`` runs Triton's whole pipeline
(TTIR -> TTGIR -> LLVM -> PTX/cubin or AMDGCN/hsaco) without a driver, so the `compile` test tier can prove that
every kernel lowers for each target and inspect the instructions it became (``wgmma``/``mma`` on Hopper,
``v_mfma_*`` on CDNA3/CDNA4) and its register, scratch and spill use.

Usage::

    res = compile_kernel(my_kernel, {"x_ptr": "*bf16", "n": "i32"}, {"BLOCK": 128}, "gfx942")
    assert res.has("v_mfma"), res.summary()

The signature maps every non-constexpr argument to a Triton type string (``*fp32``, ``*bf16``, ``*u8``,
``i32``, ``i64``, ``fp32``, ...); constexpr arguments go in ``constexprs`` and may be left out of the signature.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Mapping

TARGETS = ("sm_90", "gfx942", "gfx950")

_AMD_META = {
    "vgprs": re.compile(r"\.vgpr_count:\s+(\d+)"),
    "sgprs": re.compile(r"\.sgpr_count:\s+(\d+)"),
    "agprs": re.compile(r"\.agpr_count:\s+(\d+)"),
    "vgpr_spills": re.compile(r"\.vgpr_spill_count:\s+(\d+)"),
    "sgpr_spills": re.compile(r"\.sgpr_spill_count:\s+(\d+)"),
    "scratch_bytes": re.compile(r"; ScratchSize:\s+(\d+)"),
}
_AMD_INSTR = re.compile(r"^\s+((?:v|s|global|buffer|ds|flat|scratch)_[a-z0-9_]+)", re.MULTILINE)
_PTX_INSTR = re.compile(r"^\s+(?:@!?%p\d+\s+)?([a-z][a-z0-9_]*(?:\.[a-z0-9_]+)*)", re.MULTILINE)
_CUOBJ_RES = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


def _ptx_statements(ptx: str) -> str:
    """PTX with comments dropped and one statement per line (split at ``;`` and braces), so that the statements of
    one-line inline-asm blocks are read as instructions and comment text is not."""
    return re.sub(r"[{};]", "\n", re.sub(r"//[^\n]*", "", ptx))


@dataclasses.dataclass(frozen=True)
class CompileResult:
    """What one cross-compilation produced.

    target:    "sm_90", "gfx942" or "gfx950".
    asm:       the assembly text (PTX for sm_90, AMDGCN for gfx9xx).
    mnemonics: every instruction mnemonic in ``asm`` (PTX opcodes keep their dotted suffixes,
               e.g. ``wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16``).
    registers: VGPRs per lane (AMD) or registers per thread from the cubin (NVIDIA; None if cuobjdump is absent).
    scratch_bytes: private scratch (AMD ScratchSize) or local memory per thread (NVIDIA LOCAL).
    spills:    VGPR + SGPR spill count (AMD); on NVIDIA the stack-frame bytes (> 0 means ptxas spilled).
    shared_bytes: shared memory / LDS the kernel declares.
    """

    target: str
    asm: str
    mnemonics: frozenset[str]
    registers: int | None
    scratch_bytes: int
    spills: int
    shared_bytes: int
    extra: Mapping[str, Any]

    def has(self, prefix: str) -> bool:
        """True when some instruction mnemonic starts with ``prefix`` (e.g. "v_mfma", "wgmma.mma_async")."""
        return any(m.startswith(prefix) for m in self.mnemonics)

    def count(self, prefix: str) -> int:
        """Number of instructions (PTX: statements) whose mnemonic starts with ``prefix``."""
        if self.target.startswith("gfx"):
            return sum(1 for m in _AMD_INSTR.findall(self.asm) if m.startswith(prefix))
        return sum(1 for m in _PTX_INSTR.findall(_ptx_statements(self.asm)) if m.startswith(prefix))

    def summary(self) -> str:
        mma = sorted(m for m in self.mnemonics if "mma" in m or "mfma" in m)
        return (
            f"{self.target}: registers={self.registers} scratch={self.scratch_bytes}B spills={self.spills} "
            f"shared={self.shared_bytes}B matrix_ops={mma[:6]}"
        )


def _gpu_target(target: str) -> Any:
    from triton.backends.compiler import GPUTarget

    if target == "sm_90":
        return GPUTarget("cuda", 90, 32)
    if target in ("gfx942", "gfx950"):
        return GPUTarget("hip", target, 64)
    raise ValueError(f"target must be one of {TARGETS}, got {target!r}")


def _cuobjdump(cubin: bytes, flag: str) -> str | None:
    """``cuobjdump <flag>`` of a cubin with Triton's bundled cuobjdump (or one on PATH); None if there is none."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    exe = str(tool) if tool.exists() else shutil.which("cuobjdump")
    if exe is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([exe, flag, f.name], capture_output=True, text=True, check=False).stdout


def _cuda_resources(cubin: bytes) -> tuple[int | None, int, int, int]:
    """(registers, stack, shared, local) of the first kernel in a cubin, via Triton's bundled cuobjdump."""
    out = _cuobjdump(cubin, "-res-usage")
    if out is None:
        return None, 0, 0, 0
    m = _CUOBJ_RES.search(out)
    if m is None:
        return None, 0, 0, 0
    reg, stack, shared, local = (int(g) for g in m.groups())
    return reg, stack, shared, local


_SASS_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", re.MULTILINE)
_SASS_BRANCH = re.compile(r"\bBRA\s+(?:`\()?\s*0x([0-9a-f]+)")


@dataclasses.dataclass(frozen=True)
class SassLoop:
    """One loop of a cubin's SASS (a backward branch): its instruction count and opcode histogram."""

    start: int  # SASS address of the loop's first instruction (the branch target)
    end: int  # SASS address of the backward branch
    instructions: int
    opcodes: Mapping[str, int]


def sass_loops(cubin: bytes) -> list[SassLoop] | None:
    """The loops of the first kernel in ``cubin`` (``cuobjdump -sass``), innermost (shortest) first; None without
    cuobjdump. Used to count the static instructions of a K loop (per weight element: divide by its elements)."""
    import collections

    text = _cuobjdump(cubin, "-sass")
    if text is None:
        return None
    ins = [(int(a, 16), t) for a, t in _SASS_LINE.findall(text)]
    loops = []
    for addr, txt in ins:
        m = _SASS_BRANCH.search(txt)
        if m and int(m.group(1), 16) < addr:
            lo = int(m.group(1), 16)
            body = [t for a, t in ins if lo <= a <= addr]
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
            loops.append(SassLoop(lo, addr, len(body), dict(ops)))
    return sorted(loops, key=lambda lp: lp.instructions)


def _require_compiled(fn: Any) -> None:
    """Reject kernels decorated under ``TRITON_INTERPRET=1`` with the reason and the way out."""
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(fn, InterpretedFunction):
        raise RuntimeError(
            f"{fn.__name__} was decorated under TRITON_INTERPRET=1: Triton reads that variable when it is imported "
            "and then interprets every @triton.jit, its own standard library included, so nothing can be "
            "compiled in this process; call compile_kernel in a fresh interpreter without TRITON_INTERPRET "
            "(tests/triton_compile_driver.py does)"
        )


def compile_kernel(
    fn: Any,
    signature: Mapping[str, str],
    constexprs: Mapping[str, Any] | None,
    target: str,
    *,
    num_warps: int = 4,
    num_stages: int | None = None,
    divisible_by_16: tuple[str, ...] | None = None,
    maxnreg: int | None = None,
) -> CompileResult:
    """Compile ``fn`` (a ``@triton.jit`` function) for ``target`` without a GPU and summarise the result.

    Needs a process where triton was imported without ``TRITON_INTERPRET`` (RuntimeError otherwise).

    signature: argument name -> Triton type string for every runtime argument.
    constexprs: constexpr argument name -> value (added to the signature as "constexpr" when missing); a
        constexpr argument named in neither mapping takes its declared default.
    divisible_by_16: arguments Triton may assume divisible by 16, as its launcher specialises them at run time
        (pointers of 16-byte aligned tensors, integer sizes and strides that are multiples of 16); without these
        hints loads are not vectorised and the code is not what a real launch runs. None: every pointer argument.
    maxnreg: the NVIDIA register cap per thread, as a launch passes it.
    ``fn`` may be a Gluon kernel (``@gluon.jit``); its tensor-descriptor arguments take signature strings like
    ``tensordesc<i64[2, 2, 256],NVMMASharedLayout(...)>`` (the layout's repr).
    """
    import triton
    from triton.compiler import ASTSource

    if not isinstance(signature, Mapping):
        raise TypeError(f"signature must be a mapping name -> type string, got {type(signature).__name__}")
    constexprs = dict(constexprs or {})
    for param in getattr(fn, "params", ()):  # constexprs left out take their declared defaults, as a launch does
        if param.is_constexpr and param.has_default and param.name not in constexprs and param.name not in signature:
            constexprs[param.name] = param.default
    sig = dict(signature)
    for name in constexprs:
        sig.setdefault(name, "constexpr")
    known = set(fn.arg_names)
    unknown = sorted(set(sig) - known)
    if unknown:
        raise ValueError(f"signature names {unknown} are not arguments of {fn.__name__} ({sorted(known)})")
    missing = [a for a in fn.arg_names if a not in sig]
    if missing:
        raise ValueError(f"signature is missing arguments {missing} of {fn.__name__}")
    _require_compiled(fn)
    options: dict[str, Any] = {"num_warps": num_warps}
    if num_stages is not None:
        options["num_stages"] = num_stages
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    if divisible_by_16 is None:
        divisible_by_16 = tuple(a for a in fn.arg_names if sig[a].startswith("*"))
    unknown_div = sorted(set(divisible_by_16) - known)
    if unknown_div:
        raise ValueError(f"divisible_by_16 names {unknown_div} are not arguments of {fn.__name__}")
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in divisible_by_16}
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as source
    else:
        source = ASTSource
    src = source(fn, {a: sig[a] for a in fn.arg_names}, constexprs, attrs)
    kernel = triton.compile(src, target=_gpu_target(target), options=options)
    shared = int(getattr(kernel.metadata, "shared", 0) or 0)
    if target == "sm_90":
        asm = kernel.asm["ptx"]
        regs, stack, cu_shared, local = _cuda_resources(kernel.asm["cubin"])
        mnemonics = frozenset(_PTX_INSTR.findall(_ptx_statements(asm)))
        return CompileResult(target, asm, mnemonics, regs, local, stack, max(shared, cu_shared),
                             {"stack": stack, "cubin": kernel.asm["cubin"]})
    asm = kernel.asm["amdgcn"]
    meta = {k: int(m.group(1)) if (m := p.search(asm)) else 0 for k, p in _AMD_META.items()}
    return CompileResult(
        target,
        asm,
        frozenset(_AMD_INSTR.findall(asm)),
        meta["vgprs"],
        meta["scratch_bytes"],
        meta["vgpr_spills"] + meta["sgpr_spills"],
        shared,
        meta,
    )


# (module, attribute, signature, constexprs or target -> constexprs, num_warps or target -> num_warps, num_stages
#  [, divisible_by_16 [, maxnreg (NVIDIA targets only)]])
KernelSpec = tuple


def _summarize_job(job: tuple[Any, str, str]) -> tuple[str, dict]:
    """Worker of :func:`compile_specs`: compile one (kernel, target) and summarise it as plain JSON values."""
    import importlib

    specs_fn, name, target = job
    module, attr, sig, constexprs, warps, stages, *extra = specs_fn()[name]
    divisible = extra[0] if extra else None
    maxnreg = extra[1] if len(extra) > 1 and target.startswith("sm_") else None
    fn = getattr(importlib.import_module(module), attr)
    if callable(constexprs):  # per-target constexprs (e.g. an NVIDIA-only inline-asm path)
        constexprs = constexprs(target)
    if callable(warps):  # per-target warps (tiles chosen per vendor)
        warps = warps(target)
    try:
        res = compile_kernel(fn, sig, constexprs, target, num_warps=warps, num_stages=stages,
                             divisible_by_16=divisible, maxnreg=maxnreg)
    except Exception as exc:  # reported per kernel/target; the calling test fails with this message
        return f"{name}/{target}", {"ok": False, "error": repr(exc)[-2000:]}
    loops = sass_loops(res.extra["cubin"]) if target == "sm_90" else None
    return f"{name}/{target}", {"ok": True, "error": "", "mnemonics": sorted(res.mnemonics),
                                "registers": res.registers, "spills": res.spills, "scratch": res.scratch_bytes,
                                "sass_loops": None if loops is None else [dataclasses.asdict(lp) for lp in loops]}


def compile_specs(specs_fn: Any, names: list[str], targets: tuple[str, ...], workers: int = 2) -> dict:
    """Compile the named kernels of ``specs_fn() -> {name: KernelSpec}`` (all when ``names`` is empty) for every
    target in ``workers`` processes; returns ``{"<name>/<target>": summary}``. ``specs_fn`` must be a module-level
    function (it is sent to the workers by reference)."""
    from concurrent.futures import ProcessPoolExecutor

    jobs = [(specs_fn, n, t) for n in (names or list(specs_fn())) for t in targets]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return dict(pool.map(_summarize_job, jobs))
