"""`lowbit export`: a native checkpoint to compressed-tensors (vLLM) or GGUF (llama.cpp)."""

from __future__ import annotations

import argparse

from lowbit.cli import common


def register(sub: argparse._SubParsersAction) -> None:
    from lowbit.api.export import EMBEDDINGS, TARGETS

    p = sub.add_parser("export", help="convert a lowbit checkpoint for vLLM (compressed-tensors) or llama.cpp (GGUF)",
                       description="Write the checkpoint's exact codes in another engine's format; schemes the "
                                   "target cannot hold exactly are refused (GGUF: unless --allow-requant).")
    p.add_argument("checkpoint", metavar="DIR", help="a folder written by `lowbit quantize --out`")
    p.add_argument("--to", required=True, choices=TARGETS, help="target format")
    p.add_argument("--out", required=True, metavar="PATH", help="output folder (compressed-tensors) or .gguf file")
    p.add_argument("--force", action="store_true", help="replace --out if it is an earlier lowbit export")
    p.add_argument("--allow-requant", action="store_true",
                   help="GGUF: re-quantize layers with no exact GGUF type (their numbers change)")
    p.add_argument("--embeddings", choices=EMBEDDINGS, default=None,
                   help="GGUF: token_embd and a float output tensor in llama.cpp's types for the checkpoint's mix "
                        "(llama.cpp, the default: Q8_0 / Q6_K ... as its own file has them) or kept 16-bit (f16)")
    p.add_argument("--drop-kv", action="store_true",
                   help="GGUF: write a checkpoint quantized with --kv without its KV-cache scheme (GGUF has none; "
                        "llama.cpp picks its cache type at run time)")
    common.add_json(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> dict:
    from lowbit import api

    return api.export(api.ExportJob(args.checkpoint, args.to, args.out, force=args.force,
                                    allow_requant=args.allow_requant, embeddings=args.embeddings, drop_kv=args.drop_kv))
