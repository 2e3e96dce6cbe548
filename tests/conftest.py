"""Test tiers (markers): unit (none), interpret, compile, cuda, rocm. GPU tiers skip with a reason elsewhere."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch


def _has_cuda() -> bool:
    return torch.cuda.is_available() and torch.version.hip is None


def _has_rocm() -> bool:
    return torch.cuda.is_available() and torch.version.hip is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_cuda = pytest.mark.skip(reason="cuda tier: needs an NVIDIA GPU (run on the H200)")
    skip_rocm = pytest.mark.skip(
        reason="rocm tier: needs an AMD MI300X/MI355X GPU with ROCm torch and flydsl (run `pytest -m rocm` there)"
    )
    for item in items:
        if "cuda" in item.keywords and not _has_cuda():
            item.add_marker(skip_cuda)
        if "rocm" in item.keywords and not _has_rocm():
            item.add_marker(skip_rocm)


@pytest.fixture(scope="session")
def k3_slice_path(tmp_path_factory: pytest.TempPathFactory):
    """The K3-width 4-layer slice checkpoint (``k3_slice_overrides()``), written once per session (several GB: the
    cuda-tier tests share it). ``ROCM_K3_TEST_SLICE``: the folder of that same checkpoint already written (e.g.
    by scripts/h200_pending.sh's ``slice`` part at width 1), used as it is instead."""
    from rocm_k3.model.tiny import k3_slice_overrides, write_tiny_checkpoint

    given = os.environ.get("ROCM_K3_TEST_SLICE")
    if given:
        if not (Path(given) / "config.json").is_file():
            raise ValueError(f"ROCM_K3_TEST_SLICE={given!r}: no config.json there (unset it to write the slice)")
        return Path(given)
    return write_tiny_checkpoint(tmp_path_factory.mktemp("k3-slice-shared"), text_overrides=k3_slice_overrides())


@pytest.fixture(autouse=True)
def sigint_handler_left_alone(request: pytest.FixtureRequest):
    """A test must leave SIGINT's handler as it found it: a handler left behind (a guard that never restored it,
    a server's signal capture) swallows every later Ctrl-C of the pytest process and of the Ctrl-C tests."""
    before = signal.getsignal(signal.SIGINT)
    yield
    after = signal.getsignal(signal.SIGINT)
    if after is not before:
        signal.signal(signal.SIGINT, before)  # later tests start clean either way
        pytest.fail(f"{request.node.nodeid} left SIGINT's handler changed: {before!r} -> {after!r}", pytrace=False)
