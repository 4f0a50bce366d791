"""Number formats: schemes, grids, scale casts and rules, QTensor, bit packing."""

from lowbit.formats.qtensor import QTensor
from lowbit.formats.quantize import qdq, quantize, relative_error
from lowbit.formats.scheme import PRESETS, Scheme

__all__ = ["PRESETS", "QTensor", "Scheme", "qdq", "quantize", "relative_error"]
