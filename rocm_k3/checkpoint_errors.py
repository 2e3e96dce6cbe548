"""The named errors of a checkpoint that cannot be loaded (each a ``ValueError``; the message names the tensor or
file). Re-exported by :mod:`rocm_k3.model.loader`."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that does not match its config or cannot be read."""


class MissingTensorError(CheckpointError):
    """Tensors the config requires are not in the checkpoint."""


class UnexpectedTensorError(CheckpointError):
    """The checkpoint holds tensors the config does not explain."""


class TensorShapeError(CheckpointError):
    """Tensors whose shape (or storage dtype, or padding) differs from what the config implies."""


class CorruptCheckpointError(CheckpointError):
    """A safetensors file or index that cannot be parsed, or whose contents disagree with the index."""


class UnsafePathError(CorruptCheckpointError):
    """A file name (index shard, symlink) that would make rocm-k3 open a file outside the checkpoint directory."""
