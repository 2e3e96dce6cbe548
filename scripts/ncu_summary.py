"""Summarise Nsight Compute's per-instruction source page (``ncu -i REP --page source --csv --print-source sass
[-k NAME] > F.csv``), per kernel in it: the share of warp-state samples by reason and by SASS opcode, and the
instructions holding the most samples with their top reasons.

    python scripts/ncu_summary.py F.csv [--top N]
"""

from __future__ import annotations

import argparse
import collections
import csv

SAMPLES = "Warp Stall Sampling (All Samples)"
REQUIRED = ("Address", "Source", SAMPLES, "Instructions Executed")


def _opcode(source: str) -> str:
    """The SASS opcode of a source-page line without predicate and suffixes ("@!P0 LDG.E.128 ..." -> "LDG")."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def _sections(rows: list[list[str]], path: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """(kernel name, header, data rows) per kernel of a source page (ncu writes a "Kernel Name" row and a header row
    before each kernel's instructions)."""
    sections: list[tuple[str, list[str], list[list[str]]]] = []
    name = "?"
    for r in rows:
        if r and r[0] == "Kernel Name":
            name = r[1] if len(r) > 1 else "?"
        elif SAMPLES in r:
            missing = [c for c in REQUIRED if c not in r]
            if missing:
                raise ValueError(f"{path}: the source page lacks the columns {missing}")
            sections.append((name, r, []))
        elif sections and r:
            sections[-1][2].append(r)
    if not sections:
        raise ValueError(f"{path}: no '{SAMPLES}' column; expected ncu's --page source --csv output")
    return sections


def summarise(path: str, top: int) -> None:
    with open(path, newline="") as fh:
        rows = list(csv.reader(fh))
    for kernel, hdr, data in _sections(rows, path):
        _summarise_kernel(f"{path} ({kernel})", hdr, data, top)


def _summarise_kernel(label: str, hdr: list[str], data: list[list[str]], top: int) -> None:
    ix = {h: i for i, h in enumerate(hdr)}
    reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]

    def num(r: list[str], col: str) -> int:
        v = r[ix[col]].replace(",", "") if ix[col] < len(r) else ""
        try:
            return int(float(v)) if v else 0
        except ValueError:
            raise ValueError(f"{label}: {col!r} holds {v!r}, not a number") from None

    total = sum(num(r, SAMPLES) for r in data)
    if total == 0:
        raise ValueError(f"{label}: no stall samples")
    by_reason, by_op, executed = collections.Counter(), collections.Counter(), collections.Counter()
    for r in data:
        op = _opcode(r[ix["Source"]])
        by_op[op] += num(r, SAMPLES)
        executed[op] += num(r, "Instructions Executed")
        for c in reasons:
            by_reason[c[len("stall_"):]] += num(r, c)
    print(f"{label}: {total} samples, {sum(executed.values())} warp instructions executed")
    print("warp states (% of samples; selected = issuing): "
          + ", ".join(f"{k} {100 * v / total:.1f}" for k, v in by_reason.most_common(8)))
    print("opcodes (% of samples, executed): " + ", ".join(f"{k} {100 * v / total:.1f} ({executed[k]})"
                                                          for k, v in by_op.most_common(12)))
    print(f"top {top} instructions (address, % of samples, top states, source):")
    for i in sorted(range(len(data)), key=lambda j: -num(data[j], SAMPLES))[:top]:
        r = data[i]
        why = sorted(((num(r, c), c[len("stall_"):]) for c in reasons), reverse=True)[:2]
        print(f"  {r[ix['Address']]:>8} {100 * num(r, SAMPLES) / total:5.1f}  " + " ".join(f"{w} {n}" for n, w in why)
              + f"  {r[ix['Source']].strip()[:70]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="ncu --page source --csv --print-source sass output (one kernel or several)")
    parser.add_argument("--top", type=int, default=12, help="instructions to list (default 12)")
    args = parser.parse_args()
    summarise(args.csv, args.top)


if __name__ == "__main__":
    main()
