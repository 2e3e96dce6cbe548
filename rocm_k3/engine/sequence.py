"""One request's token sequence and its scheduling state (plain Python, no tensors)."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from rocm_k3.sampling_params import SamplingParams
from rocm_k3.worker.step_io import ImageInput


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no cache (new, or preempted and to be recomputed)
    RUNNING = "running"  # admitted: holds a KDA slot and blocks
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
    """A request: prompt + generated tokens, and how far the cache has computed them.

    token_ids:            prompt followed by the generated tokens (what the model runs).
    prompt_cache_key:     with images: the prompt's ids with each image's pads replaced by an id derived from its
                          content hash (``prefix_cache_key``), so the prefix cache never matches one image's pads
                          against another's; None without images. :attr:`cache_key_ids` extends it with the
                          generated tokens: every prefix-cache call hashes and matches those ids, never token_ids.
    images:               the prompt's images (pad spans ascending, inside the prompt); sent with each admission.
    num_computed_tokens:  leading tokens whose KV and KDA state are in the cache (restored or computed).
    prefill_len:          tokens to (re)compute as a prefill since the last admission: the prompt, or prompt +
                          outputs after a preemption; past it the sequence decodes one token per step.
    num_cached_tokens:    tokens of the last admission served from the prefix cache.
    max_tokens:           generation limit (SamplingParams.max_tokens capped by max_model_len).
    sampling:             the request's sampling parameters.
    stop:                 the request's incremental stop checker (engine side; opaque to the scheduler's policy).
    admitted_this_step / blocks_sent / registered: what the workers were told (step-contract deltas).
    known_to_workers:     the request was sent to the workers once (they hold state for it until told it finished).
    proposal:             draft_model speculation: (num_tokens when proposed, the drafter's tokens continuing
                          token_ids then); used only while num_tokens is unchanged.
    kv_transfer_params:   prefill/decode disaggregation (``SamplingParams.kv_transfer_params``): a remote prefill
                          to load (consumer), or ``do_remote_decode`` (producer); cleared after a failed load so
                          the prompt is recomputed here. kv_params_out: the producer's answer once finished.
    kv_loading:           the step in flight loads this sequence's prompt cache.
    """

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    sampling: SamplingParams | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    prefill_len: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None
    error: str | None = None
    stop: Any = None
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None  # asked: [None] + one entry per later prompt token
    prompt_logprob_ranks: list[int | None] | None = None
    registered: bool = False
    known_to_workers: bool = False
    admitted_this_step: bool = False
    blocks_sent: int = 0
    images: tuple[ImageInput, ...] = ()
    prompt_cache_key: list[int] | None = None
    proposal: tuple[int, tuple[int, ...]] = (0, ())
    kv_transfer_params: dict | None = None
    kv_params_out: dict | None = None
    kv_loading: bool = False

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: prompt_token_ids is empty")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.prompt_token_ids):
            raise ValueError(f"request {self.request_id!r}: prompt_token_ids must be non-negative ints")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"request {self.request_id!r}: max_tokens must be a positive int, got {self.max_tokens!r}")
        self.prompt_token_ids = list(self.prompt_token_ids)
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.images = tuple(self.images)
        if self.prompt_cache_key is not None:
            self.prompt_cache_key = list(self.prompt_cache_key)
            if len(self.prompt_cache_key) != len(self.prompt_token_ids):
                raise ValueError(f"request {self.request_id!r}: prompt_cache_key has {len(self.prompt_cache_key)} "
                                 f"ids for {len(self.prompt_token_ids)} prompt tokens")
        elif self.images:
            raise ValueError(f"request {self.request_id!r}: a prompt with images needs its prompt_cache_key")

    @property
    def cache_key_ids(self) -> list[int]:
        """The ids the prefix cache hashes and matches: ``token_ids`` with image pads salted (the same list
        object as ``token_ids`` when the prompt has no image)."""
        key = self.prompt_cache_key
        if key is None:
            return self.token_ids
        return key + self.token_ids[len(key):]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_decoding(self) -> bool:
        """Past its prefill: one new token per step."""
        return self.status is SequenceStatus.RUNNING and self.num_computed_tokens >= self.prefill_len

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt log-probabilities were asked and are not all in yet (every prompt position must be computed)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
