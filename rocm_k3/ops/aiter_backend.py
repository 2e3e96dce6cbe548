"""Optional ``aiter`` backend on ROCm hosts: imported lazily, never required.

aiter JIT-builds a C++ module with hipcc when imported, so it is only tried on a ROCm device. rocm-k3 does not
route any op to aiter yet: its MXFP4 MoE does not run on gfx942 and its KDA kernels take another state layout.
The backend reports that plainly instead of pretending.
"""

from __future__ import annotations

from rocm_k3.ops.devices import DeviceInfo


def register() -> None:
    """aiter provides no rocm-k3 op implementations (see module docstring)."""


def available(dev: DeviceInfo) -> tuple[bool, str]:
    if dev.kind != "rocm":
        return False, f"aiter needs a ROCm GPU, this call runs on {dev.describe()}"
    try:
        import aiter  # noqa: F401
    except Exception as exc:  # aiter raises more than ImportError when hipcc is missing
        return False, f"aiter is not importable here: {exc}"
    return True, "aiter importable"
