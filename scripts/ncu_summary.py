"""Summarise Nsight Compute's per-instruction source page of one kernel (``ncu -i REP --page source --csv
--print-source sass -k NAME > F.csv``): the share of warp-stall samples by reason and by SASS opcode, and the
instructions holding the most samples with their top reasons.

    python scripts/ncu_summary.py F.csv [--top N]
"""

from __future__ import annotations

import argparse
import collections
import csv

SAMPLES = "Warp Stall Sampling (All Samples)"


def _opcode(source: str) -> str:
    """The SASS opcode of a source-page line without predicate and suffixes ("@!P0 LDG.E.128 ..." -> "LDG")."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def summarise(path: str, top: int) -> None:
    with open(path, newline="") as fh:
        rows = list(csv.reader(fh))
    header_at = next((i for i, r in enumerate(rows) if SAMPLES in r), None)
    if header_at is None:
        raise ValueError(f"{path}: no '{SAMPLES}' column; expected ncu's --page source --csv output")
    hdr, data = rows[header_at], rows[header_at + 1:]
    ix = {h: i for i, h in enumerate(hdr)}
    reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]

    def num(r: list[str], col: str) -> int:
        v = r[ix[col]].replace(",", "") if ix[col] < len(r) else ""
        return int(float(v)) if v else 0

    total = sum(num(r, SAMPLES) for r in data)
    if total == 0:
        raise ValueError(f"{path}: no stall samples")
    by_reason, by_op, executed = collections.Counter(), collections.Counter(), collections.Counter()
    for r in data:
        op = _opcode(r[ix["Source"]])
        by_op[op] += num(r, SAMPLES)
        executed[op] += num(r, "Instructions Executed")
        for c in reasons:
            by_reason[c[len("stall_"):]] += num(r, c)
    print(f"{path}: {total} samples, {sum(executed.values())} warp instructions executed")
    print("stall reasons (% of samples): " + ", ".join(f"{k} {100 * v / total:.1f}" for k, v in by_reason.most_common(8)))
    print("opcodes (% of samples, executed): " + ", ".join(f"{k} {100 * v / total:.1f} ({executed[k]})"
                                                          for k, v in by_op.most_common(12)))
    print(f"top {top} instructions (line, % of samples, top reasons, source):")
    for i in sorted(range(len(data)), key=lambda j: -num(data[j], SAMPLES))[:top]:
        r = data[i]
        why = sorted(((num(r, c), c[len("stall_"):]) for c in reasons), reverse=True)[:2]
        print(f"  {i:5d} {100 * num(r, SAMPLES) / total:5.1f}  " + " ".join(f"{w} {n}" for n, w in why)
              + f"  {r[ix['Source']].strip()[:70]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="ncu --page source --csv --print-source sass output of one kernel")
    parser.add_argument("--top", type=int, default=12, help="instructions to list (default 12)")
    args = parser.parse_args()
    summarise(args.csv, args.top)


if __name__ == "__main__":
    main()
