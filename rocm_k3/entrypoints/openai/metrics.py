"""Prometheus metrics of one server (``GET /metrics``), in a registry of its own (no process-global state).

Per request (recorded by the serving code as outputs stream out): prompt and generation token counters,
finished requests by finish reason, time to first token, inter-token latency (per token: the gap between two
deltas divided by the tokens the later one brought) and end-to-end latency histograms. From the engine's
stats snapshot at scrape time: requests running / waiting, free and total KV blocks and KDA state slots,
prefix-cache queries, hits and hit rate, preemptions, steps, sampler fallbacks (``rocm_k3_sampler_fallbacks_total``:
tokens taken as the top logit because the processed probabilities were unusable), speculative decoding (drafts,
drafted and accepted tokens, accepted tokens per draft position: vLLM's ``spec_decode_*`` names), and whether the
engine is healthy;
with expert parallelism the picks per logical expert of each MoE layer (``rocm_k3_expert_load_total{layer,
expert}``).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rocm_k3.engine.async_llm import AsyncLLM
from rocm_k3.engine.outputs import RequestDelta

PREFIX = "rocm_k3_"
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.2, 0.4, 0.8, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)

# engine stats key -> (metric name, help, kind)
_ENGINE_METRICS = (
    ("running", "requests_running", "requests scheduled on the engine", "gauge"),
    ("waiting", "requests_waiting", "requests queued for the engine", "gauge"),
    ("free_blocks", "kv_blocks_free", "MLA KV cache blocks free or evictable", "gauge"),
    ("num_blocks", "kv_blocks_total", "MLA KV cache blocks", "gauge"),
    ("free_state_slots", "kda_slots_free", "KDA state slots free or evictable", "gauge"),
    ("num_state_slots", "kda_slots_total", "KDA state slots", "gauge"),
    ("hit_rate", "prefix_cache_hit_rate", "prefix-cache hit rate (cached tokens / queried tokens)", "gauge"),
    ("query_tokens", "prefix_cache_queried_tokens", "prompt tokens looked up in the prefix cache", "counter"),
    ("hit_tokens", "prefix_cache_hit_tokens", "prompt tokens served from the prefix cache", "counter"),
    ("preemptions", "preemptions", "requests preempted (to be recomputed)", "counter"),
    ("steps", "engine_steps", "engine steps run", "counter"),
    ("sampler_fallbacks", "sampler_fallbacks", "sampled tokens taken as the top logit because the processed "
     "probabilities were unusable (NaN, all zero or every token masked after extreme sampling values)", "counter"),
    # prefill/decode disaggregation (--kv-transfer-config)
    ("kv_transfer_loaded", "kv_transfer_requests", "prompt caches loaded from a prefill instance", "counter"),
    ("kv_transfer_failures", "kv_transfer_failures",
     "prompt cache loads that failed (checksum mismatch, timeout, producer gone): the prompt was recomputed",
     "counter"),
    ("kv_transfer_published", "kv_transfer_published", "prompt caches published for a decode instance", "counter"),
    ("kv_transfer_bytes_received", "kv_transfer_received_bytes", "prompt cache bytes loaded", "counter"),
    ("kv_transfer_bytes_sent", "kv_transfer_sent_bytes", "prompt cache bytes published", "counter"),
    # speculative decoding, vLLM's names (vllm:spec_decode_*) under our prefix
    ("spec_num_drafts", "spec_decode_num_drafts", "verification steps of drafted tokens", "counter"),
    ("spec_num_draft_tokens", "spec_decode_num_draft_tokens", "drafted tokens verified", "counter"),
    ("spec_num_accepted_tokens", "spec_decode_num_accepted_tokens", "drafted tokens accepted", "counter"),
)
_SPEC_POS_PREFIX = "spec_num_accepted_tokens_pos"


class _EngineCollector:
    """Reads the engine's stats snapshot at scrape time."""

    def __init__(self, engine: AsyncLLM) -> None:
        self._engine = engine

    def collect(self):
        stats = self._engine.stats()
        for key, name, doc, kind in _ENGINE_METRICS:
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(PREFIX + name, doc)
            family.add_metric([], float(stats.get(key, 0.0)))
            yield family
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "drafted tokens accepted, by draft position", labels=["position"])
        for key, value in stats.items():
            if key.startswith(_SPEC_POS_PREFIX):
                per_pos.add_metric([key.removeprefix(_SPEC_POS_PREFIX)], float(value))
        yield per_pos
        loads = self._engine.expert_loads()
        if loads:
            family = CounterMetricFamily(PREFIX + "expert_load", "routed picks per logical expert and MoE layer "
                                         "(expert parallelism; rocm-k3 expert-placement balances from them)",
                                         labels=["layer", "expert"])
            for layer, per_expert in loads.items():
                for expert, n in enumerate(per_expert):
                    family.add_metric([str(layer), str(expert)], float(n))
            yield family
        healthy = GaugeMetricFamily(PREFIX + "engine_healthy", "1 while the engine serves requests, 0 once it failed")
        healthy.add_metric([], 0.0 if self._engine.is_dead else 1.0)
        yield healthy


class RequestTimer:
    """The latency bookkeeping of one request (one choice); ``on_delta`` for each delta as it is sent."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self.start = time.monotonic()
        self._last: float | None = None
        self.num_tokens = 0

    def on_delta(self, delta: RequestDelta) -> None:
        n = len(delta.new_token_ids)
        if n:
            now = time.monotonic()
            if self._last is None:
                self._metrics.ttft.observe(now - self.start)
            else:
                gap = (now - self._last) / n
                for _ in range(n):
                    self._metrics.itl.observe(gap)
            self._last = now
            self.num_tokens += n
            self._metrics.generation_tokens.inc(n)
        if delta.finished:
            self._metrics.requests.labels(finish_reason=delta.finish_reason or "abort").inc()
            self._metrics.e2e.observe(time.monotonic() - self.start)


class ServerMetrics:
    """The server's registry and request-side metrics; :meth:`render` is the ``/metrics`` body."""

    def __init__(self, engine: AsyncLLM) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "generated tokens sent", registry=r)
        self.requests = Counter(PREFIX + "requests_finished", "finished requests", ["finish_reason"], registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "time from arrival to the first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "time between two generated tokens",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "request_latency_seconds", "time from arrival to the last token",
                             buckets=E2E_BUCKETS, registry=r)
        r.register(_EngineCollector(engine))

    def timer(self) -> RequestTimer:
        return RequestTimer(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)
