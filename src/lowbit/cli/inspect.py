"""`lowbit inspect`: format, per-layer schemes, bits per weight and size of any lowbit output."""

from __future__ import annotations

import argparse
import sys

from lowbit.cli import common


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="show what a checkpoint / export holds",
                       description="Reads a native lowbit checkpoint (checksums verified), a compressed-tensors "
                                   "folder or a GGUF file: format, per-layer scheme, bits per weight (from stored "
                                   "bytes), size vs fp16.")
    p.add_argument("path", metavar="PATH", help="checkpoint folder, compressed-tensors folder or .gguf file")
    common.add_json(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> dict:
    from lowbit import api

    info = api.inspect(args.path)
    if not args.json:
        _table(info["layers"])
        info = {k: v for k, v in info.items() if k != "layers"}
    return info


def _table(layers: list[dict]) -> None:
    """Per-layer rows on stderr so stdout stays the summary."""
    if not layers:
        return
    w = max(len(r["name"]) for r in layers)
    s = max(len(r["scheme"]) for r in layers)
    acts = any(r.get("input") for r in layers)
    print(f"{'layer':<{w}}  {'scheme':<{s}}  {'shape':>12}  bits/w" + ("  input" if acts else ""), file=sys.stderr)
    for r in layers:
        shape = "x".join(str(d) for d in r["shape"])
        inp = f"  {r.get('input') or '-'}" if acts else ""
        print(f"{r['name']:<{w}}  {r['scheme']:<{s}}  {shape:>12}  {r['bits_per_weight']:.3f}{inp}", file=sys.stderr)
