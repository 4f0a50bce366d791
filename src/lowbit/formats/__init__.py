"""Number formats: schemes, input (activation) schemes, recipes, grids, scale casts and rules, QTensor, bit packing."""

from lowbit.formats.inputs import InputScheme, qdq_input
from lowbit.formats.qtensor import QTensor
from lowbit.formats.quantize import qdq, quantize, relative_error
from lowbit.formats.recipe import Recipe
from lowbit.formats.scheme import PRESETS, Scheme

__all__ = ["PRESETS", "InputScheme", "QTensor", "Recipe", "Scheme", "qdq", "qdq_input", "quantize",
           "relative_error"]
