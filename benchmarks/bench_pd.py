"""Prefill/decode disaggregation on the CPU: what one request moves and what it costs, through ``pd-proxy``
against one plain server.

Three servers run in this process on 127.0.0.1 (a plain one, a kv_producer, a kv_consumer; the embedded tiny K3,
fp32, reference ops) plus the proxy. Per prompt length: transfer bytes per prompt token (MLA latent pages of the
first N - 1 tokens + every KDA layer's recurrent and conv state), the consumer's transfer time per request (publish
happens on the producer; this is the load: fetch, checksum, copy-in), and TTFT / TPOT of streamed greedy requests
through the proxy against the plain server. All servers share this process's two cores and its GIL, so latencies
are an upper bound on the CPU path, not a model of separate machines. The peer is vLLM's 1P1D NIXL path, whose
numbers are GPU-only (none recorded here).

    PYTHONPATH=. python benchmarks/bench_pd.py --lengths 64 256 1024 --requests 4 --max-tokens 16

``--overlap`` prints a second table instead, engines only (no HTTP): per transport (SocketConnector, and
NixlConnector when nixl imports) and per load mode (every layer copied in before the forward, or layer by layer
as the forward takes each pool), the consumer's wall time of its load step (fetch + checksum + copy-in + the
last prompt token's forward) and the part of it blocked on the transfer.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import threading
import time

from pathlib import Path

import torch

from rocm_k3.args import EngineArgs, ServerArgs
from rocm_k3.model.tiny import k3_slice_overrides, write_tiny_checkpoint


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(app):
    """(the uvicorn server, its URL); the HTTP mode's imports stay here so that ``--overlap`` runs on machines
    without the serve extra (the H200 image)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    return server, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


@contextlib.contextmanager
def _engine_server(args: EngineArgs):
    from rocm_k3.engine.assembly import assemble_engine
    from rocm_k3.engine.async_llm import AsyncLLM
    from rocm_k3.entrypoints.openai.api_server import build_app, served_model

    assembled = assemble_engine(args)
    engine = AsyncLLM(assembled.core)
    server, url = _serve(build_app(served_model(engine, assembled, ServerArgs(port=0))))
    try:
        yield engine, url
    finally:
        server.should_exit = True
        engine.shutdown()


