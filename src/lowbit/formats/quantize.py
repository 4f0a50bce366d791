"""Entry points: ``quantize(w, scheme) -> QTensor`` and ``qdq(w, scheme) -> Tensor``.

A plain dict maps each element grid to its quantizer (no class hierarchy), so a new
format is one function and one registry line.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lowbit.errors import SchemeError
from lowbit.formats import kquants
from lowbit.formats.float_blocks import quantize_fp
from lowbit.formats.integer import quantize_int
from lowbit.formats.qtensor import QTensor
from lowbit.formats.scheme import Scheme

Quantizer = Callable[[torch.Tensor, Scheme, "torch.Tensor | None"], QTensor]

QUANTIZERS: dict[str, Quantizer] = {"int": quantize_int, "e2m1": quantize_fp, "e4m3": quantize_fp}


def register(elem: str, fn: Quantizer) -> None:
    QUANTIZERS[elem] = fn


def quantize(w: torch.Tensor, scheme: Scheme | str, imp: torch.Tensor | None = None,
             tensor_scale: torch.Tensor | None = None) -> QTensor:
    """Quantize a 2-D weight ``[out, in]`` with ``scheme``.

    imp: optional ``[in]`` importance (sum of squared input activations) used by the
    ``search`` rule; None means plain MSE.
    tensor_scale: the per-tensor scale ``enc`` to use for a scheme that has one (the one
    an engine's fused matmul shares, `lowbit.models.fused`); None = computed from ``w``.
    """
    scheme = Scheme.parse(scheme)
    if w.dim() != 2:
        raise SchemeError(f"can quantize 2-D weights only, got shape {tuple(w.shape)}")
    scheme.check_width(w.shape[1])
    if tensor_scale is not None:
        if not scheme.tensor_scale:
            raise SchemeError(f"scheme {scheme.name} has no tensor scale; quantize it without one")
        return quantize_fp(w, scheme, imp, tensor_scale=tensor_scale)
    if scheme.super_block:
        return quantize_kquant(w, scheme, imp)
    try:
        fn = QUANTIZERS[scheme.elem]
    except KeyError:
        raise SchemeError(f"no quantizer registered for {scheme.elem} elements") from None
    return fn(w, scheme, imp)


def quantize_kquant(w: torch.Tensor, scheme: Scheme, imp: torch.Tensor | None = None) -> QTensor:
    """llama.cpp K-quant layout: ``rule='search'`` = weighted least squares + refined double
    quantization (importance-weighted when ``imp`` is given), ``absmax`` = plain ranges."""
    kt = kquants.ktype(scheme.bits)
    parts = kquants.quantize_parts(w, kt, imp if scheme.rule == "search" else None, search=scheme.rule == "search")
    codes, sc, m, sup = kquants.parts_to_tensors(parts, kt)
    return QTensor(codes, sc, m, sup, tuple(w.shape), scheme)


def qdq(w: torch.Tensor, scheme: Scheme | str, imp: torch.Tensor | None = None,
        tensor_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize then dequantize (same dtype as ``w``): the weight a quantized model sees."""
    return quantize(w, scheme, imp, tensor_scale).dequantize(w.dtype)


def relative_error(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """Sum of squared error over sum of squares: the weight-error metric of the studies."""
    w = w.double()
    return float(((w_hat.double() - w) ** 2).sum() / (w**2).sum().clamp_min(1e-300))
