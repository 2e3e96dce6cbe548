"""scripts/ncu_summary.py on hand-made Nsight Compute source pages: the warp-state shares by reason and by opcode,
the top instructions, one summary per kernel of a page holding several, and a clear error for a file that is not
a source page."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "ncu_summary.py"
HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "Instructions Executed", "stall_long_sb", "stall_wait", "stall_long_sb (Not Issued)"]
WALK = [["7f10", "      BAR.SYNC.DEFER_BLOCKING 0x0", "60", "58", "100", "55", "5", "54"],
        ["7f20", "@!P0  LDGSTS.E desc[UR32][R92.64], P4, [R252]", "30", "20", "400", "10", "20", "9"],
        ["7f30", "      HMMA.16816.F32.BF16 R68, R28, R46, R68", "10", "9", "1,200", "0", "10", "0"]]


def _write(path: Path, kernels: list[tuple[str, list[list[str]]]], header: list[str] = HEADER) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        for name, rows in kernels:
            w.writerow(["Kernel Name", name])
            w.writerow(header)
            w.writerows(rows)


def _run(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(path), "--top", "2"], capture_output=True, text=True,
                          timeout=60)


def test_shares_by_reason_opcode_and_instruction(tmp_path: Path) -> None:
    f = tmp_path / "page.csv"
    _write(f, [("chunk_state_kernel", WALK)])
    done = _run(f)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "(chunk_state_kernel): 100 samples, 1700 warp instructions executed" in out
    assert "long_sb 65.0, wait 35.0" in out  # (55 + 10 + 0) and (5 + 20 + 10) of 100; "Not Issued" columns left out
    assert "BAR 60.0 (100), LDGSTS 30.0 (400), HMMA 10.0 (1200)" in out  # the predicate "@!P0" is not the opcode
    top = out.split("top 2 instructions")[1].splitlines()[1:]
    assert len(top) == 2
    assert top[0].split()[:2] == ["7f10", "60.0"] and "long_sb 55 wait 5" in top[0] and "BAR.SYNC" in top[0]
    assert top[1].split()[:2] == ["7f20", "30.0"] and "LDGSTS" in top[1]


def test_a_page_of_several_kernels_is_summarised_per_kernel(tmp_path: Path) -> None:
    f = tmp_path / "page.csv"
    prep = [["a0", "      MOV R38, R32", "3", "3", "9", "3", "0", "3"],
            ["b0", "      FADD R1, R2, R3", "1", "0", "40", "0", "1", "0"]]
    _write(f, [("chunk_prep_kernel", prep), ("chunk_state_kernel", WALK)])
    done = _run(f)
    assert done.returncode == 0, done.stderr
    assert "(chunk_prep_kernel): 4 samples, 49 warp instructions executed" in done.stdout
    assert "long_sb 75.0, wait 25.0" in done.stdout
    assert "(chunk_state_kernel): 100 samples, 1700 warp instructions executed" in done.stdout


def test_a_file_that_is_not_a_source_page_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "details.csv"
    f.write_text('"ID","Kernel Name","Metric Name"\n"0","chunk_state_kernel","Duration"\n')
    done = _run(f)
    assert done.returncode != 0
    assert "no 'Warp Stall Sampling (All Samples)' column" in done.stderr
    g = tmp_path / "no_source.csv"
    _write(g, [("chunk_state_kernel", [r[:1] + r[2:] for r in WALK])], header=HEADER[:1] + HEADER[2:])
    done = _run(g)
    assert done.returncode != 0
    assert "lacks the columns ['Source']" in done.stderr
