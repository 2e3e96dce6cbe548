"""End-to-end decode on the K3-shaped slice (Triton backend): step time and tokens/s per batch size, eager vs
decode graphs, beside the weight-streaming floor and the GPU kernel time of a step.

    PYTHONPATH=. python3 benchmarks/bench_e2e.py [--batch 1 8 32 128] [--steps 24] [--width 1] [--dtype bfloat16]

Per batch size B: B requests with 64-token prompts are prefilled, then ``--steps`` decode steps are timed
(wall time per step, synchronised by the sampler's read of the tokens). ``kernels`` is the summed CUDA kernel
time of one eager decode step (torch.profiler), so ``step / kernels`` is how much host time is *not* hidden.
floor = (every non-expert weight + the routed experts the batch touches) / 4.27 TB/s, with touched experts per
MoE layer E * (1 - (1 - k/E)^B) for random routing. The corrected floor adds the per-sequence cache traffic of a
decode step, which the weight floor left out: each sequence's KDA slot (fp32 [H, K, V] state + conv state, every
KDA layer) read and written, and its MLA latents (every cached token of every MLA layer) read. Prints a table.

Where a graph step's time goes (graph runs, one GPU): ``replay`` is the GPU time of the step's decode graph
replayed back to back (CUDA events, no host work between), ``graph kern`` the summed kernel time inside one replay
and ``n`` its kernel count (torch.profiler); ``busy`` is the union of the GPU's kernel and copy intervals during one
profiled engine step, so ``step - busy`` is time the GPU sat idle waiting for the host (scheduling, the plan and
its copies, the sampler's read, output processing) and ``replay - graph kern`` the gaps between the graph's own
kernels.

``--async-scheduling``: the graph runs schedule asynchronously (EngineConfig.async_scheduling: step N + 1 is
launched before step N's tokens are read, so the host's work overlaps the GPU's step); the eager runs, which give
the kernel sum, stay one step at a time. The host split then times the executor's submit and collect (collect
includes the wait for the GPU). With ``--prefill`` it schedules the prefill steps asynchronously: step N + 1 takes
prompts step N does not hold and is launched before step N's first tokens are read.

    PYTHONPATH=. python3 benchmarks/bench_e2e.py --prefill [--prompts 16] [--prompt-len 2048] [--budget 8192]

``--prefill``: prompt tokens per second, then (unless ``--no-mixed``) the decodes' inter-token p50 / p99 under a
mixed load at the engine's default step budget (:func:`mixed_load`). ``--prompts`` prompts of ``--prompt-len``
random tokens that share no prefix (each starts with its own token; prefix caching off) arrive at once and are
prefilled in steps of at most ``--budget`` tokens until every one has its first token (a warm-up round of other
prompts first compiles the kernels for these shapes). The FLOP roofline counts every matmul of a prompt token
(:func:`prefill_flops`): each weight matrix of the checkpoint (2 * rows * cols per token; routed experts at top-k of
E; the LM head once per prompt, on the one row the model computes logits for), MLA attention over the expanded heads
(2 (Dn + P + Dv) per causal (query, key, head) pair, the mean over the prompt's positions) and the KDA chunked
recurrence (per token and head: 2 D^2 each for q S, W S and the state update k^T V', plus 2 C D each for the chunk's
A, Aqk and Aqk V' products, C = 64). % of peak = FLOP/s over the brief's ~780 TFLOP/s H200 bf16 roofline (issue 35's
"bf16 peak"), over 989 TFLOP/s (H200 dense bf16, spec sheet) and over an 8192^3 bf16 matmul measured in the same
run.
"""

from __future__ import annotations

import argparse
import gc
import math
import tempfile
import time
from pathlib import Path

import torch

from rocm_k3.engine.llm import LLM
from rocm_k3.model.tiny import k3_slice_overrides, write_tiny_checkpoint
from rocm_k3.sampling_params import SamplingParams

HBM = 4.27e12


def weight_bytes(model) -> tuple[int, int, int]:
    """(non-expert bytes, bytes of one routed expert in one layer, MoE layers) of a loaded model."""
    cfg = model.cfg
    expert_elems = 3 * cfg.moe_intermediate_size * (cfg.routed_expert_hidden_size or cfg.hidden_size)
    per_expert = expert_elems // 2 + expert_elems // 32  # MXFP4 codes + E8M0 scales
    moe_layers = sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    experts = {t.data_ptr() for layer in model.layers if hasattr(layer.ffn, "experts")
               for t in _tensors(layer.ffn.experts)}
    dense = sum(t.numel() * t.element_size() for t in _tensors(model) if t.data_ptr() not in experts)
    return dense, per_expert, moe_layers


