"""The engine as a hostile user finds it (issue #10): concurrent callers, interrupts anywhere in the bookkeeping,
non-finite logits, bad seeds and devices, stop strings without a tokenizer, the control plane's boundaries."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rocm_k3.engine.llm import LLM
from rocm_k3.model.tiny import write_tiny_checkpoint
from rocm_k3.sampling_params import SamplingParams
from rocm_k3.worker.worker import DeviceError
from tests.model_fixtures import default_sigint, nan_embedding_checkpoint, one_thread  # noqa: F401 (fixtures)

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(20, 60)), [100] * 17, list(range(70, 75))]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny_robust")
    write_tiny_checkpoint(root, seed=5)
    return root


def _llm(ckpt: Path, **kw) -> LLM:
    kw.setdefault("block_size", 16)
    kw.setdefault("match_unit", 8)
    kw.setdefault("alignment", 16)
    kw.setdefault("max_num_batched_tokens", 48)
    kw.setdefault("max_num_seqs", 4)
    return LLM(ckpt, dtype="float32", max_model_len=128, **kw)


@pytest.fixture(scope="module")
def alone(ckpt: Path) -> dict[int, list[int]]:
    """Each prompt's greedy tokens when it runs alone on a fresh engine without prefix caching."""
    out = {}
    for i, p in enumerate(PROMPTS):
        out[i] = _llm(ckpt, enable_prefix_caching=False).generate([p], GREEDY)[0].token_ids
    return out


def _assert_clean(llm: LLM) -> None:
    st = llm.stats()
    assert st["free_blocks"] == st["num_blocks"] and st["free_state_slots"] == st["num_state_slots"], st
    assert st["running"] == 0 and st["waiting"] == 0, st


