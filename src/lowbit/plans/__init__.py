"""Plans: which recipe each Linear layer gets, and where a plan comes from.

`Plan` (layer name -> `lowbit.formats.Recipe`) and its JSON file form, and the sources
of a plan that need to know a model's layers: llama.cpp's K-quant mixes (`kmix`, from
the Hugging Face Linear names and shapes). This package sits above `lowbit.models` (it
reads layer names and shapes) and below `lowbit.ptq` (every method applies a plan);
`lowbit.nn` takes any layer -> recipe mapping and never names `Plan`.
"""

from lowbit.plans.plan import Plan

__all__ = ["Plan"]
