"""EngineArgs: the one list of engine knobs, from which the LLM keyword arguments, the CLI flags of
``generate`` / ``serve`` and the per-concern configs (cache, engine, worker) are all derived.

Flag names follow vLLM (``--max-model-len``, ``--gpu-memory-utilization``, ``--enforce-eager``,
``--no-enable-prefix-caching`` ...). Values are validated where they become configs (CacheConfig, EngineConfig,
WorkerConfig each check their fields in ``__post_init__``).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from rocm_k3.checks import check_int
from rocm_k3.formats.parsers.registry import PARSER_ALIASES
from rocm_k3.settings import BACKEND_CHOICES, DEFAULT_MAX_NUM_BATCHED_TOKENS, EP_DECODE_DISPATCH

DTYPE_CHOICES = ("auto", "bfloat16", "float32", "float16")
PARSER_CHOICES = tuple(PARSER_ALIASES)
MOE_ACT_QUANT_CHOICES = ("bf16", "mxfp8")
SERVER_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")  # SGLang's / vLLM's --log-level choices


def option(default: Any, help: str, **flag: Any) -> Any:
    """A dataclass field that is also a CLI flag: its default, its help text and any of ``choices`` / ``aliases``
    (read by ``add_dataclass_flags``)."""
    return dataclasses.field(default=default, metadata={"help": help, **flag})


@dataclasses.dataclass
class EngineArgs:
    """Every knob of the engine (help texts are the CLI's).

    model: checkpoint directory; None = the embedded tiny K3 model.
    """

    model: str | None = option(None, "checkpoint directory (default: the embedded tiny K3 model)")
    dtype: str = option("auto", "auto: bfloat16 on a GPU, float32 on the CPU", choices=DTYPE_CHOICES)
    backend: str | None = option(None, "op backend for every op (default: ROCM_K3_BACKEND or auto)",
                                 choices=BACKEND_CHOICES)
    device: str | None = option(None, "torch device (default: first GPU, else cpu)")
    max_model_len: int | None = option(None, "longest prompt + generation (default: what one request can hold, at "
                                       "most max_position_embeddings)")
    moe_act_quant: str = option("bf16", "routed-expert activations: bf16 (A16W4) or mxfp8 (A8W4)",
                                choices=MOE_ACT_QUANT_CHOICES)
    enable_prefix_caching: bool = option(True, "KDA-aware prefix caching (outputs are identical either way)")
    block_size: int = option(128, "MLA KV page size in tokens")
    match_unit: int = option(64, "prefix-cache hash granularity in tokens")
    alignment: int = option(256, "prefill chunk grid in tokens (KDA saves)")
    max_num_batched_tokens: int = option(DEFAULT_MAX_NUM_BATCHED_TOKENS, "new tokens per engine step (prefill "
                                         "chunks + decodes). The default 1536 is the largest budget measured to keep "
                                         "decodes' inter-token p99 within 3x of p50 while long prompts arrive (H200, "
                                         "benchmarks/bench_mixed_load.py: p99/p50 1.17 at 1536, 15.5 at 2048; "
                                         "docs/scheduling.md)")
    long_prefill_token_threshold: int = option(0, "most tokens one prefill chunk takes per step (rounded up to "
                                               "--alignment), so a long prompt shares the step with decodes and other "
                                               "prefills instead of filling it; 0: no cap (vLLM's flag)")
    max_num_seqs: int = option(32, "requests running at once")
    gpu_memory_utilization: float = option(0.9, "fraction of GPU memory for weights, activations and the cache (GPU "
                                           "only)")
    kv_cache_bytes: int | None = option(None, "MLA KV page budget in bytes (overrides gpu_memory_utilization sizing)")
    state_cache_bytes: int | None = option(None, "KDA state slot budget in bytes (overrides gpu_memory_utilization "
                                           "sizing)")
    enforce_eager: bool = option(False, "never capture decode graphs")
    async_scheduling: bool = option(False, "schedule the next step while the device runs this one: a decode's input "
                                    "token is taken on the device from the step before, so the host's scheduling "
                                    "and output processing overlap the device (vLLM's flag; one process, not with "
                                    "speculative decoding or kv_transfer_config)")
    progress: bool = option(False, "show a progress bar while loading")
    tensor_parallel_size: int = option(1, "tensor-parallel ranks (GPUs of one node; heads and expert intermediate "
                                       "dims must divide)", aliases=("-tp",))
    pipeline_parallel_size: int = option(1, "pipeline stages (contiguous layer ranges, usually one node each)",
                                         aliases=("-pp",))
    data_parallel_size: int = option(1, "attention replicas (DP attention), each with its own scheduler and cache "
                                     "and requests balanced over them; their MoE layers form one expert-parallel "
                                     "group of data x tensor parallel ranks (needs --enable-expert-parallel)",
                                     aliases=("-dp",))
    enable_expert_parallel: bool = option(False, "split the routed experts whole over the tensor-parallel ranks "
                                          "(x the data-parallel replicas) instead of per expert")
    num_redundant_experts: int = option(0, "extra physical expert slots per MoE layer holding replicas of busy "
                                        "experts (with --enable-expert-parallel; num_experts + this must split over "
                                        "the ranks)")
    expert_placement: str | None = option(None, "expert placement JSON (rocm-k3 expert-placement writes one from "
                                          "recorded loads)")
    ep_decode_dispatch: str = option("auto", "how decode steps move expert-parallel picks: static (a fixed "
                                     "capacity per rank pair: shapes a decode graph can capture, ~T x k rows per "
                                     "rank), dynamic (the prefill's variable all-to-all, ~T x k / ep rows per rank; "
                                     "decode graphs off under EP) or auto (static inside decode graphs, dynamic in "
                                     "eager steps)", choices=EP_DECODE_DISPATCH)
    nnodes: int = option(1, "nodes of the run (node 0 serves)")
    node_rank: int = option(0, "this node's rank (> 0 runs headless)")
    master_addr: str = option("127.0.0.1", "node 0's address for the process group")
    master_port: int = option(29517, "node 0's port for the process group")
    distributed_timeout: float = option(300.0, "seconds a step or collective may take before the run is ended with an "
                                        "error")
    speculative_config: str | None = option(None, 'speculative decoding as JSON (vLLM keys), e.g. \'{"method": '
                                            '"ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}\' or '
                                            '\'{"method": "draft_model", "model": "embedded-drafter", '
                                            '"num_speculative_tokens": 3}\' (model: a drafter directory or a Hugging '
                                            'Face repo id in the local HF cache, with optional "revision"; LLM(): a '
                                            "dict or JSON string)")
    kv_transfer_config: str | None = option(None, "prefill/decode disaggregation as JSON (vLLM keys), e.g. "
                                            '\'{"kv_connector": "SocketConnector", "kv_role": "kv_producer", '
                                            '"kv_port": 14579}\' (LLM(): a dict or JSON string)')

    tool_call_parser: str | None = option(None, "output family of tool calls (kimi_k3, kimi_k2 = Kimi Linear; "
                                          "default: from the checkpoint)", choices=PARSER_CHOICES)
    reasoning_parser: str | None = option(None, "output family of the reasoning channel (same choices; must agree "
                                          "with --tool-call-parser)", choices=PARSER_CHOICES)

    def parallel_config(self):
        from rocm_k3.distributed.context import ParallelConfig

        return ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                              pipeline_parallel_size=self.pipeline_parallel_size,
                              data_parallel_size=self.data_parallel_size,
                              enable_expert_parallel=self.enable_expert_parallel,
                              num_redundant_experts=self.num_redundant_experts,
                              expert_placement=None if self.expert_placement is None else str(self.expert_placement),
                              ep_decode_dispatch=self.ep_decode_dispatch,
                              nnodes=self.nnodes,
                              node_rank=self.node_rank, master_addr=self.master_addr, master_port=self.master_port,
                              timeout_s=self.distributed_timeout)

    def validated(self) -> EngineArgs:
        """Type checks that no config covers (the configs built from these args check the rest)."""
        if self.model is not None and not isinstance(self.model, (str, Path)):
            raise TypeError(f"model: expected a path or None, got {type(self.model).__name__}")
        if self.dtype not in DTYPE_CHOICES and not _is_torch_dtype(self.dtype):
            raise ValueError(f"dtype: expected one of {DTYPE_CHOICES} or a torch dtype, got {self.dtype!r}")
        if self.backend is not None and self.backend not in BACKEND_CHOICES:
            raise ValueError(f"backend: expected one of {BACKEND_CHOICES} or None, got {self.backend!r}")
        if self.moe_act_quant not in MOE_ACT_QUANT_CHOICES:
            raise ValueError(f"moe_act_quant: expected one of {MOE_ACT_QUANT_CHOICES}, got {self.moe_act_quant!r}")
        for name in ("enable_prefix_caching", "enforce_eager", "async_scheduling", "progress",
                     "enable_expert_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        for name in ("tool_call_parser", "reasoning_parser"):
            value = getattr(self, name)
            if value is not None and value not in PARSER_CHOICES:
                raise ValueError(f"{name}: expected one of {PARSER_CHOICES} or None, got {value!r}")
        from rocm_k3.spec_decode.config import SpeculativeConfig

        spec = SpeculativeConfig.parse(self.speculative_config)  # names a bad key or value here, before any load
        if spec is not None:
            spec.check_pipeline(self.pipeline_parallel_size)
        from rocm_k3.kv_transfer.config import KVTransferConfig

        if KVTransferConfig.parse(self.kv_transfer_config) is not None and (self.pipeline_parallel_size != 1
                                                                            or self.data_parallel_size != 1):
            raise ValueError("kv_transfer_config: prefill/decode disaggregation runs with pipeline_parallel_size 1 "
                             "and data_parallel_size 1 for now (any tensor_parallel_size)")
        if self.async_scheduling and (spec is not None or self.kv_transfer_config is not None):
            raise ValueError("async_scheduling: cannot be combined with speculative_config or kv_transfer_config")
        if self.async_scheduling and (self.tensor_parallel_size, self.pipeline_parallel_size,
                                      self.data_parallel_size, self.nnodes) != (1, 1, 1, 1):
            raise ValueError("async_scheduling: runs with the in-process executor only (tensor, pipeline and data "
                             "parallel size 1, one node)")
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
            raise ValueError(f"gpu_memory_utilization: expected a number in (0, 1], got {util!r}")
        return self

    # ---- the CLI -------------------------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> None:
        """One ``--flag`` per field (``--no-enable-prefix-caching`` for the default-on bools)."""
        group = parser.add_argument_group("engine and cache")
        add_dataclass_flags(group, cls, skip)
        if "enable_prefix_caching" not in skip:  # the flag name older versions of rocm-k3 documented
            group.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                               help=argparse.SUPPRESS)

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> EngineArgs:
        values: dict[str, Any] = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}
        return cls(**values).validated()


@dataclasses.dataclass
class ServerArgs:
    """The knobs of ``rocm-k3 serve`` beyond the engine's (help texts are the CLI's)."""

    host: str = option("127.0.0.1", "address to listen on (0.0.0.0: all)")
    port: int = option(8000, "TCP port (0: any free port)")
    api_key: str | None = option(None, "require 'Authorization: Bearer KEY' on the API routes (/health and /metrics "
                                 "stay open)")
    served_model_name: list[str] | None = option(None, "model name(s) the API answers to (default: the checkpoint "
                                                 "directory's name)")
    enable_auto_tool_choice: bool = option(False, 'serve tool_choice "auto" (the model decides when to call tools)')
    max_request_bytes: int = option(32 * 2**20, "largest request body accepted (bigger ones get 413)")
    allow_remote_images: bool = option(False, "fetch http(s) image_url parts of chat requests (default: only data: "
                                       "URLs are taken)")
    max_image_bytes: int = option(20 * 2**20, "largest image a chat request may carry, decoded or fetched (bigger "
                                  "ones get 400)")
    image_fetch_timeout: float = option(10.0, "with --allow-remote-images: seconds a request's remote images may "
                                        "take, all of them together (queueing, every redirect and byte included); "
                                        "past it the request gets 400 (vLLM's VLLM_IMAGE_FETCH_TIMEOUT)")
    image_fetch_workers: int = option(4, "with --allow-remote-images: threads of the pool that fetches remote images "
                                      "(slow image hosts wait there, never in the threads that serve other requests); "
                                      "one request uses at most half")
    image_fetch_max_redirects: int = option(3, "with --allow-remote-images: redirects followed per image (each hop is "
                                            "checked like the URL)")
    allow_private_image_hosts: bool = option(False, "with --allow-remote-images: also fetch from loopback, private "
                                             "and link-local addresses (default: only public addresses; unspecified, "
                                             "multicast and reserved ones never)")
    responses_store_size: int = option(1000, "how many /v1/responses results the in-memory store keeps for GET and "
                                       "previous_response_id (least recently used dropped first; 0: none)")
    chat_template: str | None = option(None, "a Jinja chat template (a file, or the template text itself) used "
                                       "instead of the checkpoint's chat format; it runs in jinja2's immutable sandbox")
    reasoning_effort_budgets: str = option("", "think-token budget of each reasoning_effort, e.g. "
                                           "'low=256,medium=1024' (defaults: minimal=64, low=256, medium=1024, "
                                           "high=4096; max: none); a request's thinking_token_budget wins")
    shutdown_timeout: float = option(30.0, "on SIGTERM / SIGINT: seconds running requests may take to finish (new "
                                     "ones get 503) before the rest are ended with an error event; a second signal "
                                     "exits at once")
    log_level: str | None = option(None, "log level of rocm-k3's log lines, and of uvicorn's unless "
                                   "--uvicorn-log-level is given (default: ROCM_K3_LOG_LEVEL, else warning)",
                                   choices=SERVER_LOG_LEVELS)
    uvicorn_log_level: str | None = option(None, "uvicorn's log level (default: --log-level, else info)",
                                           choices=(*SERVER_LOG_LEVELS, "trace"))

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host: expected a non-empty string, got {self.host!r}")
        check_int("port", self.port, 0, 65535)
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key: expected a non-empty string or None")
        names = self.served_model_name
        if names is not None and (isinstance(names, str) or not names
                                  or not all(isinstance(n, str) and n for n in names)):
            raise ValueError(f"served_model_name: expected a non-empty list of names, got {names!r}")
        if not isinstance(self.enable_auto_tool_choice, bool):
            raise ValueError(f"enable_auto_tool_choice: expected a bool, got {self.enable_auto_tool_choice!r}")
        check_int("max_request_bytes", self.max_request_bytes, 1024)
        if not isinstance(self.allow_remote_images, bool):
            raise ValueError(f"allow_remote_images: expected a bool, got {self.allow_remote_images!r}")
        check_int("max_image_bytes", self.max_image_bytes)
        timeout = self.image_fetch_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 3600:
            raise ValueError(f"image_fetch_timeout: expected seconds in (0, 3600], got {timeout!r}")
        for name, low, high in (("image_fetch_workers", 1, 256), ("image_fetch_max_redirects", 0, 20)):
            check_int(name, getattr(self, name), low, high)
        if not isinstance(self.allow_private_image_hosts, bool):
            raise ValueError(f"allow_private_image_hosts: expected a bool, got {self.allow_private_image_hosts!r}")
        check_int("responses_store_size", self.responses_store_size, 0)
        if self.chat_template is not None:
            read_chat_template_arg(self.chat_template)  # ValueError naming a missing or unreadable file
        from rocm_k3.formats.chat_base import parse_effort_budgets

        parse_effort_budgets(self.reasoning_effort_budgets)  # ValueError naming a bad entry
        timeout = self.shutdown_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout <= 86400:
            raise ValueError(f"shutdown_timeout: expected seconds in [0, 86400], got {timeout!r}")
        if self.log_level is not None and self.log_level not in SERVER_LOG_LEVELS:
            raise ValueError(f"log_level: expected one of {SERVER_LOG_LEVELS} or None, got {self.log_level!r}")
        if self.uvicorn_log_level is not None and self.uvicorn_log_level not in (*SERVER_LOG_LEVELS, "trace"):
            raise ValueError(f"uvicorn_log_level: expected one of {(*SERVER_LOG_LEVELS, 'trace')} or None, got "
                             f"{self.uvicorn_log_level!r}")

    @property
    def resolved_log_level(self) -> str:
        """The ``rocm_k3`` loggers' level: ``log_level``, else ROCM_K3_LOG_LEVEL (lower case)."""
        from rocm_k3.settings import get_settings

        return self.log_level or get_settings().log_level.lower()

    @property
    def resolved_uvicorn_log_level(self) -> str:
        """uvicorn's level: ``uvicorn_log_level``, else ``log_level``, else info."""
        return self.uvicorn_log_level or self.log_level or "info"

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        add_dataclass_flags(parser.add_argument_group("server"), cls, ())

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> ServerArgs:
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)})


