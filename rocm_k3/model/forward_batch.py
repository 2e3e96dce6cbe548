"""The model <-> cache/engine interface: one engine step's metadata and the cache views the model reads and writes.

A :class:`ForwardBatch` describes one forward step over N sequences whose new tokens are concatenated (T tokens in
all). The cache side implements :class:`HybridCacheView`: the paged MLA latent cache per MLA layer and the KDA
recurrent + conv state pools per KDA layer. The model writes the latent of new tokens into the MLA pages at
``slot_mapping``, reads and updates KDA state slots ``kda_slots`` in place, and for every ``save_positions`` row
copies the recurrent state and the conv state after that many new tokens into ``save_slots`` (prefix caching).

Two implementations exist: the test helper ``SimpleCache`` in tests/simple_cache.py (one request at a time, contiguous
pages) and the engine's paged hybrid cache. The model never allocates cache memory itself.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

import torch

@dataclasses.dataclass
class ForwardBatch:
    """One engine step; every tensor lives on the model's device.

    input_ids:         int64 [T]   new tokens of this step, sequences concatenated
    positions:         int64 [T]   absolute position of each token in its sequence
    cu_seqlens:        int32 [N+1] prefix sums of the new-token counts per sequence
    seq_lens:          int32 [N]   context length after this step (cached + new)
    block_table:       int32 [N, max_blocks] MLA pages of each sequence
    slot_mapping:      int64 [T]   MLA cache slot (block * block_size + offset) of each new token; -1 = skip
    kda_slots:         int32 [N]   KDA state slot (recurrent + conv) of each sequence
    has_initial_state: bool  [N]   the sequence already has KDA state (cached prefix or an earlier chunk)
    logits_indices:    int64 [N]   rows of the [T, hidden] output whose logits are wanted
    save_positions:    int32 [M, 2] or None: rows (i, p) save the KDA states after the first p new tokens of seq i
    save_slots:        int32 [M] or None: destination KDA slot of each saved state
    is_decode:         every sequence has exactly one new token and has_initial_state
    decode_width:      w > 1 (a decode-shaped speculative verification, see :class:`~rocm_k3.model.kda.KDALayer`): rows
                       come in groups of w successive tokens of one sequence (row i*w + j is token j of group i,
                       seq_lens / block_table / slot_mapping per row); kda_slots per row (a padding row reads and
                       writes the scratch slot); save rows must be (i*w + j, 1) for every j < w - 1 in that order
                       (M = N / w * (w - 1); save_slots holds the scratch slot where nothing is saved)
    graphed:           the batch is a decode graph's persistent buffers (captured / replayed): shapes stay fixed
    image_embeds:      [R, hidden] or None: image embedding rows (model dtype) that replace the input embeddings
    image_rows:        int64 [R] or None: the (distinct) token rows of ``input_ids`` they replace (``<|media_pad|>``)
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    kda_slots: torch.Tensor
    has_initial_state: torch.Tensor
    logits_indices: torch.Tensor
    save_positions: torch.Tensor | None = None
    save_slots: torch.Tensor | None = None
    is_decode: bool = False
    decode_width: int = 1
    graphed: bool = False
    image_embeds: torch.Tensor | None = None
    image_rows: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    def query_lens(self) -> torch.Tensor:
        """int32 [N]: new tokens per sequence this step."""
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).to(torch.int32)

    def validate(self) -> None:
        """Check dtypes and shapes (cheap, no device sync); raises TypeError/ValueError naming the field."""
        _check("input_ids", self.input_ids, torch.int64, 1)
        t = self.input_ids.shape[0]
        _check("positions", self.positions, torch.int64, 1, (t,))
        _check("cu_seqlens", self.cu_seqlens, torch.int32, 1)
        n = self.cu_seqlens.shape[0] - 1
        if n < 1:
            raise ValueError(f"cu_seqlens: expected shape [N+1] with N >= 1, got {tuple(self.cu_seqlens.shape)}")
        _check("seq_lens", self.seq_lens, torch.int32, 1, (n,))
        _check("block_table", self.block_table, torch.int32, 2)
        if self.block_table.shape[0] != n:
            raise ValueError(f"block_table: expected shape [{n}, max_blocks], got {tuple(self.block_table.shape)}")
        _check("slot_mapping", self.slot_mapping, torch.int64, 1, (t,))
        _check("kda_slots", self.kda_slots, torch.int32, 1, (n,))
        _check("has_initial_state", self.has_initial_state, torch.bool, 1, (n,))
        _check("logits_indices", self.logits_indices, torch.int64, 1)
        if (self.save_positions is None) != (self.save_slots is None):
            raise ValueError("save_positions and save_slots must both be given or both be None")
        if self.save_positions is not None:
            _check("save_positions", self.save_positions, torch.int32, 2)
            if self.save_positions.shape[1] != 2:
                raise ValueError(f"save_positions: expected shape [M, 2], got {tuple(self.save_positions.shape)}")
            m = self.save_positions.shape[0]
            _check("save_slots", self.save_slots, torch.int32, 1, (m,))
        if (self.image_embeds is None) != (self.image_rows is None):
            raise ValueError("image_embeds and image_rows must both be given or both be None")
        if self.image_embeds is not None:
            if not isinstance(self.image_embeds, torch.Tensor):
                raise TypeError(f"image_embeds: expected a torch.Tensor, got {type(self.image_embeds).__name__}")
            if not self.image_embeds.dtype.is_floating_point or self.image_embeds.dim() != 2:
                raise ValueError(f"image_embeds: expected a floating-point [R, hidden] tensor, got "
                                 f"{self.image_embeds.dtype} {tuple(self.image_embeds.shape)}")
            r = self.image_embeds.shape[0]
            _check("image_rows", self.image_rows, torch.int64, 1, (r,))
            if r > t:
                raise ValueError(f"image_rows: {r} image rows for a step of {t} tokens")
            if self.is_decode:
                raise ValueError("image_embeds: a decode step has no image rows (pads are prompt positions)")
        if self.is_decode and t != n:
            raise ValueError(f"is_decode: expected one new token per sequence (T == N), got T={t}, N={n}")
        w = self.decode_width
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ValueError(f"decode_width: expected a positive int, got {w!r}")
        if w > 1:
            if not self.is_decode or n % w:
                raise ValueError(f"decode_width: {w} needs a decode-shaped batch of whole groups, got N={n}, "
                                 f"is_decode={self.is_decode}")
            if self.save_slots is not None and self.save_slots.shape[0] != n // w * (w - 1):
                raise ValueError(f"save_slots: decode_width {w} over N={n} rows expects {n // w * (w - 1)} save "
                                 f"rows, got {self.save_slots.shape[0]}")


@runtime_checkable
class HybridCacheView(Protocol):
    """What the model needs from a cache (layer indices count MLA layers and KDA layers separately, 0-based).

    mla_kv(i):     [num_blocks, block_size, cfg.mla_latent_width] latent pages of the i-th MLA layer (normalised
                   c_kv | k_pe, kv_lora_rank + qk_rope_head_dim values; 576 in K3), model activation dtype
    kda_state(i):  fp32 [S, H, K, V] recurrent state pool of the i-th KDA layer
    conv_state(i): [S, 3*H*K, W-1] short-conv state pool of the i-th KDA layer (oldest input first)
    block_size:    tokens per MLA page
    """

    @property
    def block_size(self) -> int: ...

    def mla_kv(self, mla_layer_idx: int) -> torch.Tensor: ...

    def kda_state(self, kda_layer_idx: int) -> torch.Tensor: ...

    def conv_state(self, kda_layer_idx: int) -> torch.Tensor: ...


def _check(
    name: str, t: object, dtype: torch.dtype, ndim: int, shape: tuple[int, ...] | None = None
) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim}-d tensor, got shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
