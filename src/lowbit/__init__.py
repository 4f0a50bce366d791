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
    "InputScheme": "lowbit.formats",
    "Recipe": "lowbit.formats",
    "QTensor": "lowbit.formats",
    "quantize": "lowbit.formats",
    "qdq": "lowbit.formats",
    "Plan": "lowbit.plans.plan",
    "QuantLinear": "lowbit.nn",
    "replace_linears": "lowbit.nn",
    "load_model": "lowbit.models",
    "quantize_model": "lowbit.ptq",
    "perplexity": "lowbit.eval",
    "evaluate": "lowbit.eval",
    "save": "lowbit.files.native",
    "load": "lowbit.files.native",
    "LowbitError": "lowbit.errors",
}

__all__ = [*sorted(_EXPORTS), "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lowbit' has no attribute {name!r}")


def _register_with_transformers() -> None:
    """Make ``AutoModelForCausalLM.from_pretrained(native_dir)`` work after ``import lowbit``.

    Registers lowbit's quantizer (lowbit.files.hf_quantizer) the moment transformers'
    quantizer registry is imported, or now if it already is — without importing
    transformers (or torch) here, so ``import lowbit`` stays quick.
    """
    import importlib.abc
    import importlib.util
    import sys

    target = "transformers.quantizers.auto"

    def register() -> None:
        importlib.import_module("lowbit.files.hf_quantizer").register()

    if target in sys.modules:
        register()
        return

    class _Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target_=None):  # noqa: ANN001
            if name != target:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            if spec is None or spec.loader is None:
                return spec
            run = spec.loader.exec_module

            def exec_module(module) -> None:  # noqa: ANN001
                run(module)
                register()

            spec.loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, _Hook())


_register_with_transformers()