def _tensors(obj, seen=None):
    """Every tensor reachable from the model: nn.Module parameters and buffers, and tensors held in plain
    attributes, lists, tuples and dicts (the re-laid expert weights); each storage once."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        if obj.numel() and obj.data_ptr() not in seen:
            seen.add(obj.data_ptr())
            yield obj
        return
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.nn.Module):
        for t in (*obj.parameters(), *obj.buffers()):
            yield from _tensors(t, seen)
    if isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x, seen)
        return
    if isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x, seen)
        return
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith("rocm_k3"):
        for v in vars(obj).values():
            yield from _tensors(v, seen)


def floor_us(model, batch: int) -> float:
    dense, per_expert, layers = weight_bytes(model)
    cfg = model.cfg
    e, k = cfg.num_experts, cfg.num_experts_per_token
    touched = e * (1 - (1 - k / e) ** batch)
    return (dense + layers * touched * per_expert) / HBM * 1e6


def cache_bytes_per_step(core, batch: int, context: int) -> int:
    """Cache bytes one decode step of ``batch`` sequences of ``context`` tokens moves: every sequence's KDA slot
    read and written, its MLA latents read."""
    shapes = core.executor.worker.runner.pools.shapes
    return batch * (2 * shapes.bytes_per_slot() + context * shapes.bytes_per_token())


def gpu_timeline(prof) -> dict:
    """Kernel count, summed kernel time, and (kernels and copies) the busy union and the first-to-last span, us."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    kernels = [(a, b) for a, b, name in spans if not name.startswith(("Memcpy", "Memset"))]
    busy, end = 0.0, -math.inf
    for a, b, _ in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    return {"n": len(kernels), "kern_us": sum(b - a for a, b in kernels), "busy_us": busy,
            "span_us": (spans[-1][1] - spans[0][0]) if spans else float("nan")}


def graph_breakdown(core, batch: int) -> dict:
    """Where a graph step's time goes (module doc): the bucket's graph replayed alone (GPU time per replay, its
    kernels) and one profiled engine step. Run after the timed steps (the replays advance the cache state)."""
    from torch.profiler import ProfilerActivity, profile

    graphs = core.executor.worker.runner.graphs
    key = None if graphs is None else (graphs.bucket_for(batch), 1)
    if key is None or key not in graphs._graphs:
        return {}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        core.step()
        torch.cuda.synchronize()
    step = gpu_timeline(prof)
    host = _host_split(core, graphs, 3)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graphs.replay(key)
        torch.cuda.synchronize()
    graph = gpu_timeline(prof)
    for _ in range(3):
        graphs.replay(key)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(20):
        graphs.replay(key)
    end.record()
    torch.cuda.synchronize()
    return {**host, "replay_us": start.elapsed_time(end) * 1e3 / 20, "graph_n": graph["n"],
            "graph_kern_us": graph["kern_us"],
            "step_busy_us": step["busy_us"], "step_n": step["n"], "step_kern_us": step["kern_us"]}