def _stream(url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """(TTFT s, TPOT s) of one streamed greedy completion."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    t0 = time.perf_counter()
    times = []
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                           stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
    if not times:
        raise RuntimeError("no tokens streamed")
    tpot = (times[-1] - times[0]) / max(1, len(times) - 1)
    return times[0] - t0, tpot


def _load_step_ms(connector: str, layerwise: bool, lengths: list[int], requests: int,
                  engine: dict) -> dict[int, tuple]:
    """Per prompt length: (median load-step ms, median blocked ms, bytes per request) on a consumer LLM."""
    from rocm_k3 import LLM, SamplingParams

    kw = dict(max_model_len=max(lengths) + 8, enable_prefix_caching=False, **engine)
    kv = {"kv_connector": connector, "kv_connector_extra_config": {"layerwise": layerwise}}
    prod = LLM(kv_transfer_config={**kv, "kv_role": "kv_producer", "kv_port": _free_port()}, **kw)
    cons = LLM(kv_transfer_config={**kv, "kv_role": "kv_consumer"}, **kw)
    out = {}
    try:
        vocab = cons.engine.vocab_size
        for n in lengths:
            walls, blocked, nbytes = [], [], 0
            for i in range(requests + 1):  # the first is a warm-up
                ids = [(11 * i + 5 * j) % (vocab - 1) + 1 for j in range(n)]
                prod.engine.add_request(f"p{n}-{i}", ids, SamplingParams(
                    temperature=0.0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
                params = prod.engine.run_to_completion()[f"p{n}-{i}"].kv_transfer_params
                cons.engine.add_request(f"d{n}-{i}", ids, SamplingParams(temperature=0.0, max_tokens=1,
                                                                         kv_transfer_params=params))
                before = cons.engine.stats()
                t0 = time.perf_counter()
                cons.engine.run_to_completion()
                wall = time.perf_counter() - t0
                after = cons.engine.stats()
                if after["kv_transfer_loaded"] != before["kv_transfer_loaded"] + 1:
                    raise SystemExit(f"{connector} {n} tokens: the prompt was not transferred")
                if i:
                    walls.append(wall)
                    blocked.append(after["kv_transfer_seconds"] - before["kv_transfer_seconds"])
                    nbytes = after["kv_transfer_bytes_received"] - before["kv_transfer_bytes_received"]
            out[n] = (1000 * statistics.median(walls), 1000 * statistics.median(blocked), nbytes)
    finally:
        prod.shutdown()
        cons.shutdown()
    return out


def overlap_engine(device: str, model: str, slice_dir: Path) -> dict:
    """The LLM() arguments of the overlap table's engines: the tiny K3 in fp32 on the CPU (reference ops), or on a
    GPU (Triton) with fixed cache budgets (two engines share it); ``k3-slice``: the K3-width 4-layer slice of
    ``k3_slice_overrides()`` (seeded random weights, bf16), whose pages and KDA states have K3's sizes."""
    cpu = device == "cpu"
    kw = {"device": device, "backend": "reference" if cpu else "triton",
          "dtype": "float32" if model == "tiny" else "bfloat16"}
    if not cpu:
        kw.update(kv_cache_bytes=1 << 30, state_cache_bytes=1 << 30)
    if model == "k3-slice":
        if not (slice_dir / "config.json").is_file():
            write_tiny_checkpoint(slice_dir, text_overrides=k3_slice_overrides())
        kw["path"] = str(slice_dir)
    return kw


def overlap_table(lengths: list[int], requests: int, engine: dict) -> None:
    from rocm_k3.kv_transfer.config import nixl_installed

    connectors = ["SocketConnector"] + (["NixlConnector"] if nixl_installed() else [])
    print("| transport | prompt tokens | bytes / req | load step ms (all layers first) | blocked ms "
          "| load step ms (layer by layer) | blocked ms |")
    print("|---|---|---|---|---|---|---|")
    for connector in connectors:
        before = _load_step_ms(connector, False, lengths, requests, engine)
        layered = _load_step_ms(connector, True, lengths, requests, engine)
        for n in lengths:
            (w0, b0, nb), (w1, b1, _) = before[n], layered[n]
            print(f"| {connector} | {n} | {nb} | {w0:.1f} | {b0:.1f} | {w1:.1f} | {b1:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--requests", type=int, default=4, help="requests per length (distinct prompts)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--overlap", action="store_true", help="the transport / layer-overlap table (engines only)")
    ap.add_argument("--device", default="cpu", help="--overlap: cpu or cuda[:N]")
    ap.add_argument("--model", default="tiny", choices=["tiny", "k3-slice"], help="--overlap: the engines' model")
    ap.add_argument("--slice-dir", type=Path, default=Path("/tmp/rocm_k3_k3_slice"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.overlap:
        overlap_table(a.lengths, a.requests, overlap_engine(a.device, a.model, a.slice_dir))
        return
    from rocm_k3.entrypoints.pd_proxy import ProxyConfig, build_proxy_app

    base = dict(dtype="float32", max_model_len=max(a.lengths) + a.max_tokens + 8, enable_prefix_caching=False)
    kv = {"kv_connector": "SocketConnector", "kv_port": _free_port()}
    with _engine_server(EngineArgs(**base)) as (plain, plain_url), \
            _engine_server(EngineArgs(**base, kv_transfer_config=json.dumps({**kv, "kv_role": "kv_producer"}))) \
            as (_, prefill_url), \
            _engine_server(EngineArgs(**base, kv_transfer_config=json.dumps({**kv, "kv_role": "kv_consumer"}))) \
            as (decode, decode_url):
        proxy, proxy_url = _serve(build_proxy_app(ProxyConfig((prefill_url,), (decode_url,))))
        import openai

        model = openai.OpenAI(base_url=plain_url + "/v1", api_key="x").models.list().data[0].id
        vocab = plain.core.vocab_size
        print("| prompt tokens | bytes / prompt token | transfer ms / req | plain TTFT ms | PD TTFT ms "
              "| plain TPOT ms | PD TPOT ms |")
        print("|---|---|---|---|---|---|---|")
        for n in a.lengths:
            prompts = [[(7 * i + 13 * j) % (vocab - 1) + 1 for j in range(n)] for i in range(a.requests)]
            before = decode.stats()
            plain_runs = [_stream(plain_url, model, p, a.max_tokens) for p in prompts]
            pd_runs = [_stream(proxy_url, model, p, a.max_tokens) for p in prompts]
            after = decode.stats()
            loaded = after["kv_transfer_loaded"] - before["kv_transfer_loaded"]
            if loaded != a.requests or after["kv_transfer_failures"] != before["kv_transfer_failures"]:
                raise SystemExit(f"{n} tokens: {loaded} of {a.requests} prompts transferred, "
                                 f"{after['kv_transfer_failures'] - before['kv_transfer_failures']} failed")
            nbytes = after["kv_transfer_bytes_received"] - before["kv_transfer_bytes_received"]
            secs = after["kv_transfer_seconds"] - before["kv_transfer_seconds"]
            med = lambda runs, k: 1000 * statistics.median(r[k] for r in runs)  # noqa: E731
            print(f"| {n} | {nbytes / (a.requests * max(1, n - 1)):.0f} | {1000 * secs / a.requests:.1f} "
                  f"| {med(plain_runs, 0):.1f} | {med(pd_runs, 0):.1f} | {med(plain_runs, 1):.1f} "
                  f"| {med(pd_runs, 1):.1f} |")
        proxy.should_exit = True


if __name__ == "__main__":
    main()
