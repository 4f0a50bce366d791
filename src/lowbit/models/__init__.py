"""Models: loading from every source, finding decoder blocks and their Linear layers."""

from lowbit.models.layers import block_path, decoder_blocks, linear_layers
from lowbit.models.loading import BUNDLED_NAME, LoadedModel, bundled_gguf, load_model

__all__ = ["BUNDLED_NAME", "LoadedModel", "block_path", "bundled_gguf", "decoder_blocks", "linear_layers",
           "load_model"]