def _host_split(core, graphs, steps: int) -> dict:
    """Mean host wall time per engine step of its parts (wrapped for ``steps`` steps): the worker's execute (plan,
    copies, replay, sampler and its read), inside it the graph buffers' fill, and the rest of the step (the
    scheduler before, output processing after)."""
    spent = {"execute": 0.0, "fill": 0.0}

    def timed(name, fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t0
        return run

    executor = core.executor
    names = ("submit", "collect") if core.config.async_scheduling else ("execute",)
    for name in names:
        setattr(executor, name, timed("execute", getattr(executor, name)))
    graphs.fill = timed("fill", graphs.fill)
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            core.step()
        wall = time.perf_counter() - t0
    finally:
        for name in names:
            delattr(executor, name)  # the instance attributes shadowed the methods
        del graphs.fill
    return {"host_sched_us": (wall - spent["execute"]) / steps * 1e6, "host_fill_us": spent["fill"] / steps * 1e6,
            "execute_us": spent["execute"] / steps * 1e6}


def run_batch(path: Path, batch: int, steps: int, eager: bool, dtype: str, layout: dict,
              async_scheduling: bool = False) -> dict:
    llm = LLM(path, dtype=dtype, backend="triton", device="cuda", enforce_eager=eager, max_num_seqs=batch,
              max_model_len=64 + steps + 12, max_num_batched_tokens=max(2048, 64 * batch),
              kv_cache_bytes=4 << 30, state_cache_bytes=8 << 30, async_scheduling=async_scheduling, **layout)
    if layout:  # several ranks: only the step time is measured here (the model lives in the worker processes)
        return _run_parallel(llm, batch, steps)
    core = llm.engine
    step_s = _timed_decode(core, batch, steps, llm.vocab_size)
    kernels_us = kernel_time_us(core) if eager else float("nan")
    extra = {"cache_floor_us": cache_bytes_per_step(core, batch, 64 + steps) / HBM * 1e6}
    if not eager:
        extra.update(graph_breakdown(core, batch))
    return {**_summary(llm, core, batch, step_s, kernels_us), **extra}


def _timed_decode(core, batch: int, steps: int, vocab: int) -> float:
    """Prefill ``batch`` 64-token requests, warm up two decode steps, then the mean seconds per decode step."""
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)  # + the breakdown's steps
    for i in range(batch):
        core.add_request(f"b{i}", torch.randint(1, vocab, (64,), generator=gen).tolist(), params)
    while any(not s.is_decoding for s in core.scheduler.running) or core.scheduler.waiting:
        core.step()  # prefill every request
    for _ in range(2):
        core.step()  # warm-up decode steps
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        core.step()
    # with asynchronous scheduling the last step() launched one step more than it collected: its GPU work belongs
    # to the window (the step in flight at the start was complete at the first synchronize), so wait for it
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def _run_parallel(llm, batch: int, steps: int) -> dict:
    step_s = _timed_decode(llm.engine, batch, steps, llm.vocab_size)
    llm.shutdown()
    return {"step_us": step_s * 1e6, "tok_s": batch / step_s, "kernels_us": float("nan"), "floor_us": float("nan"),
            "cache_floor_us": float("nan"),
            "replays": 0}


def _summary(llm, core, batch: int, step_s: float, kernels_us: float) -> dict:
    graphs = core.executor.worker.runner.graphs
    out = {"step_us": step_s * 1e6, "tok_s": batch / step_s, "kernels_us": kernels_us,
           "floor_us": floor_us(llm.model, batch), "replays": graphs.replays if graphs else 0}
    del llm, core, graphs
    gc.collect()
    torch.cuda.empty_cache()
    return out


