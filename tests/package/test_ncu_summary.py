"""scripts/ncu_summary.py on a hand-made Nsight Compute source page: the stall shares by reason and by opcode, the
top instructions, and a clear error for a file that is not one."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "ncu_summary.py"
HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "Instructions Executed", "stall_long_sb", "stall_wait", "stall_long_sb (Not Issued)"]


def _write(path: Path, rows: list[list[str]]) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["Kernel Name", "chunk_state_kernel"])
        w.writerow(HEADER)
        w.writerows(rows)


def _run(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(path), "--top", "2"], capture_output=True, text=True,
                          timeout=60)


def test_shares_by_reason_opcode_and_instruction(tmp_path: Path) -> None:
    f = tmp_path / "page.csv"
    _write(f, [["0x10", "      BAR.SYNC.DEFER_BLOCKING 0x0", "60", "58", "100", "55", "5", "54"],
               ["0x20", "@!P0  LDGSTS.E desc[UR32][R92.64], P4, [R252]", "30", "20", "400", "10", "20", "9"],
               ["0x30", "      HMMA.16816.F32.BF16 R68, R28, R46, R68", "10", "9", "1,200", "0", "10", "0"]])
    done = _run(f)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "100 samples, 1700 warp instructions executed" in out
    assert "long_sb 65.0, wait 35.0" in out  # (55 + 10 + 0) and (5 + 20 + 10) of 100; "Not Issued" columns left out
    assert "BAR 60.0 (100), LDGSTS 30.0 (400), HMMA 10.0 (1200)" in out  # the predicate "@!P0" is not the opcode
    top = out.split("top 2 instructions")[1].splitlines()[1:]
    assert len(top) == 2 and "BAR.SYNC" in top[0] and "LDGSTS" in top[1] and "long_sb 55 wait 5" in top[0]


def test_a_file_without_the_sampling_column_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "details.csv"
    f.write_text('"ID","Kernel Name","Metric Name"\n"0","chunk_state_kernel","Duration"\n')
    done = _run(f)
    assert done.returncode != 0
    assert "no 'Warp Stall Sampling (All Samples)' column" in done.stderr
