"""lowbit: make large language models small.

The public API is re-exported here; heavy submodules load on first use so that
``import lowbit`` and the CLI's ``--help`` stay quick.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Scheme": "lowbit.formats",
    "QTensor": "lowbit.formats",
    "quantize": "lowbit.formats",
    "qdq": "lowbit.formats",
    "Plan": "lowbit.formats.plan",
    "QuantLinear": "lowbit.nn",
    "replace_linears": "lowbit.nn",
    "load_model": "lowbit.models",
    "quantize_model": "lowbit.ptq",
    "perplexity": "lowbit.eval",
    "evaluate": "lowbit.eval",
    "save": "lowbit.export.native",
    "load": "lowbit.export.native",
    "LowbitError": "lowbit.errors",
}

__all__ = [*sorted(_EXPORTS), "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lowbit' has no attribute {name!r}")
