"""The Python API: ``rocm_k3.LLM(path).generate(prompts, rocm_k3.SamplingParams(...))``.

``LLM()`` with no path serves the embedded tiny K3 model (built on first use into ``settings.cache_dir``).
Images: a vision checkpoint (``vision_config``) takes ``{"prompt": ..., "multi_modal_data": {"image": ...}}``
prompts (see :meth:`LLM.generate`).
The request path is ``LLM -> EngineCore (scheduler + cache manager) -> executor -> worker -> model -> ops``:
chunked prefill, paged hybrid cache, prefix caching on by default; the engine and its prefix cache live as long
as the LLM, so a later ``generate`` call reuses prefixes of earlier ones. ``llm.stats()`` returns the counters.
Calls from several threads are serialised (each gets exactly the tokens it would get alone).

``llm.chat(messages, params, tools=..., tool_choice=..., response_format=...)`` renders a conversation in the
checkpoint's chat format and parses the answer into reasoning, content and tool calls (``rocm_k3.engine.chat``,
shared with the server); ``SamplingParams(structured_outputs=rocm_k3.StructuredOutputs(...))`` constrains
``generate`` with a grammar.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import numbers
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rocm_k3.args import EngineArgs
from rocm_k3.cache.errors import PromptTooLongError  # noqa: F401 (raised by the engine core; callers catch it here)
from rocm_k3.engine.chat_images import images_from_messages
from rocm_k3.engine.chat import ChatOutput, ChatRequest, chat_finish_reason
from rocm_k3.engine.assembly import assemble_engine, resolve_device, resolve_dtype, run_headless_node
from rocm_k3.engine.multimodal import MultiModalProcessor, MultiModalPrompt, multi_modal_images, named_image_error
from rocm_k3.engine.outputs import RequestOutput
from rocm_k3.model.config import ModelConfig
from rocm_k3.model.vision.preprocess import ImageError
from rocm_k3.model.vision.prompt import ImagePlacementError, MediaTokenInPromptError
from rocm_k3.sampling_params import SamplingParams
from rocm_k3.worker.step_io import ImageInput

Prompt = str | Sequence[int] | Mapping[str, Any]  # also a 1-d integer numpy array / torch tensor
PROMPT_KEYS = ("prompt", "prompt_token_ids", "multi_modal_data", "image_positions")


class LLM:
    """A loaded model plus its tokenizer, generating from text prompts or token-id lists.

    path:          checkpoint directory (Kimi K3 or Kimi Linear layout); None = the embedded tiny K3 model.
    dtype:         "bfloat16" (default), "float32", "float16", a torch dtype, or "auto" (bfloat16 on a GPU, float32
                   on the CPU, where bfloat16 matmuls are slow).
    backend:       op backend for every op ("reference", "triton", "flydsl", "aiter"); None = settings / auto.
    max_model_len: the longest prompt + generation allowed; default: what one request can hold in the cache, at
                   most max_position_embeddings.
    device:        torch device; default the first GPU if there is one, else the CPU.
    Every other keyword is an :class:`~rocm_k3.args.EngineArgs` field: enable_prefix_caching, block_size,
    match_unit, alignment, max_num_batched_tokens, max_num_seqs, gpu_memory_utilization (GPU sizing of the
    cache, default 0.9), kv_cache_bytes / state_cache_bytes (explicit budgets win), enforce_eager (no decode
    graphs), async_scheduling (the next step is launched before this one's tokens are read; one process, no
    speculation), moe_act_quant ("bf16" A16W4 or "mxfp8" A8W4), progress.
    """

    def __init__(self, path: str | Path | None = None, dtype: str | torch.dtype = "bfloat16",
                 backend: str | None = None, max_model_len: int | None = None,
                 device: str | torch.device | None = None, progress: bool = False,
                 moe_act_quant: str = "bf16", **engine_kwargs: Any) -> None:
        known = {f.name for f in dataclasses.fields(EngineArgs)}
        unknown = sorted(set(engine_kwargs) - known)
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword arguments {unknown}; engine knobs are {sorted(known)}")
        args = EngineArgs(model=None if path is None else str(path), dtype=dtype, backend=backend,
                          max_model_len=max_model_len, device=None if device is None else str(device),
                          progress=progress, moe_act_quant=moe_act_quant, **engine_kwargs)
        self._start(args)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        llm = cls.__new__(cls)
        llm._start(args)
        return llm

    def _start(self, args: EngineArgs) -> None:
        assembled = assemble_engine(args)
        self.engine, self.path, self.tokenizer = assembled.core, assembled.path, assembled.tokenizer
        self.args = args
        self.frontend = assembled.frontend
        self.multimodal = assembled.multimodal  # MultiModalProcessor of a vision checkpoint
        self.max_model_len = self.engine.config.max_model_len
        self.eos_token_ids = self.engine.eos_token_ids
        self.vocab_size = self.engine.vocab_size
        self._request_ids = itertools.count()
        self._lock = threading.Lock()

    @property
    def model(self):
        """The in-process worker's model (single-process executor only)."""
        worker = getattr(self.engine.executor, "worker", None)
        if worker is None:
            raise AttributeError("model: the model lives in the worker processes (tensor/pipeline parallelism)")
        return worker.model

    def shutdown(self) -> None:
        """Stop the worker processes (tensor/pipeline parallelism); the LLM cannot generate afterwards."""
        self.engine.executor.shutdown()

    @property
    def config(self) -> ModelConfig:
        return ModelConfig.from_pretrained(self.path)

    @property
    def dtype(self) -> torch.dtype:
        return resolve_dtype(self.args.dtype, self.device)

    @property
    def device(self) -> torch.device:
        return resolve_device(self.args.device)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for each prompt: a str, token ids (a list of ints, numpy / torch integer scalars included, or a
        1-d integer numpy array / torch tensor), a prompt dict, or a list of those; a 2-d integer array / tensor is
        one prompt per row. Returns one output per prompt. A ``bytes`` prompt is refused (TypeError): decode it to a
        str.

        A prompt dict holds ``"prompt"`` (str) or ``"prompt_token_ids"``, and optionally ``"multi_modal_data":
        {"image": image or [images]}`` (PIL images or image-file bytes; a vision checkpoint only). In a ``"prompt"``
        string each ``<|kimi_image_placeholder|>`` (the config's ``image_placeholder``) marks where the next image
        goes; a prompt without one gets its images before the text. With ``"prompt_token_ids"``,
        ``"image_positions"`` gives each image's insertion index into the ids (default: all before the text), e.g.
        ``RenderedChat.image_positions``. Bad images raise the named ImageError subclasses (ValueErrors).

        sampling_params: one SamplingParams for all prompts, one per prompt, or None (defaults).
        Raises PromptTooLongError for a prompt longer than ``max_model_len``, ValueError for an empty prompt,
        out-of-vocabulary ids or a text prompt when the checkpoint has no tokenizer.
        """
        batch = _as_prompt_list(prompts)
        if sampling_params is None:
            params = [SamplingParams()] * len(batch)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(batch)
        else:
            params = list(sampling_params)
            if len(params) != len(batch) or not all(isinstance(p, SamplingParams) for p in params):
                raise ValueError(f"sampling_params: expected one SamplingParams or {len(batch)} of them, "
                                 f"got {len(params)} items")
        prepared = [self._prepare(p, i) for i, p in enumerate(batch)]
        for p in {id(q): q for q in params}.values():  # one check per distinct params object
            self.frontend.check_sampling(p)
        with self._lock:
            return self._run_requests([ids for ids, _ in prepared], params, [ims for _, ims in prepared])

    def process_images(self, prompt_token_ids: Sequence[int], image_positions: Sequence[int] | None,
                       images: Any) -> MultiModalPrompt:
        """Rendered ids + each image's insertion index + the images -> the expanded prompt and its ImageInputs.

        The entry for a chat path (``RenderedChat.token_ids`` / ``RenderedChat.image_positions``): run the result
        with ``llm.engine.add_request(request_id, mm.token_ids, params, images=mm.images)`` (``generate`` does the
        same for ``{"prompt_token_ids": ids, "image_positions": positions, "multi_modal_data": {"image": ...}}``).
        """
        return self._multimodal("images").process_images([int(t) for t in prompt_token_ids], image_positions, images)

    def chat(self, messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
             sampling_params: SamplingParams | None = None, *, tools: Sequence[Mapping[str, Any]] | None = None,
             tool_choice: Any = None, parallel_tool_calls: bool = True,
             response_format: Mapping[str, Any] | None = None, structured_outputs: Any = None, chat_template_kwargs: Mapping[str, Any] | None = None,
             reasoning_effort: str | None = None, thinking_token_budget: int | None = None) -> list[ChatOutput]:
        """Chat completions: ``messages`` is one conversation (a list of OpenAI message dicts) or a list of them.

        The options are the chat API's (see :mod:`rocm_k3.engine.chat`): ``tools`` with ``tool_choice`` "auto"
        (default), "none", "required" or ``{"type": "function", "function": {"name": ...}}``; ``response_format``
        json_object / json_schema or ``structured_outputs`` (a StructuredOutputs or ``{"regex": ...}``);
        ``chat_template_kwargs`` ``{"thinking": False}`` / ``reasoning_effort``; ``thinking_token_budget``. Returns
        one :class:`~rocm_k3.engine.chat.ChatOutput` per conversation with the parsed ``reasoning_content``,
        ``content`` and ``tool_calls``.
        """
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        base = sampling_params if sampling_params is not None else SamplingParams()
        prepared = [self.frontend.prepare_chat(ChatRequest(
            c, tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,
            response_format=response_format, structured_outputs=structured_outputs,
            chat_template_kwargs=chat_template_kwargs, reasoning_effort=reasoning_effort,
            thinking_token_budget=thinking_token_budget), allow_images=True) for c in conversations]
        params = [p.sampling(base) for p in prepared]
        prompt_ids, images = [], []
        for i, (conversation, p) in enumerate(zip(conversations, prepared)):
            ids, ims = self._chat_images(conversation, p, i)
            prompt_ids.append(self._encode(ids, i))
            images.append(ims)
        with self._lock:
            outputs = self._run_requests(prompt_ids, params, images)
        results = []
        for i, (p, out) in enumerate(zip(prepared, outputs)):
            parsed = p.parse(out.text, call_id_prefix=f"call_{i}_")
            results.append(ChatOutput(out, parsed.reasoning, parsed.content, parsed.tool_calls,
                                      chat_finish_reason(out.finish_reason, bool(parsed.tool_calls))))
        return results

    def stats(self) -> dict[str, float]:
        """Prefix-cache and engine counters: queries, query_tokens, hit_requests, hit_tokens, hit_rate, saved_states,
        cow_copies, state_restores, block/state evictions, steps, prefill_tokens, preemptions, cache sizes and
        free_blocks / free_state_slots."""
        with self._lock:
            return self.engine.stats()

    def expert_loads(self, reset: bool = False) -> dict[int, list[int]]:
        """Picks per logical expert of each MoE layer since the start (or the last reset), as counted by the
        expert-parallel ranks; {} without expert parallelism. ``rocm-k3 expert-placement`` turns a JSON dump
        of it (``{"layers": {layer: loads}}``) into a placement for ``--expert-placement``."""
        with self._lock:
            return self.engine.expert_loads(reset)

    # ------------------------------------------------------------------ internals
    def _multimodal(self, where: str) -> MultiModalProcessor:
        if self.multimodal is not None:
            return self.multimodal
        why = "has no vision tower (no vision_config)" if not self.engine.accepts_images else "has no tokenizer"
        raise ValueError(f"{where}: {self.path} {why}: it takes no images")

    def _chat_images(self, conversation, prepared, index: int) -> tuple[list[int], tuple[ImageInput, ...]]:
        """A rendered chat's ids with its image blocks inserted, and its images (``image`` parts take PIL images or
        bytes; ``image_url`` parts data: URLs)."""
        if not prepared.image_positions:
            return list(prepared.prompt_token_ids), ()
        where = f"conversation {index}"
        processor = self._multimodal(where)
        pictures = images_from_messages(conversation)
        try:
            mm = processor.process_images(prepared.prompt_token_ids, prepared.image_positions, pictures)
        except (ImageError, ImagePlacementError, MediaTokenInPromptError) as exc:
            raise named_image_error(exc, where) from exc
        return mm.token_ids, mm.images

    def _prepare(self, prompt: Prompt, index: int) -> tuple[list[int], tuple[ImageInput, ...]]:
        """(prompt ids, images) of one prompt, checked."""
        if not isinstance(prompt, Mapping):
            return self._encode(prompt, index), ()
        where = f"prompt {index}"
        unknown = sorted(set(prompt) - set(PROMPT_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}; a prompt dict takes {list(PROMPT_KEYS)}")
        if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise ValueError(f"{where}: expected exactly one of 'prompt' (str) and 'prompt_token_ids'")
        images = multi_modal_images(prompt.get("multi_modal_data"), where)
        positions = prompt.get("image_positions")
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise TypeError(f"{where}.prompt: expected a str, got {type(text).__name__} (token ids go in "
                            "'prompt_token_ids')")
        if positions is not None and text is not None:
            raise ValueError(f"{where}: image_positions index token ids: use it with 'prompt_token_ids' (a 'prompt' "
                             "string marks images with the image placeholder)")
        ids = None if text is not None else _as_prompt_list([prompt["prompt_token_ids"]])[0]
        if isinstance(ids, str):
            raise TypeError(f"{where}.prompt_token_ids: expected token ids, got a str")
        if not images:
            if positions:
                raise ValueError(f"{where}: image_positions given without images")
            return self._encode(text if text is not None else ids, index), ()
        processor = self._multimodal(where)
        try:
            if text is not None:
                mm = processor.process_prompt(text, images)
            else:
                mm = processor.process_images(ids, positions, images)
        except (ImageError, ImagePlacementError, MediaTokenInPromptError) as exc:
            raise named_image_error(exc, where) from exc
        return self._encode(mm.token_ids, index), mm.images

    def _encode(self, prompt: Prompt, index: int) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt {index}: {self.path} has no tokenizer; pass token ids instead of text")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"prompt {index}: empty prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt {index}: token ids {bad[:8]} outside the vocabulary [0, {self.vocab_size})")
        return ids

    def _run_requests(self, prompt_ids: list[list[int]], params: list[SamplingParams],
                      images: list[tuple[ImageInput, ...]] | None = None) -> list[RequestOutput]:
        """Run every request to completion on the engine (batched); outputs in prompt order."""
        request_ids = [f"llm-{next(self._request_ids)}" for _ in prompt_ids]
        images = images if images is not None else [()] * len(prompt_ids)
        done: dict[str, RequestOutput] = {}
        try:
            for rid, ids, p, ims in zip(request_ids, prompt_ids, params, images):
                self.engine.add_request(rid, ids, p, images=ims)
            while len(done) < len(request_ids):
                for delta in self.engine.step():
                    if delta.finished:
                        done[delta.request_id] = delta.output
        except BaseException:
            with self.engine.guard.section():  # a second Ctrl-C waits until the engine is clean
                for rid in request_ids:  # leave the engine empty for the next call
                    if rid not in done:
                        self.engine.abort(rid)
            raise
        return [done[rid] for rid in request_ids]


_BYTES = (bytes, bytearray, memoryview)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[str | list[int] | Mapping[str, Any]]:
    """str or dict -> [it]; token ids -> [[int, ...]]; a 2-d array -> one prompt per row; a list of str / ids /
    dicts stays a list.

    Token ids come out as Python ints. Raises TypeError naming the prompt for bytes, non-integer ids or arrays of
    another dtype or rank, ValueError for an empty batch.
    """
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    _refuse_bytes("prompts", prompts)
    if _is_array(prompts):
        ids = _array_ids("prompts", prompts, rows=True)
        if ids and isinstance(ids[0], list):
            return ids
        return [ids]
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError(f"prompts: expected a str, a list of token ids, or a non-empty list of those, got {prompts!r}")
    if all(_is_token_id(p) for p in prompts):
        return [[int(p) for p in prompts]]
    out: list[str | list[int] | Mapping[str, Any]] = []
    for i, p in enumerate(prompts):
        name = f"prompts[{i}]"
        _refuse_bytes(name, p)
        if isinstance(p, (str, Mapping)):
            out.append(p)
        elif _is_array(p):
            out.append(_array_ids(name, p, rows=False))
        elif isinstance(p, Sequence):
            for j, t in enumerate(p):
                if not _is_token_id(t):
                    raise TypeError(f"{name}: token ids must be ints, got {t!r} ({type(t).__name__}) at position {j}")
            out.append([int(t) for t in p])
        else:
            raise TypeError(f"{name}: expected a str or a list of int token ids, got {type(p).__name__}")
    return out


def _refuse_bytes(name: str, prompt: Any) -> None:
    if isinstance(prompt, _BYTES):
        raise TypeError(f"{name}: got {type(prompt).__name__}; a bytes prompt is neither text nor token ids: decode "
                        "it to a str or pass a list of token ids")


def _is_token_id(t: Any) -> bool:
    """Python / numpy integers; never bool."""
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def _is_array(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, np.ndarray))


def _array_ids(name: str, x: torch.Tensor | np.ndarray, rows: bool) -> list[int] | list[list[int]]:
    """The token ids of an integer array: 1-d -> one prompt; 2-d (when ``rows``) -> one prompt per row."""
    if isinstance(x, torch.Tensor):
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise TypeError(f"{name}: expected integer token ids, got a torch tensor of dtype {x.dtype}")
    elif x.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integer token ids, got a numpy array of dtype {x.dtype}")
    if x.ndim == 1 or (rows and x.ndim == 2):
        return x.tolist()
    what = "a 1-d (one prompt) or 2-d (a prompt per row)" if rows else "a 1-d"
    raise TypeError(f"{name}: expected {what} array of token ids, got shape {tuple(x.shape)}")
