"""Image inputs on the first pipeline stage: each request's images from admission until its prefill passes them.

The step contract sends a request's images with the chunk that (re-)admits it (``ScheduledChunk.images``). Per step
:meth:`ImageInputs.prepare` finds the prefill chunks that cover ``<|media_pad|>`` positions, runs the vision tower
once for every image not encoded yet (all of them in one tower call; under tensor parallelism split across the TP
ranks and all-gathered, :func:`~rocm_k3.model.vision.data_parallel.encode_data_parallel`) and returns the rows the
step needs with their row indices in the step's token batch (:class:`StepImages`, the ForwardBatch's
``image_embeds`` / ``image_rows``). An image whose pads span several chunks keeps its embeddings between them
and is encoded once; :meth:`ImageInputs.release` drops an image (pixels and embeddings) once a chunk has passed
its last pad. A re-admission replaces the request's images (after a preemption they are encoded again), and a
finished request's are dropped.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np
import torch

from rocm_k3.model.vision.data_parallel import encode_data_parallel
from rocm_k3.worker.step_io import ImageInput, StepInput


class StepImages(NamedTuple):
    """One step's image rows: ``embeds [R, text_hidden]`` (model dtype) replace the input embeddings at token
    rows ``rows`` (int64 [R], indices into the step's concatenated tokens), both on the model's device."""

    embeds: torch.Tensor
    rows: torch.Tensor


@dataclasses.dataclass(eq=False)
class _HeldImage:
    image: ImageInput
    embeds: torch.Tensor | None = None  # [num_tokens, text_hidden] once encoded


class ImageInputs:
    """The images a worker holds (see the module docstring).

    model: the full :class:`~rocm_k3.model.vision.model.VisionModel` (every TP rank holds one); ctx: this rank's
    ParallelContext (the tower runs data-parallel over its TP group); ops: the op table the gather dispatches
    through. ``num_encoded`` counts images encoded, ``num_tower_runs`` tower calls.
    """

    def __init__(self, model: Any, ctx: Any, *, device: torch.device, dtype: torch.dtype, ops: Any = None) -> None:
        self.model = model
        self.ctx = ctx
        self.device = device
        self.dtype = dtype
        self.ops = ops
        self.held: dict[str, list[_HeldImage]] = {}
        self.num_encoded = 0
        self.num_tower_runs = 0

    def apply(self, step: StepInput) -> None:
        """Drop finished requests' images; an admitted chunk sets (or clears) its request's images."""
        for rid in step.finished_request_ids:
            self.held.pop(rid, None)
        for chunk in step.chunks:
            if not chunk.admitted:
                continue
            if chunk.images:
                self.held[chunk.request_id] = [_HeldImage(im) for im in chunk.images]
            else:
                self.held.pop(chunk.request_id, None)

    def prepare(self, step: StepInput, cu_seqlens: np.ndarray) -> StepImages | None:
        """The image rows of ``step`` (chunks in step order, ``cu_seqlens`` their token offsets), encoding the
        images met for the first time; None when no chunk covers a pad."""
        if not self.held:
            return None
        pieces: list[tuple[int, _HeldImage, int, int]] = []  # (row of position 0, image, first pos, end pos)
        to_encode: list[_HeldImage] = []
        for i, chunk in enumerate(step.chunks):
            for held in self.held.get(chunk.request_id, ()):
                lo, hi = max(chunk.start, held.image.pad_start), min(chunk.end, held.image.pad_end)
                if lo >= hi:
                    continue
                if held.embeds is None and all(h is not held for h in to_encode):
                    to_encode.append(held)
                pieces.append((int(cu_seqlens[i]) - chunk.start, held, lo, hi))
        if not pieces:
            return None
        if to_encode:
            self._encode(to_encode)
        embeds = torch.cat([h.embeds[lo - h.image.pad_start : hi - h.image.pad_start] for _, h, lo, hi in pieces])
        rows = np.concatenate([np.arange(lo, hi, dtype=np.int64) + base for base, _, lo, hi in pieces])
        return StepImages(embeds, torch.from_numpy(rows).to(self.device, non_blocking=True))

    def release(self, step: StepInput) -> None:
        """After the step ran: drop the images whose last pad a chunk of this step has passed."""
        for chunk in step.chunks:
            held = self.held.get(chunk.request_id)
            if not held:
                continue
            keep = [h for h in held if h.image.pad_end > chunk.end]
            if keep:
                self.held[chunk.request_id] = keep
            else:
                del self.held[chunk.request_id]

    def _encode(self, items: list[_HeldImage]) -> None:
        """One tower run over ``items`` (data-parallel over the TP group); checks each image's row count."""
        pixels = torch.cat([torch.from_numpy(h.image.pixel_values) for h in items])  # [N, 3, p, p] fp32
        pixels = pixels.to(device=self.device, dtype=self.dtype)
        with torch.inference_mode():
            out = encode_data_parallel(self.model, pixels, [h.image.grid_thw for h in items], self.ctx, ops=self.ops)
        for held, embeds in zip(items, out):
            if embeds.shape[0] != held.image.num_tokens:
                raise ValueError(f"an image of grid {held.image.grid_thw} has {held.image.num_tokens} pads in the "
                                 f"prompt but the vision tower gives {embeds.shape[0]} embedding rows")
            held.embeds = embeds
        self.num_encoded += len(items)
        self.num_tower_runs += 1
