"""Writers and readers: the native lowbit checkpoint, compressed-tensors, GGUF."""

from lowbit.export.native import is_checkpoint, load, save

__all__ = ["is_checkpoint", "load", "save"]
