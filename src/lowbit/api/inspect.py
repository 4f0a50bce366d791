"""The inspect job: what a checkpoint or export holds (checksums verified first)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def inspect(path: str | Path) -> dict[str, Any]:
    """Format, per-layer schemes, bits per weight from stored bytes, size against fp16."""
    from lowbit.files.inspect import GGUF, gguf_layout
    from lowbit.files.inspect import inspect as read
    from lowbit.models.accounting import account_tensors

    info = read(path, account=lambda entries: account_tensors(entries).to_dict())
    if info["format"] == GGUF:
        layout = gguf_layout(Path(path))
        info["tensors"] = layout["tensors"]
        info["llama_cpp"] = llama_cpp_size(layout, info["file_bytes"])
    return info


def llama_cpp_size(layout: dict[str, Any], file_bytes: int) -> dict[str, Any]:
    """This GGUF's size beside the file llama.cpp's own ``llama-quantize`` writes for the same file type.

    llama.cpp's types for the same tensors (`lowbit.plans.kmix.llama_cpp_types`: its rules, no
    imatrix) priced with gguf-py's block sizes; the metadata (tokenizer, keys) and the tensors
    llama.cpp leaves alone (norms, 1-D) are this file's own, so the two sizes differ only by
    the tensor types (and a few bytes of alignment).
    """
    from lowbit.files.gguf_types import file_type_name, tensor_bytes
    from lowbit.plans.kmix import llama_cpp_types

    ftype = None if layout["file_type"] is None else file_type_name(layout["file_type"])
    if ftype is None:
        return {"file_type": layout["file_type"], "note": "not a llama.cpp file type lowbit reproduces "
                "(the mixes q2_k ... q6_k, Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0): no size to compare"}
    tensors = layout["tensors"]
    theirs = llama_cpp_types(ftype, {t["name"]: tuple(t["shape"]) for t in tensors}, layout["n_gqa"],
                             layout.get("n_expert", 0))
    stored = sum(t["bytes"] for t in tensors)
    expected = sum(tensor_bytes(theirs[t["name"]], t["shape"]) if t["name"] in theirs else t["bytes"]
                   for t in tensors)
    differ = {t["name"]: f"{t['type']} (llama.cpp: {theirs[t['name']]})" for t in tensors
              if t["name"] in theirs and theirs[t["name"]] != t["type"]}
    expected_file = file_bytes - stored + expected
    return {"file_type": ftype, "expected_bytes": expected_file, "file_bytes": file_bytes,
            "size_vs_llama_cpp": round(file_bytes / max(expected_file, 1), 4), "types_differ": differ}
