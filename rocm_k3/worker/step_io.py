"""The step contract between the control plane (engine) and the workers: plain, picklable dataclasses.

``Scheduler.schedule() -> StepInput`` carries everything a worker needs for one step and
``Scheduler.update(StepOutput)`` takes what the sampling worker returns. Only ints, floats, strings, bools,
lists, tuples, :class:`~rocm_k3.sampling_params.SamplingParams` (a frozen dataclass of the same) and the numpy
pixel arrays of :class:`ImageInput` appear here (no torch tensors), so a step pickles and can be broadcast to the
ranks of a multi-process executor unchanged.

Before the first step the workers get the planned cache once, a :class:`~rocm_k3.cache.geometry.CacheGeometry`
(``Executor.init_cache``): block size, pool sizes and block-table width all come from it.
A request travels once as :class:`NewRequest` (its sampling parameters and seed); every step then names it by
``request_id`` in a :class:`ScheduledChunk` with the tokens to run and the cache deltas (block ids appended to
its table, or the whole table and KDA slot when it was (re-)admitted). Workers keep per-request state (block
table row, KDA slot, sampling generator) until the request id appears in ``finished_request_ids``.

**Images.** A request's images travel with the chunk that (re-)admits it (``ScheduledChunk.images``): only those
whose ``<|media_pad|>`` span reaches past the cached prefix the chunk starts from. The first pipeline stage keeps
them until the request's prefill has passed their pads, encodes each once when a prefill chunk first covers its
pads and scatters the rows the chunk covers; a preempted request is re-admitted with its images again.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from rocm_k3.kv_transfer.base import ConnectorMeta
from rocm_k3.sampling_params import SamplingParams


def dict_init(cls: type) -> type:
    """Give a frozen dataclass built on every step (per request) an ``__init__`` that writes its fields into the
    instance dict at once: the generated one sets each field through ``object.__setattr__`` (1.7 us for 13
    fields, against ~0.4 us). Same signature and defaults; the class stays frozen, equal, hashable, picklable.
    Apply it above ``@dataclasses.dataclass``; classes with a ``__post_init__`` or field factories are refused."""
    fields = dataclasses.fields(cls)
    if hasattr(cls, "__post_init__") or hasattr(cls, "__slots__"):
        raise TypeError(f"dict_init: {cls.__name__} has a __post_init__ or slots")
    defaults, params = {}, []
    for f in fields:
        if f.default_factory is not dataclasses.MISSING or not f.init:
            raise TypeError(f"dict_init: {cls.__name__}.{f.name} has a default factory or is not an init field")
        if f.default is dataclasses.MISSING:
            params.append(f.name)
        else:
            defaults[f"_default_{f.name}"] = f.default
            params.append(f"{f.name}=_default_{f.name}")
    lines = [f"def __init__(self, {', '.join(params)}):", "    d = self.__dict__"]
    lines += [f"    d[{f.name!r}] = {f.name}" for f in fields]
    scope: dict = {}
    exec("\n".join(lines), defaults, scope)  # noqa: S102 (source built from the dataclass's own field names)
    init = scope["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = init
    return cls


@dataclasses.dataclass(frozen=True)
class NewRequest:
    """A request the workers have not seen: its sampling parameters (the seed seeds its generator).

    num_prompt_tokens: sequence positions from here on hold generated tokens (penalties and grammars follow them).
    prompt_token_ids:  the prompt, sent only when the sampler needs it (a repetition penalty), else empty.
    """

    request_id: str
    sampling: SamplingParams
    num_prompt_tokens: int
    prompt_token_ids: tuple[int, ...] = ()


PLACEHOLDER_TOKEN = -1  # the input token of a ``from_previous`` decode: the worker replaces it on the device

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


@dataclasses.dataclass(frozen=True, eq=False)
class ImageInput:
    """One preprocessed image of a request and where its embedding rows go in the prompt.

    pixel_values:  float32 numpy ``[t * h * w, 3, p, p]``, the NaViT patches (``preprocess_image``; never modified).
    grid_thw:      (t, h, w) patches of the image.
    pad_start:     prompt position of its first ``<|media_pad|>``; ``num_tokens`` pads follow (one embedding row
                   each, image order = position order).
    content_hash:  sha256 hex of the preprocessed pixels and grid (``image_content_hash``): the prefix-cache salt.
    """

    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]
    pad_start: int
    num_tokens: int
    content_hash: str

    def __post_init__(self) -> None:
        grid = self.grid_thw
        if (not isinstance(grid, tuple) or len(grid) != 3
                or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in grid)):
            raise ValueError(f"grid_thw: expected three positive ints (t, h, w), got {grid!r}")
        px = self.pixel_values
        if not isinstance(px, np.ndarray) or px.dtype != np.float32 or px.ndim != 4 or px.shape[1] != 3 \
                or px.shape[2] != px.shape[3]:
            what = f"{px.dtype} {px.shape}" if isinstance(px, np.ndarray) else type(px).__name__
            raise ValueError(f"pixel_values: expected a float32 numpy array [patches, 3, p, p], got {what}")
        if px.shape[0] != grid[0] * grid[1] * grid[2]:
            raise ValueError(f"pixel_values: {px.shape[0]} patches, but grid_thw {grid} describes "
                             f"{grid[0] * grid[1] * grid[2]}")
        for name in ("pad_start", "num_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (name == "num_tokens"):
                raise ValueError(f"{name}: expected an int >= {int(name == 'num_tokens')}, got {value!r}")
        if not isinstance(self.content_hash, str) or not _SHA256_HEX.fullmatch(self.content_hash):
            raise ValueError(f"content_hash: expected 64 lowercase hex digits (sha256), got {self.content_hash!r}")

    @property
    def pad_end(self) -> int:
        """One past the last pad position."""
        return self.pad_start + self.num_tokens

    @property
    def pad_positions(self) -> range:
        return range(self.pad_start, self.pad_end)

    @property
    def num_patches(self) -> int:
        return int(self.pixel_values.shape[0])


@dict_init
@dataclasses.dataclass(frozen=True)
class ScheduledChunk:
    """One request's share of a step: ``token_ids`` at positions ``start .. start + len(token_ids) - 1``.

    admitted:      the request was (re-)admitted this step: ``block_ids`` is its whole block table and
                   ``kda_slot`` its running KDA slot (after a preemption both change; the worker resets the row).
    block_ids:     blocks appended to its table before this step (the whole table when admitted).
    kda_slot:      its running KDA slot (recurrent + conv state of every KDA layer).
    is_prefill:    the chunk belongs to a (re)computed prefill (else a decode, or a verification when num_draft > 0).
    sample:        the chunk ends at the request's last known token: the step samples its next token.
    saves:         (absolute position, destination KDA slot): save the KDA states after that position.
    num_draft:     the last ``num_draft`` tokens are speculative drafts to verify: logits come back for the
                   last ``1 + num_draft`` positions and ``saves`` hold the per-position state slots.
    slot_moved:    the request's running state moved to ``kda_slot`` (a speculative rollback picked the slot
                   of a drafted position) since its last chunk; not set on an admitted chunk.
    images:        on an admitted chunk, the request's images whose pads end after ``start`` (see the module
                   docstring); empty otherwise.
    prompt_logprob_rows: the first this many positions of the chunk predict prompt tokens whose log-probabilities
                   the request asked for (``SamplingParams.prompt_logprobs``): the step returns them in
                   ``StepOutput.prompt_logprobs`` (the targets ``prompt[start + 1 : start + 1 + rows]``).
    from_previous: asynchronous scheduling: a one-token decode whose input token is the one the step before
                   (still running when this step was scheduled) samples for this request; ``token_ids`` holds
                   :data:`PLACEHOLDER_TOKEN` and the worker takes the token on the device.
    """

    request_id: str
    token_ids: tuple[int, ...]
    start: int
    admitted: bool
    block_ids: tuple[int, ...]
    kda_slot: int
    is_prefill: bool
    sample: bool
    saves: tuple[tuple[int, int], ...] = ()
    images: tuple[ImageInput, ...] = ()
    num_draft: int = 0
    slot_moved: bool = False
    prompt_logprob_rows: int = 0
    from_previous: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclasses.dataclass(frozen=True)
class StepInput:
    """Everything the workers need for one step.

    step_id:               increases by one per step; every rank checks it (ranks must agree).
    new_requests:          requests seen for the first time (registered before the chunks run).
    chunks:                the scheduled requests, decodes first (``chunks[:num_decodes]`` are one-token decodes).
    num_decodes:           how many leading chunks are decodes.
    block_copies:          copy-on-write before the forward: (src block, dst block, rows) in every MLA layer.
    state_copies:          (src slot, dst slot): copy the recurrent + conv state of every KDA layer.
    finished_request_ids:  requests that ended since the last step (aborted, stopped, failed): drop their state.
    kv_connector_meta:     prefill/decode disaggregation: the prompt caches to publish (producer) and to load
                           (consumer) in this step, after the copies and before the forward; None = none.
    """

    step_id: int
    new_requests: tuple[NewRequest, ...] = ()
    chunks: tuple[ScheduledChunk, ...] = ()
    num_decodes: int = 0
    block_copies: tuple[tuple[int, int, int], ...] = ()
    state_copies: tuple[tuple[int, int], ...] = ()
    finished_request_ids: tuple[str, ...] = ()
    kv_connector_meta: ConnectorMeta | None = None

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_decode_only(self) -> bool:
        """Every chunk is a one-token decode (the step may replay a captured decode graph)."""
        return bool(self.chunks) and self.num_decodes == len(self.chunks)


@dict_init
@dataclasses.dataclass(frozen=True)
class SampledToken:
    """The token sampled for one request, with its log-probabilities when asked.

    logprobs: ``((token, logprob), ...)`` with the chosen token first, then the top alternatives; None if not asked.
    error:    non-empty when the request's logits were not finite (NaN/Inf): ``token_id`` is then meaningless.
    accepted: the drafts of a verification chunk that were accepted (they come before ``token_id``).
    accepted_logprobs: with ``logprobs`` asked, one entry (as ``logprobs``) per accepted draft, else empty.
    draft_token_ids: ``draft_model`` speculation: the drafter's proposal continuing after ``token_id`` (the next
                     step verifies them), else empty.
    """

    request_id: str
    token_id: int
    logprobs: tuple[tuple[int, float], ...] | None = None
    error: str = ""
    accepted: tuple[int, ...] = ()
    accepted_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
    draft_token_ids: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    """The log-probabilities of prompt tokens ``first`` .. ``first + len(entries) - 1`` of one request (a chunk's
    ``prompt_logprob_rows``): each entry ``((token, logprob), ...)`` with the prompt token first, then the top
    alternatives; ``ranks[i]`` is the prompt token's rank in its distribution (1 = the most likely)."""

    request_id: str
    first: int
    entries: tuple[tuple[tuple[int, float], ...], ...]
    ranks: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What the sampling worker returns for one step: one entry per chunk with ``sample`` set, in chunk order
    (a verification chunk's entry carries its accepted drafts), and the prompt log-probabilities of the chunks
    with ``prompt_logprob_rows``.

    sampler_fallbacks: sampling rows of this step whose processed probabilities were unusable (NaN, all zero,
                       every token masked), so the sampler took the top logit instead of a draw.
    kv_received / kv_failed: requests whose prompt cache this step loaded, or failed to load (checksum mismatch,
    timeout, producer gone: the engine recomputes those prompts and drops this step's token for them);
    kv_bytes_received / kv_bytes_sent: transferred payload bytes of this step; kv_transfer_s: seconds this step
    was blocked publishing and loading (layer by layer during its forward: the part not hidden by compute).
    """

    step_id: int
    sampled: tuple[SampledToken, ...] = ()
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()
    sampler_fallbacks: int = 0
    kv_received: tuple[str, ...] = ()
    kv_failed: tuple[str, ...] = ()
    kv_bytes_received: int = 0
    kv_bytes_sent: int = 0
    kv_transfer_s: float = 0.0
