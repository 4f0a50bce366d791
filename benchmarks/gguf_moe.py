"""Perplexity of lowbit's GGUF export of the MoE organism in llama.cpp next to lowbit's own evaluation.

    python -m benchmarks.gguf_moe [--schemes w8g32,w4g32,mxfp4,q4_k_m] [--windows 8] [--seqlen 256] [--threads 1]
    python -m benchmarks.gguf_moe --schemes q4_k_m,w4g32 --search    # lowbit's RTN with its importance search

The MoE organism (`python -m benchmarks.organism --arch qwen3moe`: 4 blocks, 16 experts top-2,
hidden 128) is quantized with RTN (no search) for each scheme, evaluated by lowbit, exported
to GGUF (qwen3moe: 3-D ffn_*_exps tensors, exact Q8_0 / Q4_0 / MXFP4 blocks, embeddings kept as
they are so the file holds exactly the evaluated weights), and run by llama.cpp
(llama-cpp-python) on the same token ids: its custom tokenizer plays no part. llama.cpp
multiplies quantized weights by 8-bit-quantized activations, so a small gap is expected; a
wrong expert split or routing would show as a large one. For the llama.cpp mixes (q4_k_m ...) a
second row runs llama.cpp's own quantizer (``llama_model_quantize``) on lowbit's float GGUF of the
organism: the same tensor types (lowbit's mix plan follows llama.cpp's MoE rules), its own
rounding. Rows go to
benchmarks/results/gguf_moe.json (``--out``), keyed by (scheme, tool, seed).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import require_peer
from benchmarks.gguf import FTYPES

ORGANISM = Path.home() / ".cache" / "lowbit" / "organism-moe"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gguf_moe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--organism", type=Path, default=ORGANISM)
    p.add_argument("--schemes", default="w8g32,w4g32,mxfp4,q4_k_m")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--seqlen", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--search", action="store_true", help="RTN with lowbit's importance search (default: plain RTN)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gguf_moe.json")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    require_peer("llama_cpp", "install it with `make bench-setup`")
    import torch

    from benchmarks.llamacpp import llamacpp_nll
    from benchmarks.organism import load_tokens, spread_windows
    from lowbit.api import build_plan
    from lowbit.eval import perplexity
    from lowbit.eval.perplexity import eval_windows
    from lowbit.files import gguf_export
    from lowbit.models.loading import load_model
    from lowbit.ptq import quantize_model

    torch.set_num_threads(args.threads)
    lm = load_model(str(args.organism / "model"))
    tokens = load_tokens(args.organism, args.organism / "corpus.jsonl")
    if tokens is None:
        raise SystemExit(f"no token cache for {args.organism}: run `python -m benchmarks.organism --arch qwen3moe`")
    ids = tokens[1]
    win = eval_windows(ids, args.seqlen, args.windows)
    rows = []
    base = perplexity(lm.model, ids, args.seqlen, args.windows, progress=False).ppl
    for scheme in args.schemes.split(","):
        model = copy.deepcopy(lm.model)
        calib = spread_windows(tokens[0], 256, 32) if args.search else None  # the train split: 32 x 256
        quantize_model(model, build_plan(model, scheme), "rtn", {"search": args.search}, calib=calib, progress=False)
        row = {"scheme": scheme, "tool": "lowbit-gguf" + ("-search" if args.search else ""), "seed": 0,
               "ppl_float": base,
               "ppl_lowbit": perplexity(model, ids, args.seqlen, args.windows, progress=False).ppl}
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "organism-moe.gguf"
            r = gguf_export.export(model, lm.tokenizer, out, embeddings="f16")
            row["types"], row["file_bytes"] = r["types"], out.stat().st_size
            t0 = time.perf_counter()
            nll, n = llamacpp_nll(out, win, args.threads)
            row["ppl_llamacpp"] = math.exp(nll / n)
            row["llamacpp_seconds"] = round(time.perf_counter() - t0, 1)
        row["rel_gap"] = round(row["ppl_llamacpp"] / row["ppl_lowbit"] - 1, 5)
        rows.append(row)
        if scheme in FTYPES and not args.search:
            rows.append(llamacpp_row(lm.model, lm.tokenizer, scheme, win, args.threads, row["types"], base))
        print(f"{scheme:8s} lowbit {row['ppl_lowbit']:.4f}  llama.cpp {row['ppl_llamacpp']:.4f}  "
              f"gap {100 * row['rel_gap']:+.3f}%  {row['file_bytes']:,} B  {row['types']}", flush=True)
    result = {"organism": str(args.organism), "windows": args.windows, "seqlen": args.seqlen,
              "llama_cpp_python": _version(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.out.exists():  # rows of other runs stay, keyed by (scheme, tool, seed)
        keys = {(r["scheme"], r["tool"], r["seed"]) for r in rows}
        old = json.loads(args.out.read_text()).get("rows", [])
        result["rows"] = [r for r in old if (r["scheme"], r["tool"], r["seed"]) not in keys] + rows
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def llamacpp_row(model, tokenizer, mix: str, win, threads: int, lowbit_types: dict, base: float) -> dict:
    """llama.cpp's own quantizer on lowbit's float GGUF of the organism (F32 experts), embeddings kept as in lowbit's
    file: its per-type tensor counts must equal lowbit's mix file's, its perplexity is the peer's."""
    from benchmarks.gguf import gguf_types, llamacpp_quantize
    from benchmarks.llamacpp import llamacpp_nll
    from lowbit.files import gguf_export

    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "float.gguf", Path(tmp) / f"{mix}.gguf"
        gguf_export.export(model, tokenizer, src)
        t0 = time.perf_counter()
        llamacpp_quantize(src, out, mix, threads, embeddings="f16")
        row = {"scheme": mix, "tool": "llama.cpp-quantize", "seed": 0, "ppl_float": base,
               "quantize_seconds": round(time.perf_counter() - t0, 1), "types": gguf_types(out),
               "file_bytes": out.stat().st_size}
        nll, n = llamacpp_nll(out, win, threads)
    row["ppl_llamacpp"] = math.exp(nll / n)
    theirs = {k: v for k, v in row["types"].items() if k not in ("F16", "F32")}
    row["same_types_as_lowbit"] = theirs == {k: v for k, v in lowbit_types.items() if k not in ("F16", "F32")}
    print(f"{mix:8s} llama.cpp's own quantizer: llama.cpp {row['ppl_llamacpp']:.4f}  {row['file_bytes']:,} B  "
          f"{row['types']}  same types as lowbit: {row['same_types_as_lowbit']}", flush=True)
    return row


def _version() -> str:
    import llama_cpp

    return getattr(llama_cpp, "__version__", "?")


if __name__ == "__main__":
    main(sys.argv[1:])