def read_chat_template_arg(value: str) -> tuple[str, str]:
    """``--chat-template`` (vLLM's): a file's text, or the value itself when it is a template (has ``{{`` or
    ``{%``); returns (template, where it came from)."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"chat_template: expected a file or a Jinja template, got {value!r}")
    if "{{" in value or "{%" in value:
        return value, "--chat-template"
    path = Path(value)
    try:
        return path.read_text(encoding="utf-8"), f"--chat-template {path}"
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"chat_template: cannot read {value!r} as a template file ({exc})") from None


_FLAG_TYPES = {"int | None": int, "int": int, "float": float}


def add_dataclass_flags(group: Any, cls: type, skip: tuple[str, ...]) -> None:
    """One ``--flag`` per dataclass field: bools as ``--x/--no-x``, ``list[str]`` fields take one or more values,
    the rest their type (``choices``, ``help`` and extra spellings ``aliases`` from the field metadata)."""
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        meta = dict(f.metadata)
        if f.type in ("bool", bool):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=meta["help"])
        elif str(f.type).startswith("list[str]"):
            group.add_argument(flag, nargs="+", default=f.default, help=meta.get("help"))
        else:
            group.add_argument(flag, *meta.get("aliases", ()), type=_FLAG_TYPES.get(str(f.type), str),
                               default=f.default, help=meta.get("help"), choices=meta.get("choices"), dest=f.name)


def _is_torch_dtype(value: object) -> bool:
    import torch

    return isinstance(value, torch.dtype)