def kernel_time_us(core) -> float:
    """Summed CUDA kernel time of one eager decode step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        core.step()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1.0


PEAK = 989e12  # H200 dense bf16 MMA, spec sheet
# the brief's H200 FLOP roofline (~780 TFLOP/s); issue 35's "% of bf16 peak" uses it (its 41k tokens/s x 8.5 GFLOP
# per token = 348 TFLOP/s is "about 44 %" of it, 35 % of the spec sheet's 989)
ROOFLINE = 780e12
COPY_OPS = ("aten::copy_", "aten::contiguous", "aten::clone", "aten::_to_copy", "aten::to", "aten::reshape",
            "aten::cat", "aten::index", "aten::index_put_")
KDA_CHUNK = 64


def prefill_flops(cfg, prompt_len: int) -> dict[str, float]:
    """FLOPs per prompt token of a ``prompt_len``-token prompt, by kind (see the module doc)."""
    from rocm_k3.model.checkpoint_names import expected_tensors

    out = {"weights": 0.0, "routed experts": 0.0, "MLA attention": 0.0, "KDA recurrence": 0.0}
    for name, spec in expected_tensors(cfg).items():
        shape = tuple(spec.shape)
        if ".experts." in name or "embed_tokens" in name or len(shape) < 2 or not name.endswith("weight"):
            continue
        # [out, in] linear (conv1d [C, 1, W]: 2 C W); the LM head runs on the last row of a prompt only
        out["weights"] += 2 * math.prod(shape) / (prompt_len if name.endswith("lm_head.weight") else 1)
    moe_layers = sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    k_in = cfg.routed_expert_hidden_size or cfg.hidden_size
    out["routed experts"] = moe_layers * cfg.num_experts_per_token * 2 * 3 * k_in * cfg.moe_intermediate_size
    mean_keys = (prompt_len + 1) / 2
    out["MLA attention"] = len(cfg.mla_layers) * cfg.num_attention_heads * mean_keys * 2 * (
        cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    d = cfg.kda.head_dim
    out["KDA recurrence"] = len(cfg.kda_layers) * cfg.kda.num_heads * (3 * 2 * d * d + 3 * 2 * KDA_CHUNK * d)
    return out


def _matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    return 2 * 8192 ** 3 * 10 / (time.perf_counter() - start) / 1e12


def run_prefill(path: Path, args) -> None:
    """Prompt tokens/s of ``args.prompts`` prompts sharing no prefix, and the FLOP roofline (module doc)."""
    llm = LLM(path, dtype=args.dtype, backend="triton", device="cuda", max_num_seqs=args.prompts,
              max_model_len=args.prompt_len + 8, max_num_batched_tokens=args.budget, enable_prefix_caching=False,
              kv_cache_bytes=8 << 30, state_cache_bytes=8 << 30, async_scheduling=args.async_scheduling)
    core, vocab = llm.engine, llm.vocab_size
    gen = torch.Generator().manual_seed(0)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def prefill_round(tag: str) -> float:
        ids = set()
        for i in range(args.prompts):
            prompt = torch.randint(1, vocab, (args.prompt_len,), generator=gen).tolist()
            prompt[0] = 1 + i % (vocab - 1)  # distinct first tokens: no two prompts share a prefix
            core.add_request(f"{tag}{i}", prompt, first)
            ids.add(f"{tag}{i}")
        torch.cuda.synchronize()
        start = time.perf_counter()
        done: set[str] = set()
        while done != ids:
            for delta in core.step():
                if delta.error:
                    raise RuntimeError(f"{delta.request_id} failed: {delta.error}")
                if delta.request_id in ids:
                    done.add(delta.request_id)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    prefill_round("warm")
    seconds = min(prefill_round(f"r{r}-") for r in range(args.rounds))
    matmul = _matmul_tflops()
    tokens = args.prompts * args.prompt_len
    flops = prefill_flops(llm.model.cfg, args.prompt_len)
    per_token = sum(flops.values())
    rate = tokens / seconds
    achieved = rate * per_token
    print(f"prefill: {args.prompts} prompts x {args.prompt_len} tokens (no shared prefix), budget {args.budget} "
          f"tokens per step: {seconds * 1e3:.0f} ms, {rate:,.0f} prompt tokens/s")
    print("FLOPs per prompt token (every matmul): " + ", ".join(f"{k} {v / 1e9:.3f} G" for k, v in flops.items())
          + f"; total {per_token / 1e9:.3f} GFLOP")
    print(f"achieved {achieved / 1e12:.0f} TFLOP/s = {100 * achieved / ROOFLINE:.1f} % of the "
          f"{ROOFLINE / 1e12:.0f} TFLOP/s roofline (H200 bf16) = {100 * achieved / PEAK:.1f} % of "
          f"{PEAK / 1e12:.0f} TFLOP/s (H200 dense bf16, spec) = {100 * achieved / 1e12 / matmul:.1f} % of the "
          f"measured bf16 matmul ({matmul:.0f} TFLOP/s)", flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            wall = prefill_round("prof-")
        events = prof.key_averages()
        total = sum(e.device_time_total for e in events if e.device_time_total > 0)  # us, every CUDA event
        print(f"profiled round: wall {wall * 1e3:.0f} ms, GPU time {total / 1e3:.0f} ms (kernels + copies); top 30:")
        for e in sorted(events, key=lambda e: -e.device_time_total)[:30]:
            print(f"  {e.device_time_total / 1e3:9.2f} ms {100 * e.device_time_total / total:5.1f} % "
                  f"x{e.count:<5d} {e.key[:110]}")
    if args.copies:  # which torch ops launch the copy kernels (a separate round: host-side profiling is slower)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            prefill_round("copies-")
        ops = [e for e in prof.key_averages(group_by_input_shape=True)
               if e.key in COPY_OPS and e.device_time_total > 0]
        print("torch ops that copy on the GPU (device time incl. their kernels, calls, input shapes):")
        for e in sorted(ops, key=lambda e: -e.device_time_total)[:12]:
            print(f"  {e.device_time_total / 1e3:9.2f} ms x{e.count:<5d} {e.key} {str(e.input_shapes)[:120]}")
    llm.shutdown()
    if args.mixed:
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        mixed_load(path, args.dtype)


def mixed_load(path: Path, dtype: str) -> None:
    """Inter-token latency of running decodes while long prompts arrive, at the engine's default step budget and
    no long-prefill threshold (bench_mixed_load.py's GPU load; that script sweeps the two flags)."""
    from bench_mixed_load import GPU_LOAD, gpu_engine_args, measure

    from rocm_k3.settings import DEFAULT_MAX_NUM_BATCHED_TOKENS

    load = argparse.Namespace(**GPU_LOAD)
    r = measure(path, DEFAULT_MAX_NUM_BATCHED_TOKENS, 0, load, "cuda", gpu_engine_args(dtype))
    print(f"mixed load ({load.decodes} decodes running, {load.long_prompts} prompts of {load.long_len} tokens arrive; "
          f"--max-num-batched-tokens {DEFAULT_MAX_NUM_BATCHED_TOKENS}, no --long-prefill-token-threshold): inter-token "
          f"p50 {r['p50']:.1f} ms, p99 {r['p99']:.1f} ms (p99 / p50 {r['ratio']:.2f}), max {r['max']:.1f} ms; the "
          f"prompts' TTFT mean {r['ttft_mean']:.0f} ms, last {r['ttft_last']:.0f} ms, {r['prefill_tok_s']:,.0f} "
          f"prompt tokens/s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--width", type=int, default=1, help="divide the slice's widths (1 = K3 width)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--checkpoint", type=Path, default=None, help="reuse a written slice checkpoint")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    ap.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    ap.add_argument("--enable-expert-parallel", action="store_true")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="graph runs (and --prefill) schedule asynchronously (module doc); eager decode runs stay "
                    "one step at a time")
    ap.add_argument("--prefill", action="store_true", help="prompt tokens/s and the FLOP roofline (module doc)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens of the --prefill run")
    ap.add_argument("--rounds", type=int, default=2, help="timed --prefill rounds (the fastest is printed)")
    ap.add_argument("--profile", action="store_true", help="--prefill: one more round under torch.profiler, "
                    "the 30 costliest CUDA kernels")
    ap.add_argument("--no-mixed", dest="mixed", action="store_false",
                    help="--prefill: skip the mixed-load line (decode inter-token p50 / p99 while long prompts arrive)")
    ap.add_argument("--copies", action="store_true", help="--prefill: one more profiled round that names the "
                    "torch ops (and input shapes) behind the GPU copy kernels")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_e2e needs a GPU")
    path = args.checkpoint
    if path is None or not (path / "config.json").is_file():
        path = path or Path(tempfile.mkdtemp()) / "k3-slice"
        write_tiny_checkpoint(path, text_overrides=k3_slice_overrides(args.width))
    print(f"K3 slice (width 1/{args.width}), {args.dtype}, Triton backend, {torch.cuda.get_device_name()}"
          + (", async scheduling" if args.async_scheduling else ""))
    if args.prefill:
        run_prefill(path, args)
        return
    print(f"{'B':>4} | {'eager step':>11} | {'graph step':>11} | {'kernels':>9} | {'graph/kernels':>13} | "
          f"{'floor':>9} | {'corr. floor':>11} | {'graph tok/s':>11} | {'eager tok/s':>11} || {'replay':>9} | "
          f"{'graph kern':>10} | {'n':>4} | {'busy':>9} | {'step-busy':>9} | {'replay-kern':>11}")
    layout = {k: v for k, v in (("tensor_parallel_size", args.tensor_parallel_size),
                                ("pipeline_parallel_size", args.pipeline_parallel_size),
                                ("enable_expert_parallel", args.enable_expert_parallel)) if v not in (1, False)}
    for b in args.batch:
        eager = run_batch(path, b, args.steps, True, args.dtype, layout)
        graph = run_batch(path, b, args.steps, False, args.dtype, layout, args.async_scheduling)
        ratio = graph["step_us"] / eager["kernels_us"]
        nan = float("nan")
        replay, kern = graph.get("replay_us", nan), graph.get("graph_kern_us", nan)
        busy = graph.get("step_busy_us", nan)
        print(f"{b:>4} | {eager['step_us']:>8.0f} us | {graph['step_us']:>8.0f} us | {eager['kernels_us']:>6.0f} us | "
              f"{ratio:>13.2f} | {eager['floor_us']:>6.0f} us | "
              f"{eager['floor_us'] + eager['cache_floor_us']:>8.0f} us | "
              f"{graph['tok_s']:>11.0f} | {eager['tok_s']:>11.0f} || {replay:>6.0f} us | {kern:>7.0f} us | "
              f"{graph.get('graph_n', 0):>4} | {busy:>6.0f} us | {graph['step_us'] - busy:>6.0f} us | "
              f"{replay - kern:>8.0f} us  (replays {graph['replays']}; profiled graph step: "
              f"{graph.get('step_n', 0)} kernels, {graph.get('step_kern_us', nan):.0f} us; host per step: worker "
              f"execute {graph.get('execute_us', nan):.0f} us of which fill {graph.get('host_fill_us', nan):.0f} us, "
              f"scheduler + outputs {graph.get('host_sched_us', nan):.0f} us)", flush=True)


if __name__ == "__main__":
    main()
