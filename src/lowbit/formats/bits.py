"""Bits per weight: the one definition every lowbit report uses (quantize, inspect, export).

``bits_per_weight`` is what a quantized model costs to store:

    (bits stored for the quantized Linear weights + 16 x the weights of Linears left in 16 bits)
    / (the weights of all those Linears)

The Linears counted are every Linear of the decoder blocks, plus the lm_head when it is
quantized. The bits stored for a quantized Linear are its codes as stored (a row whose
width is not a multiple of the group pads its last group), its scales in their storage
dtype, its zero points and its tensor scale. Embeddings, norms, biases and a 16-bit
lm_head are not counted (``size_vs_fp16`` covers the whole file).

``bits_per_weight_nominal`` is the same average over the schemes' nominal rates (element
bits plus scale and zero bits per full group: ``w4g128`` = 4.125), which is what a mixed
precision ``--avg-bits`` budget counts and what papers quote. The two differ only where
rows pad their last group (SmolLM2's 576-wide rows hold 5 groups of 128: 4.583 stored
bits per weight at ``w4g128``) and where a format stores wider scales.
"""

from __future__ import annotations

from collections.abc import Iterable

COUNTED = ("stored codes + scales + zero points per weight of the decoder Linears and experts (and a quantized "
           "lm_head); 16-bit Linears count 16, as do float experts and routers in the blocks; embeddings and norms "
           "excluded")
NOMINAL = "the schemes' rate: element + scale/zero bits per full group (what --avg-bits budgets)"


def average_bits(layers: Iterable[tuple[int, float]], dense_weights: int = 0) -> float:
    """Weight-weighted mean of ``(weights, bits per weight)`` pairs, with ``dense_weights`` more at 16 bits."""
    total, bits = dense_weights, 16.0 * dense_weights
    for n, b in layers:
        total += n
        bits += n * b
    return bits / max(total, 1)
