"""`lowbit export`: a native checkpoint to compressed-tensors (vLLM) or GGUF (llama.cpp)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from lowbit.cli import common

TARGETS = ("compressed-tensors", "gguf")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="convert a lowbit checkpoint for vLLM (compressed-tensors) or llama.cpp (GGUF)",
                       description="Write the checkpoint's exact codes in another engine's format; schemes the "
                                   "target cannot hold exactly are refused (GGUF: unless --allow-requant).")
    p.add_argument("checkpoint", metavar="DIR", help="a folder written by `lowbit quantize --out`")
    p.add_argument("--to", required=True, choices=TARGETS, help="target format")
    p.add_argument("--out", required=True, metavar="PATH", help="output folder (compressed-tensors) or .gguf file")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--allow-requant", action="store_true",
                   help="GGUF: re-quantize layers with no exact GGUF type (their numbers change)")
    common.add_json(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> dict:
    from lowbit.errors import LowbitError
    from lowbit.export.native import load, read_manifest

    out = Path(args.out)
    if out.exists() and not args.force:
        raise LowbitError(f"{out} already exists; choose another --out or pass --force to replace it")
    if args.allow_requant and args.to != "gguf":
        raise LowbitError("--allow-requant applies to --to gguf only; compressed-tensors exports are always exact")
    manifest = read_manifest(args.checkpoint)
    t0 = time.perf_counter()
    model, tokenizer = load(args.checkpoint)
    result = {"checkpoint": str(args.checkpoint), "to": args.to}
    if args.to == "compressed-tensors":
        from lowbit.export import compressed_tensors

        compressed_tensors.export(model, tokenizer, out, force=args.force)
        result["out"] = str(out)
    else:
        from lowbit.export import gguf_export

        source = _source_gguf(manifest)
        result |= gguf_export.export(model, tokenizer, out, force=args.force, allow_requant=args.allow_requant,
                                     source_gguf=source, name=str(manifest.get("meta", {}).get("source") or "lowbit"))
        result["tokenizer_from"] = str(source) if source else "checkpoint tokenizer"
    from lowbit.export.inspect import inspect

    info = inspect(out)
    result |= {k: info[k] for k in ("bits_per_weight", "file_bytes", "fp16_bytes", "size_vs_fp16")}
    result["seconds"] = round(time.perf_counter() - t0, 2)
    return result


def _source_gguf(manifest: dict) -> Path | None:
    """The GGUF the checkpoint was made from, whose tokenizer keys llama.cpp knows exactly."""
    from lowbit.models.loading import BUNDLED_NAME, bundled_gguf

    source = manifest.get("meta", {}).get("source")
    if source == BUNDLED_NAME:
        return bundled_gguf()
    if isinstance(source, str) and source.endswith(".gguf") and Path(source).is_file():
        return Path(source)
    return None
