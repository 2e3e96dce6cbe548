"""What kind of device a call runs on: cpu, cuda (NVIDIA) or rocm (AMD), and the GPU arch."""

from __future__ import annotations

import dataclasses
import functools

import torch

AMD_ARCHES = ("gfx942", "gfx950")


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    kind: str  # "cpu" | "cuda" | "rocm"
    arch: str | None  # "sm_90", "gfx942", ... ; None on CPU
    name: str

    def describe(self) -> str:
        return self.name if self.arch is None else f"{self.name} ({self.arch})"


@functools.lru_cache(maxsize=None)
def _gpu_info(index: int) -> DeviceInfo:
    props = torch.cuda.get_device_properties(index)
    if torch.version.hip is not None:
        arch = getattr(props, "gcnArchName", "unknown").split(":")[0]
        return DeviceInfo("rocm", arch, props.name)
    return DeviceInfo("cuda", f"sm_{props.major}{props.minor}", props.name)


def device_info(device: torch.device | str | None = None) -> DeviceInfo:
    """Describe ``device`` (default: the machine's first GPU if any, else the CPU)."""
    if device is None:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cpu":
        return DeviceInfo("cpu", None, "CPU")
    if device.type != "cuda":
        return DeviceInfo(device.type, None, device.type)
    return _gpu_info(device.index if device.index is not None else torch.cuda.current_device())
