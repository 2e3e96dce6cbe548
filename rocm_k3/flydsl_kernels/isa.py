"""Read the facts the `compile` tier checks out of a final AMDGPU ISA listing (``*_final_isa.s``).

FlyDSL's ``FLYDSL_DEBUG_DUMP_ASM`` writes one ``.s`` file per compiled module: the kernel body, the
``.amdhsa_kernel`` descriptor and the ``.amdgpu_metadata`` YAML block. This module parses, per kernel:

- register use: ``.vgpr_count`` (arch VGPRs + AGPRs as allocated), ``.agpr_count``, ``.sgpr_count``;
- spills: ``.vgpr_spill_count``, ``.sgpr_spill_count``;
- scratch: ``.private_segment_fixed_size`` (bytes of per-lane private memory) and any ``scratch_*``
  instruction in the body;
- LDS: ``.group_segment_fixed_size``;
- the instruction mnemonics of the body, counted; :func:`loops` counts them per loop body.

Pure text processing: no FlyDSL, no GPU. The parser is strict: a listing without metadata for a kernel
raises ``ValueError`` instead of reporting zeros.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Iterable
from pathlib import Path

_META_INT_FIELDS = {
    ".vgpr_count": "vgpr_count",
    ".agpr_count": "agpr_count",
    ".sgpr_count": "sgpr_count",
    ".vgpr_spill_count": "vgpr_spill_count",
    ".sgpr_spill_count": "sgpr_spill_count",
    ".private_segment_fixed_size": "private_segment_size",
    ".group_segment_fixed_size": "lds_size",
}
_INSTR = re.compile(r"^\s+([a-z][a-z0-9_]*)(?:\s|$)")
_LABEL = re.compile(r"^([A-Za-z_.][\w.$]*):")


@dataclasses.dataclass(frozen=True)
class KernelIsa:
    """Register, spill, scratch and instruction facts of one kernel in a final ISA listing."""

    name: str
    arch: str
    vgpr_count: int
    agpr_count: int
    sgpr_count: int
    vgpr_spill_count: int
    sgpr_spill_count: int
    private_segment_size: int
    lds_size: int
    mnemonics: collections.Counter

    @property
    def scratch_instructions(self) -> int:
        return sum(n for m, n in self.mnemonics.items() if m.startswith("scratch_"))

    @property
    def uses_scratch(self) -> bool:
        """Any private (scratch) memory: a spill, a stack object or an explicit scratch access."""
        return (
            self.private_segment_size > 0
            or self.vgpr_spill_count > 0
            or self.sgpr_spill_count > 0
            or self.scratch_instructions > 0
        )

    def has(self, prefix: str) -> bool:
        """Whether any instruction mnemonic starts with ``prefix`` (e.g. ``v_mfma_scale_f32``)."""
        return any(m.startswith(prefix) for m in self.mnemonics)

    def matching(self, prefix: str) -> list[str]:
        return sorted(m for m in self.mnemonics if m.startswith(prefix))

    def summary(self) -> str:
        mfma = ", ".join(self.matching("v_mfma")) or "no MFMA"
        return (
            f"{self.name} [{self.arch}]: {self.vgpr_count} VGPR ({self.agpr_count} AGPR), {self.sgpr_count} SGPR, "
            f"spills v{self.vgpr_spill_count}/s{self.sgpr_spill_count}, scratch {self.private_segment_size} B, "
            f"LDS {self.lds_size} B; {mfma}"
        )


def _body_mnemonics(lines: list[str], name: str) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    inside = False
    for line in lines:
        label = _LABEL.match(line)
        if label and label.group(1) == name:
            inside = True
            continue
        if not inside:
            continue
        if line.strip().startswith(".Lfunc_end") or line.strip().startswith(".size\t" + name) or (
            label and label.group(1).startswith(".Lfunc_end")
        ):
            break
        match = _INSTR.match(line)
        if match and not line.lstrip().startswith("."):
            counts[match.group(1)] += 1
    return counts


def _metadata_blocks(lines: list[str]) -> list[dict[str, str]]:
    """The per-kernel entries of the ``amdhsa.kernels`` YAML list, as flat key -> value dicts."""
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "amdhsa.kernels:")
    except StopIteration as exc:
        raise ValueError("ISA listing has no amdhsa.kernels metadata") from exc
    blocks: list[dict[str, str]] = []
    for line in lines[start + 1 :]:
        if line and not line.startswith(" "):
            break  # next top-level YAML key
        stripped = line.strip()
        if stripped.startswith("- .") and line.startswith("  - "):
            blocks.append({})
            stripped = stripped[2:]
        if not blocks or ":" not in stripped or line.startswith("      "):
            continue  # nested (.args) entries
        key, _, value = stripped.partition(":")
        blocks[-1].setdefault(key.strip(), value.strip())
    return blocks


def parse_isa(text: str) -> list[KernelIsa]:
    """Every kernel described in one final ISA listing."""
    lines = text.splitlines()
    target = re.search(r'\.amdgcn_target\s+"[^"]*-(gfx\w+)"', text)
    if target is None:
        raise ValueError("ISA listing has no .amdgcn_target line")
    arch = target.group(1)
    kernels = []
    for block in _metadata_blocks(lines):
        if ".name" not in block:
            raise ValueError(f"kernel metadata without .name: {block}")
        missing = [k for k in _META_INT_FIELDS if k not in block]
        if missing:
            raise ValueError(f"kernel {block['.name']}: metadata lacks {missing}")
        fields = {attr: int(block[key]) for key, attr in _META_INT_FIELDS.items()}
        name = block[".name"]
        kernels.append(KernelIsa(name=name, arch=arch, mnemonics=_body_mnemonics(lines, name), **fields))
    if not kernels:
        raise ValueError("ISA listing describes no kernel")
    return kernels


_BRANCH = re.compile(r"^\s+s_(?:cbranch_\w+|branch)\s+(\.LBB[\w.]+)")


def loops(text: str) -> list[collections.Counter]:
    """The mnemonic histogram of every loop body in a listing (from a ``.LBB`` label to a backward branch to it),
    innermost (fewest instructions) first: what the compile tier reads to budget a K loop's VALU per weight."""
    lines = text.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL.match(line))}
    bodies = []
    for i, line in enumerate(lines):
        m = _BRANCH.match(line)
        if m and labels.get(m.group(1), i) < i:
            counts: collections.Counter = collections.Counter()
            for body_line in lines[labels[m.group(1)] : i + 1]:
                match = _INSTR.match(body_line)
                if match and not body_line.lstrip().startswith("."):
                    counts[match.group(1)] += 1
            bodies.append(counts)
    return sorted(bodies, key=lambda c: sum(c.values()))


def read_isa_dir(paths: Iterable[Path]) -> list[KernelIsa]:
    """Parse several ``*_final_isa.s`` files (one per compiled kernel module)."""
    kernels: list[KernelIsa] = []
    for path in sorted(paths):
        kernels.extend(parse_isa(Path(path).read_text(encoding="utf-8")))
    return kernels
