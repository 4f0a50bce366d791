"""llama.cpp's GGUF types for the tensors outside a layer plan: ``token_embd`` and ``output``.

A llama.cpp file type (Q4_K_M, Q8_0, ...) starts every tensor from a base type and raises
some by role (`lowbit.plans.kmix` holds the rules for the decoder Linears). The token
embedding and the output tensor have their own rule, read from ``llama_tensor_get_type_impl``
and ``tensor_type_fallback`` in llama.cpp's src/llama-quant.cpp; `embedding_types` is it,
and the GGUF exporter quantizes those tables with it so a lowbit file of a mix is the size
of llama.cpp's own file. This sits in ``files`` (below ``plans``) because the exporter needs it.
"""

from __future__ import annotations

from lowbit.errors import SchemeError
from lowbit.formats.scheme import Scheme

# the base type of each file type lowbit reproduces: the K-quant mixes (plans.kmix) and the legacy types
# lowbit's uniform schemes hold exactly (w4g32 = Q4_0, ...)
BASE_TYPES = {"q2_k_s": "Q2_K", "gguf:q2_k": "Q2_K", "q3_k_s": "Q3_K", "q3_k_m": "Q3_K", "q3_k_l": "Q3_K",
              "q4_k_s": "Q4_K", "q4_k_m": "Q4_K", "q5_k_s": "Q5_K", "q5_k_m": "Q5_K", "gguf:q6_k": "Q6_K",
              "q4_0": "Q4_0", "q4_1": "Q4_1", "q5_0": "Q5_0", "q5_1": "Q5_1", "q8_0": "Q8_0"}
LEGACY = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")
_LEGACY_SCHEME = {"Q4_0": "w4g32", "Q4_1": "w4g32a", "Q5_0": "w5g32", "Q5_1": "w5g32a", "Q8_0": "w8g32"}
_K_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def base_type(ftype: str) -> str:
    """The GGUF type a llama.cpp file type starts every tensor from (``default_type``: Q4_K for Q4_K_M)."""
    got = BASE_TYPES.get(ftype.strip().lower())
    if got is None:
        raise SchemeError(f"unknown llama.cpp file type {ftype!r}; choose one of {', '.join(BASE_TYPES)}")
    return got


def _block(qtype: str) -> int:
    return 256 if qtype.endswith("_K") else 32


def width_fallback(qtype: str, cols: int) -> str:
    """``tensor_type_fallback``: a K type on rows not a multiple of 256 -> its 32-block type, then F16."""
    if cols % _block(qtype) == 0:
        return qtype
    fallback = _K_FALLBACK.get(qtype, "F16")
    return fallback if cols % _block(fallback) == 0 else "F16"


def embedding_types(ftype: str, cols: int, tied: bool) -> dict[str, str]:
    """GGUF types of ``token_embd`` (and ``output`` when not tied) in llama.cpp's file type ``ftype``.

    The rule of ``llama_tensor_get_type_impl`` (src/llama-quant.cpp): the output tensor, and
    the token embedding when it is also the output (tied: no ``output.weight``), take Q8_0 when
    their rows are not a multiple of the base type's block, else Q6_K (Q8_0 stays Q8_0); an
    untied token embedding keeps the base type. Both then pass ``tensor_type_fallback``.
    """
    base = base_type(ftype)
    out = "Q8_0" if cols % _block(base) or base == "Q8_0" else "Q6_K"
    if tied:
        return {"token_embd": width_fallback(out, cols)}
    return {"token_embd": width_fallback(base, cols), "output": width_fallback(out, cols)}


def gguf_scheme(qtype: str) -> Scheme:
    """The lowbit scheme whose codes a GGUF type holds exactly, with lowbit's importance-weighted search rule."""
    name = f"q{qtype[1]}_k" if qtype.endswith("_K") else _LEGACY_SCHEME[qtype]
    return Scheme.parse(name).replace(rule="search")


def tensor_bytes(qtype: str, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of ``shape`` (outermost first) in GGUF type ``qtype`` (gguf-py's block sizes)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    n = 1
    for d in shape:
        n *= int(d)
    return n // block * size


def file_type_name(number: int) -> str | None:
    """The lowbit name of a GGUF ``general.file_type`` number (None: not one lowbit reproduces)."""
    from lowbit.files.gguf_export import FILE_TYPES

    return {v: k for k, v in FILE_TYPES.items()}.get(int(number))