def test_two_threads_get_their_own_tokens(ckpt: Path, alone) -> None:
    llm = _llm(ckpt)
    results: dict[int, list[list[int]]] = {}
    errors: list[BaseException] = []

    def worker(k: int, prompts: list[int]) -> None:
        try:
            for _ in range(3):
                outs = llm.generate([PROMPTS[i] for i in prompts], GREEDY)
                results.setdefault(k, []).append([o.token_ids for o in outs])
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(0, [0, 1])), threading.Thread(target=worker, args=(1, [2, 3]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert results[0] == [[alone[0], alone[1]]] * 3
    assert results[1] == [[alone[2], alone[3]]] * 3
    _assert_clean(llm)


class _InjectAtLine:
    """A trace function that raises KeyboardInterrupt at the k-th line executed in the engine's bookkeeping
    (scheduler and cache modules): an interrupt landing at an arbitrary point between two statements."""

    FILES = ("rocm_k3/engine/scheduler.py", "rocm_k3/cache/")

    def __init__(self, k: int) -> None:
        self.k, self.count, self.fired = k, 0, False

    def __call__(self, frame, event, arg):
        path = frame.f_code.co_filename.replace(os.sep, "/")
        if not any(f in path for f in self.FILES):
            return None
        return self._line

    def _line(self, frame, event, arg):
        if event == "line" and not self.fired:
            self.count += 1
            if self.count == self.k:
                self.fired = True
                raise KeyboardInterrupt(f"injected at line event {self.k}")
        return self._line


def _count_bookkeeping_lines(llm: LLM, prompts, params) -> int:
    probe = _InjectAtLine(k=-1)
    sys.settrace(probe)
    try:
        llm.generate(prompts, params)
    finally:
        sys.settrace(None)
    return probe.count


def test_interrupt_at_any_bookkeeping_line_leaves_the_llm_usable(ckpt: Path, alone) -> None:
    llm = _llm(ckpt)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    # the second run hits the prefix cache the first one filled, and runs fewer lines: sample below both
    total = min(_count_bookkeeping_lines(llm, prompts, GREEDY) for _ in range(2))
    assert total > 500
    rng = random.Random(0)
    points = sorted(rng.sample(range(1, total), 30))
    for k in points:
        probe = _InjectAtLine(k)
        sys.settrace(probe)
        try:
            with pytest.raises(KeyboardInterrupt):
                llm.generate(prompts, GREEDY)
        finally:
            sys.settrace(None)
        assert probe.fired
        _assert_clean(llm)
        outs = llm.generate([PROMPTS[3], PROMPTS[0]], GREEDY)
        assert [o.token_ids for o in outs] == [alone[3], alone[0]], f"wrong tokens after an interrupt at line {k}"
        _assert_clean(llm)
    assert llm.stats()["preemptions"] == 0  # an interrupt is not a preemption


@pytest.mark.usefixtures("default_sigint")
def test_real_ctrl_c_at_random_times(ckpt: Path, alone) -> None:
    llm = _llm(ckpt)
    rng = random.Random(1)
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([PROMPTS[1]], long)
    duration = time.perf_counter() - start
    interrupted = 0
    for _ in range(12):
        delay = rng.uniform(0.0, duration)
        timer = threading.Timer(delay, lambda: os.kill(os.getpid(), signal.SIGINT))
        timer.start()
        try:
            llm.generate([PROMPTS[1], PROMPTS[2]], long)
            timer.join()
        except KeyboardInterrupt:
            interrupted += 1
        timer.join()
        _assert_clean(llm)
        assert llm.generate([PROMPTS[0]], GREEDY)[0].token_ids == alone[0]
    assert interrupted > 0
    assert llm.stats()["preemptions"] == 0


def test_an_interrupt_between_launch_and_finish_leaves_no_stale_step(ckpt: Path, alone, monkeypatch) -> None:
    """A Ctrl-C after the worker launched a step and before it finished it (the window test_real_ctrl_c_at_random_times
    hits now and then): the next steps get their own outputs, not the abandoned step's."""
    llm = _llm(ckpt)
    worker = llm.engine.executor.worker
    original, calls = worker.finish, [0]

    def finish():
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt  # the launched step stays queued in the worker
        return original()

    monkeypatch.setattr(worker, "finish", finish)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPTS[1], PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    assert calls[0] == 3
    _assert_clean(llm)
    assert llm.generate([PROMPTS[0]], GREEDY)[0].token_ids == alone[0]
    assert [o.token_ids for o in llm.generate([PROMPTS[3], PROMPTS[0]], GREEDY)] == [alone[3], alone[0]]


def test_non_finite_logits_fail_only_that_request(ckpt: Path, tmp_path: Path) -> None:
    bad = nan_embedding_checkpoint(ckpt, tmp_path / "nan_embedding", 42)  # token 42 poisons its sequence
    llm = _llm(bad)
    good_alone = _llm(ckpt).generate([PROMPTS[0]], GREEDY)[0].token_ids
    outs = llm.generate([PROMPTS[0], [1, 2, 42, 3]], GREEDY)
    assert outs[0].token_ids == good_alone and outs[0].finish_reason == "length"
    assert outs[1].finish_reason == "error" and "non-finite" in outs[1].error
    _assert_clean(llm)
    # the CLI exits non-zero and says why
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "rocm_k3.cli", "generate", "--model", str(bad), "--token-ids",
                           "--dtype", "float32", "1,2,42,3"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode != 0 and "non-finite" in (proc.stdout + proc.stderr)


@pytest.mark.parametrize("seed", [-1, 2**63, 2**64 - 1])
def test_out_of_range_seed_is_refused_before_registration(ckpt: Path, seed: int) -> None:
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=seed)


def test_unusable_device_is_named(ckpt: Path) -> None:
    with pytest.raises(DeviceError, match="cuda:7"):
        LLM(ckpt, dtype="float32", device="cuda:7")
    with pytest.raises(ValueError, match="device"):
        LLM(ckpt, dtype="float32", device="not-a-device")


def test_stop_strings_without_a_tokenizer_are_refused_at_add_request(ckpt: Path, tmp_path: Path) -> None:
    bare = tmp_path / "no_tokenizer"
    bare.mkdir()
    for f in ckpt.iterdir():
        if f.name != "rocm_k3_tokenizer.json":
            (bare / f.name).write_bytes(f.read_bytes())
    llm = _llm(bare)
    assert llm.tokenizer is None
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate([[1, 2, 3]], SamplingParams(stop=["x"], max_tokens=4))
    _assert_clean(llm)
    assert len(llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4))[0].token_ids) >= 1


def test_default_max_model_len_is_what_one_request_can_hold(ckpt: Path, tmp_path: Path, caplog) -> None:
    long = tmp_path / "long_context"
    long.mkdir()
    for f in ckpt.iterdir():
        (long / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["text_config"]["max_position_embeddings"] = 1048576
    (long / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level("WARNING", logger="rocm_k3.engine"):
        llm = LLM(long, dtype="float32", kv_cache_bytes=4 << 20, state_cache_bytes=4 << 20)
    assert 0 < llm.max_model_len < 1048576
    assert any("max_model_len defaults to" in r.message for r in caplog.records)
    assert len(llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3))[0].token_ids) == 3
    from rocm_k3.cache.errors import CacheBudgetError

    with pytest.raises(CacheBudgetError, match="max_model_len=1048576"):
        LLM(long, dtype="float32", max_model_len=1048576, kv_cache_bytes=4 << 20, state_cache_bytes=4 << 20)


def test_control_plane_imports_no_tensor_code() -> None:
    code = (
        "import sys\n"
        "import rocm_k3.cache.manager, rocm_k3.cache.invariants, rocm_k3.engine.core, rocm_k3.worker.step_io\n"
        "bad = [m for m in ('torch', 'rocm_k3.model', 'rocm_k3.worker.worker') if m in sys.modules]\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
