"""Building a module's skeleton without allocating its parameters.

Two readers build a model from its config and then fill it from a file: the native
checkpoint (`lowbit.files.native`, whose quantized layers replace the Linears) and lazy
loading (`lowbit.models.lazy`, whose decoder blocks stay in their shards until needed).
Both need every parameter created on the meta device, so neither allocates (nor randomly
initialises) a float model it is about to overwrite.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Every parameter registered inside the block is created on the meta device; buffers are not."""
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
