"""The worker: one per device. Owns the model, the KV/state pools, the runner, decode graphs and the sampler.

Life cycle (driven by an executor): ``Worker(config)`` loads the model onto the device; :meth:`Worker.info`
reports what the control plane needs (vocabulary, eos ids, cache bytes per token/slot, position limit);
:meth:`Worker.cache_budget` profiles a forward at ``max_num_batched_tokens`` on a GPU and returns the bytes left
for the cache under ``gpu_memory_utilization``; :meth:`Worker.init_cache` allocates the pools and block tables the
engine's :class:`~rocm_k3.cache.geometry.CacheGeometry` plans and captures the decode graphs (with speculation
also one per verification width, whose tapped hidden states feed the drafter; under pipeline parallelism each
stage's graphs hold only its layers, the hand-off to the neighbouring stages outside them); then :meth:`Worker.execute` runs one :class:`StepInput` and returns the :class:`StepOutput`.

A checkpoint whose ``config.json`` has a ``vision_config`` also gets its vision tower and projector
(:func:`~rocm_k3.model.vision.loader.load_vision_model`, full weights on every TP rank) on the first pipeline stage
only, where the runner's :class:`~rocm_k3.worker.image_inputs.ImageInputs` encodes the step's images.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from rocm_k3.cache.geometry import CacheGeometry
from rocm_k3.distributed.context import ParallelConfig, ParallelContext
from rocm_k3.distributed.groups import reduce_ints
from rocm_k3.kv_transfer.base import ConnectorMeta
from rocm_k3.kv_transfer.config import KVTransferConfig
from rocm_k3.kv_transfer.socket_connector import SocketConnectorWorker
from rocm_k3.kv_transfer.tp_layout import TPShard
from rocm_k3.kv_transfer.workers import connector_worker
from rocm_k3.spec_decode.acceptance import expand_rows, verify_rows
from rocm_k3.spec_decode.config import SpeculativeConfig
from rocm_k3.spec_decode.draft_proposer import DraftProposer
from rocm_k3.spec_decode.dspark_proposer import DSparkProposer
from rocm_k3.model.loader import load_model
from rocm_k3.model.moe import MoEBlock, RoutedExperts
from rocm_k3.model.vision.loader import load_vision_model, vision_config_of
from rocm_k3.settings import DEFAULT_MAX_NUM_BATCHED_TOKENS
from rocm_k3.worker.image_inputs import ImageInputs
from rocm_k3.worker.stage_link import StageLink
from rocm_k3.worker.cuda_graph import DecodeGraphs, graph_buckets
from rocm_k3.worker.kv_pools import KVPools, PoolShapes
from rocm_k3.worker.layer_view import LayerHookView
from rocm_k3.worker.model_runner import ModelRunner, PreviousTokens, model_passes, sampling_chunks
from rocm_k3.worker.request_state import RequestTable
from rocm_k3.worker.sampler import prompt_token_logprobs, sample
from rocm_k3.worker.step_io import PromptLogprobs, SampledToken, ScheduledChunk, StepInput, StepOutput
from rocm_k3.worker.structured_sampling import StructuredSampling
from rocm_k3.worker.vocab_shard import VocabShard

log = logging.getLogger("rocm_k3.worker")

DECODE_OPS = ("rms_norm", "attn_res_step", "kda_decode", "mla_write_cache", "mla_decode", "route", "fused_moe",
              "situ_and_mul")
NON_FINITE = "non-finite logits: the model produced NaN or Inf logits for this request"
SPANS_KEPT = 256  # the last steps' (step id, start, end) times a rank keeps for rank_stats
KDA_KERNEL_SAVE_GRID = 64  # the chunk size of the chunked KDA kernels: they save states at chunk ends only


@dataclasses.dataclass
class _Launched:
    """A launched step (:meth:`Worker.launch`) awaiting :meth:`Worker.finish`: its output when it needs no read
    from the device, else what the read completes (sampling chunks and rows, their StepBatch, the sampler's output
    and its [3, R] tokens / finite / fallback flags on the device, the prompt log-probabilities)."""

    step: StepInput
    output: StepOutput | None
    chunks: list[ScheduledChunk] = dataclasses.field(default_factory=list)
    rows: list[ScheduledChunk] = dataclasses.field(default_factory=list)
    batch: Any = None
    sample: Any = None
    flags: torch.Tensor | None = None
    ready: Any = None  # on a GPU: the event after the flags' copy into pinned host memory (``flags`` is that copy)
    prompt: tuple[PromptLogprobs, ...] = ()
    start: float = 0.0
    kv: dict = dataclasses.field(default_factory=dict)


class DeviceError(ValueError):
    """A device that does not exist or cannot be used here."""


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    """What one worker needs to load and serve its model (validated)."""

    model_path: Path
    dtype: torch.dtype
    device: torch.device
    backend: str | None = None
    moe_act_quant: str = "bf16"
    progress: bool = False
    enforce_eager: bool = False
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = 32
    parallel: ParallelConfig = ParallelConfig()
    output_family: str | None = None  # "kimi_k3" / "kimi_k2": the grammar's marker tokens (None: no grammars)
    speculative: SpeculativeConfig | None = None  # the worker acts on method "draft_model" (it runs the drafter)
    kv_transfer: KVTransferConfig | None = None  # prefill/decode disaggregation (any TP, one PP stage)

    def __post_init__(self) -> None:
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise TypeError(f"speculative: expected SpeculativeConfig or None, got {type(self.speculative).__name__}")
        if self.speculative is not None:
            self.speculative.check_pipeline(self.parallel.pipeline_parallel_size)
        if self.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"dtype: expected bfloat16, float16 or float32, got {self.dtype}")
        if self.output_family not in (None, "kimi_k3", "kimi_k2"):
            raise ValueError(f"output_family: expected 'kimi_k3', 'kimi_k2' or None, got {self.output_family!r}")
        if not isinstance(self.parallel, ParallelConfig):
            raise TypeError(f"parallel: expected ParallelConfig, got {type(self.parallel).__name__}")
        if self.parallel.is_single:
            check_device(self.device)

    @property
    def drafts_on_worker(self) -> bool:
        return self.speculative is not None and self.speculative.method == "draft_model"

    def for_rank(self, rank: int) -> WorkerConfig:
        """This config on global ``rank``: GPU ranks use their node-local GPU."""
        if self.device.type != "cuda":
            return self
        return dataclasses.replace(self, device=torch.device("cuda", rank % self.parallel.gpus_per_node))


def check_device(device: torch.device) -> None:
    """Raise DeviceError naming ``device`` when it cannot be used on this machine."""
    if device.type == "cpu":
        return
    if device.type == "cuda":  # NVIDIA, and ROCm builds of torch (HIP devices are "cuda" in torch)
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = device.index if device.index is not None else 0
        if index >= count:
            raise DeviceError(f"device {str(device)!r}: this machine has {count} GPU(s) visible to torch"
                              + ("" if count else " (is this a CPU build of torch?)"))
        return
    raise DeviceError(f"device {str(device)!r}: expected 'cpu' or 'cuda[:N]' (ROCm GPUs are 'cuda' in torch)")


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """Model facts for the control plane (which imports no model code)."""

    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    bytes_per_token: int  # MLA latent bytes of one token over this rank's layers (a block is block_size of them)
    bytes_per_slot: int
    device: str
    dtype: str
    kda_save_grid: int = 64
    accepts_images: bool = False  # the first stage holds a vision tower


class Worker:
    """See the module docstring. ``model`` / ``vision_model``: already loaded models to serve (tests); without
    ``model`` both are loaded from ``config.model_path`` (the vision model when the checkpoint has one)."""

    def __init__(self, config: WorkerConfig, model=None, ctx: ParallelContext | None = None,
                 vision_model=None) -> None:
        self.config = config
        self.device = config.device
        self.ctx = ParallelContext.single() if ctx is None else ctx
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        loaded_here = model is None
        if model is None:
            model = load_model(config.model_path, dtype=config.dtype, device=self.device, backend=config.backend,
                               progress=config.progress, moe_act_quant=config.moe_act_quant, ctx=self.ctx)
        elif model.device != self.device or model.dtype != config.dtype:
            raise ValueError(f"model: loaded on {model.device} as {model.dtype}, the worker serves {self.device} "
                             f"as {config.dtype}")
        self.model = model
        if vision_model is None and loaded_here and self.ctx.is_first_stage:
            vision = vision_config_of(config.model_path)
            if vision is not None:
                vision_model = load_vision_model(config.model_path, vision, dtype=config.dtype, device=self.device,
                                                 backend=config.backend)
        self.vision_model = vision_model if self.ctx.is_first_stage else None
        self.shapes = PoolShapes.from_model(self.model, config.dtype)
        self.geometry: CacheGeometry | None = None  # the planned cache, from init_cache
        self.stage = StageLink(self.model, self.ctx)
        self.runner: ModelRunner | None = None
        self.structured = StructuredSampling(config.model_path, config.output_family, self.model.cfg.vocab_size)
        self.requests = RequestTable(self.structured, self.device)
        # draft_model speculation: the drafter (sampling rank only)
        self.proposer: DraftProposer | DSparkProposer | None = None
        if config.drafts_on_worker and self.ctx.is_sampling_rank:
            self.proposer = DraftProposer.for_model(config.speculative, self.model)
        elif hasattr(self.model, "tap_layers"):  # a model served before by a drafting worker taps nothing here
            self.model.tap_layers, self.model.tap_outputs = (), False
        self.connector: SocketConnectorWorker | None = None
        self._kv_step: dict[str, int | tuple[str, ...]] = {}
        self._kv_view: LayerHookView | None = None  # the step's per-layer transfer view (see _begin_kv)
        self._kv_t0: tuple[int, int, float] = (0, 0, 0.0)  # bytes sent, received before the step; seconds blocked
        self.shard = self._vocab_shard()
        self.spans: collections.deque[tuple[int, float, float]] = collections.deque(maxlen=SPANS_KEPT)
        self._launched: collections.deque[_Launched] = collections.deque()  # launched, not finished (oldest first)
        self._previous: PreviousTokens | None = None  # the last launched step's sampled tokens on the device
        self.idle_steps = 0  # data parallelism: steps this rank's replica sat out (its MoE layers ran zero tokens)

    @property
    def samples(self) -> bool:
        """Whether this rank takes part in sampling (holds the requests' sampling state): the sampling rank, and
        with a vocab-parallel LM head every TP rank of the last stage."""
        return self.ctx.is_sampling_rank or (self.shard is not None and self.ctx.is_last_stage)

    def _vocab_shard(self) -> VocabShard | None:
        """This rank's vocabulary slice when the last stage samples vocab-parallel (TP > 1): the LM head then
        returns only its slice of the logits and the sampler combines per-rank statistics; None otherwise."""
        ctx, head = self.ctx, getattr(self.model, "lm_head", None)
        if ctx.tp_size == 1 or not ctx.is_last_stage or head is None:
            return None
        why = ""
        shard = VocabShard.of_rank(head.vocab_size, ctx.tp_rank, ctx.tp_size, ctx.tp_group,
                                   lambda name, nbytes: (ctx.count(name), ctx.add("collective_bytes", nbytes)))
        if shard is None:
            why = f"a vocabulary of {head.vocab_size} leaves a TP rank of {ctx.tp_size} no token"
        elif self.config.drafts_on_worker:
            why = "draft_model speculation runs its drafter on TP rank 0 only"
        if why:
            log.warning("vocab-parallel sampling off, the LM head gathers the full logits: %s", why)
            return None
        head.gather_logits = False
        return shard

    def _common_unit_bytes(self) -> tuple[int, int]:
        """(MLA bytes per token, bytes per KDA slot) of the one cache geometry all ranks share: the largest any
        rank needs (a collective over the world group: every rank runs it). A pipeline stage without MLA (or KDA)
        layers needs 0 (1) of that kind, so the stage that has them sets the size, and budgets in these units
        give each stage at most the blocks / slots it can hold."""
        token, slot = reduce_ints([self.shapes.bytes_per_token(), self.shapes.bytes_per_slot()],
                                  self.ctx.world_cpu_group, "max")
        return token, slot

    def info(self) -> WorkerInfo:
        cfg = self.model.cfg
        token, slot = self._common_unit_bytes()
        return WorkerInfo(
            vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_position_embeddings,
            eos_token_ids=tuple(cfg.eos_token_id), bytes_per_token=token, bytes_per_slot=slot,
            device=str(self.device), dtype=str(self.config.dtype),
            kda_save_grid=self._kda_save_grid(), accepts_images=self.vision_model is not None,
        )

    def _kda_save_grid(self) -> int:
        """Where the bound kda_prefill can save intermediate states: anywhere (reference: 1) or at chunk ends (the
        GPU kernels: 64 tokens)."""
        table = getattr(self.model, "backend", None)
        chosen = table.chosen("kda_prefill") if hasattr(table, "chosen") else None
        return 1 if chosen == "reference" else KDA_KERNEL_SAVE_GRID

    # ---- memory sizing -------------------------------------------------------------------------------------
    def cache_budget(self, block_size: int) -> tuple[int, int] | None:
        """(kv_cache_bytes, state_cache_bytes) in the units of the common geometry (:meth:`info`'s bytes per
        token / slot) for the fewest blocks and slots any rank can hold on pages of ``block_size`` (see
        :meth:`_local_cache_budget`); None on the CPU."""
        local = self._local_cache_budget(block_size)
        if local is None:
            return None
        kv, state = local
        blocks, slots = reduce_ints([kv // self.shapes.bytes_per_block(block_size),
                                     state // self.shapes.bytes_per_slot()], self.ctx.world_cpu_group, "min")
        token, slot = self._common_unit_bytes()
        return blocks * max(1, token * block_size), slots * slot

    def _local_cache_budget(self, block_size: int) -> tuple[int, int] | None:
        """(kv_cache_bytes, state_cache_bytes) that fit in ``gpu_memory_utilization`` of the GPU after a profiled
        forward of ``max_num_batched_tokens`` tokens on pages of ``block_size``; None on the CPU (the configured
        budgets apply).

        Split: the KDA state slots get room for two per running request (running + one saved state for the
        prefix cache) plus one, but at most half of what is free; the MLA pages get the rest.
        """
        if self.device.type != "cuda":
            return None
        cfg = self.config
        torch.cuda.synchronize(self.device)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        pools, peak = self._profile_forward(block_size)
        activation_peak = peak - before - pools
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        available = int(total * cfg.gpu_memory_utilization) - before - activation_peak - max(0, non_torch)
        if available <= 0:
            raise MemoryError(
                f"no GPU memory left for the cache: {total / 2**30:.1f} GiB x gpu_memory_utilization="
                f"{cfg.gpu_memory_utilization} holds weights {before / 2**30:.2f} GiB + activations "
                f"{activation_peak / 2**30:.2f} GiB + other {max(0, non_torch) / 2**30:.2f} GiB")
        slot = self.shapes.bytes_per_slot()
        state = min(available // 2, slot * (2 * cfg.max_num_seqs + 1))
        log.info("GPU cache budget: %.2f GiB (KV %.2f GiB, KDA states %.2f GiB) after %.2f GiB weights and "
                 "%.2f GiB activations", available / 2**30, (available - state) / 2**30, state / 2**30,
                 before / 2**30, activation_peak / 2**30)
        return available - state, state

    def _profile_forward(self, bs: int) -> tuple[int, int]:
        """Run one prefill of ``max_num_batched_tokens`` dummy tokens on scratch pools of ``bs``-token pages;
        (pool bytes, peak bytes)."""
        tokens = self.config.max_num_batched_tokens
        blocks = math.ceil(tokens / bs)
        pools = KVPools(self.shapes, block_size=bs, num_blocks=blocks, num_slots=1, device=self.device)
        runner = ModelRunner(self.stage, pools, blocks)
        # distinct token ids: the router spreads them over the experts as real text does (one repeated token would
        # route every row to the same top-k experts and leave the MoE's wide-routing buffers, and under expert
        # parallelism other ranks' experts, out of the measured peak)
        vocab = self.model.cfg.vocab_size
        chunk = ScheduledChunk(request_id="profile", token_ids=tuple(i % vocab for i in range(tokens)), start=0,
                               admitted=True,
                               block_ids=tuple(range(blocks)), kda_slot=0, is_prefill=True, sample=True)
        runner.execute(StepInput(step_id=0, chunks=(chunk,)))
        torch.cuda.synchronize(self.device)
        pool_bytes = (blocks + 1) * self.shapes.bytes_per_block(bs) + 2 * self.shapes.bytes_per_slot()
        peak = torch.cuda.max_memory_allocated(self.device)
        del runner, pools
        for m in self._counting_experts():  # the dummy tokens are no load
            m.load.zero_()
        torch.cuda.empty_cache()
        return pool_bytes, peak

    # ---- cache and graphs ----------------------------------------------------------------------------------
    def init_cache(self, geometry: CacheGeometry) -> None:
        """Allocate the pools ``geometry`` plans (plus the scratch block and slot) and its block tables, and capture
        the decode graphs (GPU, not eager)."""
        if not isinstance(geometry, CacheGeometry):
            raise TypeError(f"init_cache: expected a CacheGeometry, got {type(geometry).__name__}")
        self.geometry = geometry
        if self.device.type == "cuda":  # memory a dropped engine still caches would fragment a pool this large
            gc.collect()
            torch.cuda.empty_cache()
        pools = KVPools(self.shapes, block_size=geometry.block_size, num_blocks=geometry.num_blocks,
                        num_slots=geometry.num_slots, device=self.device)
        width = geometry.table_width
        self.runner = ModelRunner(self.stage, pools, width)
        self.runner.taps = self.model if self.proposer is not None else None
        if self.config.kv_transfer is not None:
            if self.connector is None:
                tp = TPShard(self.ctx.tp_rank, self.ctx.tp_size, self.ctx.tp_cpu_group)  # gloo over the TP ranks
                self.connector = connector_worker(self.config.kv_transfer, tp)
            self.connector.register_kv_caches(*pools.transfer_groups())
            self.runner.before_forward, self.runner.after_forward = self._begin_kv, self._end_kv
        if self.vision_model is not None:
            self.runner.images = ImageInputs(self.vision_model, self.ctx, device=self.device, dtype=self.config.dtype,
                                             ops=getattr(self.model, "backend", None))
        if self._graphs_wanted():
            graphs = self._capture_graphs(pools, width)
            self.runner.graphs = graphs if graphs.captured_keys else None

    def _graphs_wanted(self) -> bool:
        """Decode graphs on a GPU unless ``enforce_eager`` (the same on every rank)."""
        return self.device.type == "cuda" and not self.config.enforce_eager

    def _capture_graphs(self, pools: KVPools, width: int) -> DecodeGraphs:
        """This rank's decode graphs (under pipeline parallelism: of its stage), captured where
        :meth:`_graph_safe` allows, then only the shapes every rank captured (a collective over the world)."""
        spec = self.config.speculative
        graphs = DecodeGraphs(self.stage, pools, width, graph_buckets(self.config.max_num_seqs),
                              max_drafts=0 if spec is None else spec.num_speculative_tokens, taps=self.runner.taps)
        safe, why = self._graph_safe()
        if safe:
            self.stage.drain()  # no send of the profiled forward left open while the graphs are captured
            graphs.capture()
        else:
            log.warning("decode graphs off: %s", why)
        graphs.agree(self.ctx.world_cpu_group)
        for m in self._counting_experts():  # the capture's warm-up forwards are no load
            m.load.zero_()
        return graphs

    def _graph_safe(self) -> tuple[bool, str]:
        """Decode graphs need every decode-path op on a kernel backend (the references read values on the host)
        and, under expert parallelism, the static-capacity decode dispatch (the dynamic one sizes its all-to-all
        on the host)."""
        if self.ctx.ep_size > 1 and not self.ctx.static_ep_decode:
            return False, ("the dynamic expert-parallel decode dispatch (ep_decode_dispatch=dynamic, or data-parallel "
                           "replicas) sizes its all-to-all on the host")
        table = getattr(self.model, "backend", None)
        if not hasattr(table, "chosen"):
            return False, "the model's ops are not bound to a table"
        on_reference = [op for op in DECODE_OPS if table.chosen(op) in (None, "reference")]
        if on_reference:
            return False, f"ops {on_reference} run on the reference backend, which cannot be captured"
        return True, "ok"

    # ---- one step ------------------------------------------------------------------------------------------
    def _begin_kv(self, step: StepInput) -> LayerHookView | None:
        """After the step's copies, before its forward: start the step's loads (fetched layer by layer on a
        background thread) and either move every layer now (the default) or, with ``"layerwise": true`` in
        kv_connector_extra_config, return a view that publishes (producer) and copies in (consumer) each layer the
        first time the forward takes its pool, so later layers move while earlier ones compute. Layer by layer
        measured no faster on the CPU (the fetch thread and the forward share the GIL; benchmarks/RESULTS.md), so
        it is opt-in. None: the forward uses the pools as they are."""
        meta, conn = step.kv_connector_meta, self.connector
        if meta is None or conn is None or not (meta.saves or meta.loads):
            return None
        conn.discard_finished()  # what a step cut short left behind is not this step's
        self._kv_t0 = (conn.stats.bytes_sent, conn.stats.bytes_received, 0.0)
        t0 = time.perf_counter()
        if meta.loads:
            conn.start_load_kv(meta)
        self._kv_blocked(t0)
        if not conn.config.kv_connector_extra_config.get("layerwise", False):
            self._kv_layer(meta, conn.layer_names())
            return None
        self._kv_view = LayerHookView(self.runner.pools, lambda name: self._kv_layer(meta, (name,)))
        return self._kv_view

    def _kv_layer(self, meta: ConnectorMeta, names: tuple[str, ...]) -> None:
        t0 = time.perf_counter()
        for name in names:
            if meta.saves:
                self.connector.save_kv_layer(name, meta)
            if meta.loads:
                self.connector.wait_for_layer_load(name)
        self._kv_blocked(t0)

    def _kv_blocked(self, since: float) -> None:
        """Count the time since ``since`` as the step's time blocked on the transfer (not hidden by compute)."""
        sent, received, blocked = self._kv_t0
        self._kv_t0 = (sent, received, blocked + time.perf_counter() - since)

    def _end_kv(self, step: StepInput) -> None:
        """After the forward: the layers it did not take (none in a whole model), the save, the step's results."""
        meta, conn, view = step.kv_connector_meta, self.connector, self._kv_view
        if meta is None or conn is None or not (meta.saves or meta.loads):
            return
        self._kv_view = None
        if view is not None:
            if len(view.order) == len(conn.layer_names()):
                conn.set_layer_order(view.order)  # the next loads are fetched in the order the forward reads them
            self._kv_layer(meta, tuple(n for n in conn.layer_names() if n not in view.order))
        t0 = time.perf_counter()
        conn.wait_for_save()
        self._kv_blocked(t0)
        fin = conn.get_finished()
        sent, received, blocked = self._kv_t0
        self._kv_step = {"kv_received": tuple(sorted(fin.received)), "kv_failed": tuple(sorted(fin.failed)),
                         "kv_bytes_sent": conn.stats.bytes_sent - sent,
                         "kv_bytes_received": conn.stats.bytes_received - received,
                         "kv_transfer_s": blocked}

    def execute_replicas(self, steps: tuple[StepInput | None, ...]) -> StepOutput | None:
        """Data parallelism: run this rank's replica's entry of ``steps`` (one per replica), then one
        :meth:`idle_step` per model pass another replica runs beyond it (:func:`model_passes`: a replica without
        work, None, runs only idle ones; a step with verifications beside prefills runs two passes), so every
        replica's MoE layers meet the others' collectives; an entry without chunks only reports finished requests
        (their state is dropped) before its idle steps. Returns the StepOutput on the replica's sampling rank,
        else None."""
        if not isinstance(steps, tuple) or len(steps) != self.ctx.dp_size:
            raise ValueError(f"execute_replicas: expected a tuple of {self.ctx.dp_size} steps (one per data-parallel "
                             f"replica), got {steps!r}")
        step = steps[self.ctx.dp_rank]
        idle = max(model_passes(s) for s in steps) - model_passes(step)
        out = None
        if step is None or not step.chunks:
            if step is not None:
                for rid in step.finished_request_ids:
                    self.requests.drop(rid)
                    if self.proposer is not None:
                        self.proposer.drop(rid)
                self.runner.apply_requests(step)
        else:
            out = self.execute(step)
        for _ in range(idle):
            self.idle_step()
        return out if self.ctx.is_sampling_rank else None

    def idle_step(self) -> None:
        """A step of the other replicas: every MoE layer, in order, with zero tokens of this replica (see
        :meth:`~rocm_k3.model.moe.MoEBlock.idle`), so their expert-parallel collectives complete."""
        self.idle_steps += 1
        for module in self.model.modules():
            if isinstance(module, MoEBlock):
                module.idle(self.device, self.config.dtype)

    def execute(self, step: StepInput) -> StepOutput:
        """Run one step: :meth:`launch` then :meth:`finish`. A step launched by an execute that an exception (a
        Ctrl-C) cut short between the two is dropped first: the engine abandoned it, and one step at a time the
        oldest launched step must be this one."""
        self._launched.clear()
        self.launch(step)
        return self.finish()

    def launch(self, step: StepInput) -> None:
        """Start a step without reading anything back from the device: request deltas, copies, the forward and
        the sampler's kernels (asynchronous scheduling launches step N + 1 before :meth:`finish` reads step N; a
        ``from_previous`` decode takes its input token from the last launched step's samples on the device)."""
        self._kv_step = {}
        start = time.monotonic()
        launched = self._launch(step)
        launched.start, launched.kv = start, self._kv_step
        self._launched.append(launched)

    def finish(self) -> StepOutput:
        """The oldest launched step's output: its one device -> host read and the StepOutput."""
        if not self._launched:
            raise RuntimeError("finish: no step was launched")
        launched = self._launched.popleft()
        out = self._finish(launched)
        step = launched.step
        if step.chunks:  # when this rank ran each step (CLOCK_MONOTONIC: comparable across the node's ranks)
            self.spans.append((step.step_id, launched.start, time.monotonic()))
        return dataclasses.replace(out, **launched.kv) if launched.kv else out

    def _launch(self, step: StepInput) -> _Launched:
        if self.runner is None:
            raise RuntimeError("execute: init_cache() has not run")
        for rid in step.finished_request_ids:  # first: a finished id may be reused by a new request
            self.requests.drop(rid)
            if self.proposer is not None:
                self.proposer.drop(rid)
        if self.samples:  # sampling state (generators, penalties, grammars) lives on the sampling ranks only
            for req in step.new_requests:
                self.requests.register(req)
        if not step.chunks:
            return _Launched(step, StepOutput(step.step_id))
        chunks = sampling_chunks(step)
        previous, self._previous = self._previous, None
        if not self.samples:  # only the last stage samples (TP rank 0, or all its TP ranks vocab-parallel)
            self.runner.execute(step, previous)
            return _Launched(step, StepOutput(step.step_id))
        rows = expand_rows(chunks)  # one sampling row per logits row (a verification has 1 + num_draft)
        batch = self.requests.begin_step(step, chunks)  # starts the grammar masks: they fill during the forward
        try:
            logits = self.runner.execute(step, previous)  # [R + prompt rows, vocab (this rank's slice)] fp32
            prompt = self._prompt_logprobs(step, logits[len(rows):])
            if not chunks:
                return _Launched(step, StepOutput(step.step_id, prompt_logprobs=prompt))
            tokens = None if self.shard is None else (self.shard.start, self.shard.width)
            out = sample(logits[: len(rows)], batch.params, batch.generators, batch.processors(tokens), self.shard)
            flags = torch.stack([out.token_ids, out.finite.long(), out.fallback.long()])  # [3, R] on the device
        finally:
            batch.close()
        if len(rows) == len(chunks):  # (row i samples chunks[i]; a verification's rows are never taken ahead)
            self._previous = PreviousTokens(out.token_ids, {c.request_id: i for i, c in enumerate(chunks)})
        ready = None
        if flags.is_cuda:  # the read is queued now, behind this step's kernels only: a later launched step's
            # kernels (asynchronous scheduling) never delay it, as a .tolist() at finish time would
            host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            flags, ready = host.copy_(flags, non_blocking=True), torch.cuda.Event()
            ready.record()
        return _Launched(step, None, chunks, rows, batch, out, flags, ready, prompt)

    def _finish(self, launched: _Launched) -> StepOutput:
        if launched.output is not None:
            return launched.output
        step, chunks, batch, out = launched.step, launched.chunks, launched.batch, launched.sample
        if launched.ready is not None:
            launched.ready.synchronize()  # this step's copy, not the steps launched after it
        tokens, finite, fallback = launched.flags.tolist()  # the step's one device -> host read
        if not self.ctx.is_sampling_rank:  # a vocab-parallel TP rank > 0: its part of the sampling is done
            return StepOutput(step.step_id)
        fallbacks = sum(fallback)
        if len(launched.rows) != len(chunks):
            sampled = verify_rows(chunks, tokens, [bool(f) for f in finite], out.logprobs, batch.error,
                                  NON_FINITE, batch.draft_limit)
        else:
            errors = batch.errors()
            sampled = [SampledToken(c.request_id, tok, None if lp is None else tuple(lp.items()),
                                    err or ("" if ok else NON_FINITE))
                       for c, tok, ok, lp, err in zip(chunks, tokens, finite, out.logprobs, errors)]
        if self.proposer is not None:
            sampled = self.proposer.attach(step.chunks, sampled)
        return StepOutput(step.step_id, tuple(sampled), launched.prompt, sampler_fallbacks=fallbacks)

    def _prompt_logprobs(self, step: StepInput, logits: torch.Tensor) -> tuple[PromptLogprobs, ...]:
        """The prompt log-probabilities of the chunks with ``prompt_logprob_rows`` from their logits rows
        (``logits`` [sum of those rows, vocab], in chunk order)."""
        asking = [c for c in step.chunks if c.prompt_logprob_rows]
        if not asking:
            return ()
        targets, ks = [], []
        for c in asking:
            state = self.requests.state(c.request_id)
            targets += state.prompt_token_ids[c.start + 1 : c.start + 1 + c.prompt_logprob_rows]
            ks += [state.sampling.prompt_logprobs] * c.prompt_logprob_rows
        entries, ranks = prompt_token_logprobs(logits, targets, ks, self.shard)
        out, at = [], 0
        for c in asking:
            n = c.prompt_logprob_rows
            out.append(PromptLogprobs(c.request_id, c.start + 1, tuple(entries[at : at + n]),
                                      tuple(ranks[at : at + n])))
            at += n
        return tuple(out)

    def close(self) -> None:
        """Wait for this stage's open sends; stop the KV connector's transfer server (a producer's block store)."""
        self.stage.drain()
        if self.connector is not None:
            self.connector.close()
            self.connector = None

    def _counting_experts(self) -> list[RoutedExperts]:
        return [m for m in self.model.modules() if isinstance(m, RoutedExperts) and m.load is not None]

    def rank_stats(self, reset: bool = False) -> dict:
        """This rank's place, the checkpoint bytes it read, the collectives it issued and when it ran its last
        steps (``step_spans``: (step id, start, end) on the monotonic clock), then reset if asked."""
        ctx = self.ctx
        graphs = None if self.runner is None else self.runner.graphs
        out = {"rank": ctx.rank, "tp_rank": ctx.tp_rank, "pp_rank": ctx.pp_rank, "dp_rank": ctx.dp_rank,
               "loaded_bytes": int(getattr(self.model, "loaded_bytes", 0)), "collectives": dict(ctx.stats),
               "idle_steps": self.idle_steps, "known_requests": len(self.requests),
               "request_rows": 0 if self.runner is None else len(self.runner.rows), "expert_load": {},
               "graph_replays": 0 if graphs is None else graphs.replays,
               "graph_verify_replays": 0 if graphs is None else graphs.verify_replays,
               "step_spans": list(self.spans)}
        for m in self._counting_experts():  # EP ranks count the picks per logical expert of their stage's layers
            out["expert_load"][m.layer] = m.load.tolist()
            if reset:
                m.load.zero_()
        if reset:
            ctx.stats.clear()
            self.spans.clear()
            self.idle_steps = 0
        return out
