"""`lowbit inspect`: format, per-layer schemes, bits per weight and size of any lowbit output."""

from __future__ import annotations

import argparse

from lowbit.cli import common


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="show what a checkpoint / export holds",
                       description="Reads a native lowbit checkpoint (checksums verified), a compressed-tensors "
                                   "folder or a GGUF file: format, schemes, bits per weight (from stored bytes, "
                                   "as `lowbit quantize` counts them), size vs fp16. A table per scheme by "
                                   "default; --layers lists every layer.")
    p.add_argument("path", metavar="PATH", help="checkpoint folder, compressed-tensors folder or .gguf file")
    p.add_argument("--layers", action="store_true",
                   help="list every quantized layer (scheme, shape, bits per weight, input format; for a GGUF "
                        "every tensor and its GGUF type); the --json output always holds them")
    common.add_json(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> dict:
    from lowbit import api

    info = api.inspect(args.path)
    if not args.json:
        if args.layers and "tensors" in info:  # a GGUF: every tensor, the 16-bit ones included
            print(tensor_table(info["tensors"]))
        else:
            print(layer_table(info["layers"]) if args.layers else scheme_table(info["layers"]))
        info = {k: v for k, v in info.items() if k not in ("layers", "schemes", "inputs", "tensors")}
    return info


def scheme_table(layers: list[dict]) -> str:
    """One row per (scheme, input format): layers, weights and their stored bits per weight."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in layers:
        groups.setdefault((r["scheme"], r.get("input") or "-"), []).append(r)
    acts = any(k[1] != "-" for k in groups)
    rows = [("scheme", *(("input",) if acts else ()), "layers", "weights", "bits/w stored")]
    for (scheme, inp), rs in groups.items():
        n = sum(r["shape"][0] * r["shape"][1] for r in rs)
        bits = sum(r["bits_per_weight"] * r["shape"][0] * r["shape"][1] for r in rs) / max(n, 1)
        rows.append((scheme, *((inp,) if acts else ()), str(len(rs)), f"{n:,}", f"{bits:.3f}"))
    return _align(rows) if layers else "no quantized layers"


def layer_table(layers: list[dict]) -> str:
    acts = any(r.get("input") for r in layers)
    rows = [("layer", "scheme", "shape", "bits/w stored", *(("input",) if acts else ()))]
    rows += [(r["name"], r["scheme"], "x".join(str(d) for d in r["shape"]), f"{r['bits_per_weight']:.3f}",
              *((r.get("input") or "-",) if acts else ())) for r in layers]
    return _align(rows) if layers else "no quantized layers"


def tensor_table(tensors: list[dict]) -> str:
    """A GGUF's tensors: name, GGUF type, shape, bytes."""
    rows = [("tensor", "type", "shape", "bytes")]
    rows += [(t["name"], t["type"], "x".join(str(d) for d in t["shape"]), f"{t['bytes']:,}") for t in tensors]
    return _align(rows)


def _align(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)
