"""`lowbit formats`: the block-size study (weight error, optional perplexity, PNG plot)."""

from __future__ import annotations

import argparse
import sys
import time

from lowbit.cli import common
from lowbit.errors import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    from lowbit.studies import DEFAULT_BLOCKS, DEFAULT_SCHEMES

    p = sub.add_parser("formats", help="block-size study of FP4 formats and scale rules",
                       description="For each scheme and block size: the relative weight error over all "
                                   "quantized Linear weights (sum sq err / sum sq) and, with --ppl, the "
                                   "model perplexity; a table, --json and a PNG plot.")
    common.add_model(p)
    p.add_argument("--schemes", default=",".join(DEFAULT_SCHEMES),
                   help="comma-separated schemes (an item with '=' continues the options of the one "
                        "before), e.g. 'nvfp4,nvfp4:guard=1,nvfp4-46,nvfp4-46:rule=span'; block sizes "
                        "come from --block-sizes. Default: " + ",".join(DEFAULT_SCHEMES))
    p.add_argument("--block-sizes", default=",".join(map(str, DEFAULT_BLOCKS)),
                   help="comma-separated block sizes (8,16,32,64)")
    p.add_argument("--ppl", action="store_true", help="also measure perplexity per point (slower)")
    p.add_argument("--plot", metavar="FILE", default=None, help="write a PNG plot (error, or ppl with --ppl)")
    common.add_data(p)
    common.add_eval(p)
    common.add_json(p)
    p.set_defaults(func=run)


def parse_schemes(text: str) -> list[str]:
    """Split a scheme list on ',' and ';'; a piece with '=' is an option of the scheme before."""
    out: list[str] = []
    for piece in filter(None, (t.strip() for t in text.replace(";", ",").split(","))):
        if "=" in piece and ":" not in piece and out:
            out[-1] += "," + piece
        else:
            out.append(piece)
    if not out:
        raise ConfigError("--schemes is empty; give e.g. nvfp4,nvfp4-46")
    return out


def parse_blocks(text: str) -> list[int]:
    try:
        blocks = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ConfigError(f"--block-sizes must be comma-separated integers, got {text!r}") from None
    if not blocks or any(not 4 <= b <= 256 for b in blocks):
        raise ConfigError(f"--block-sizes must be in 4..256 for FP block formats, got {text!r}")
    return sorted(set(blocks))


def run(args: argparse.Namespace) -> dict:
    from lowbit.formats import Scheme
    from lowbit.models import load_model
    from lowbit.studies import model_block_study, plot_study, verdicts

    t0 = time.perf_counter()
    schemes = parse_schemes(args.schemes)
    for s in schemes:
        Scheme.parse(s)  # reject bad names before loading anything
    blocks = parse_blocks(args.block_sizes)
    loaded = load_model(args.model)
    tokens = None
    if args.ppl:
        from lowbit.data import eval_tokens

        tokens = eval_tokens(loaded.tokenizer, args.data)
    rows, fp_ppl = model_block_study(loaded.model, schemes, blocks, tokens, args.eval_seqlen,
                                     args.windows or None, progress=not args.json)
    print_table(rows, fp_ppl)
    result = {"model": str(loaded.source), "block_sizes": blocks, "schemes": schemes,
              "rows": [r.to_dict() for r in rows], "fp_ppl": fp_ppl,
              "verdict_error": verdicts(rows, "rel_error")}
    if args.ppl:
        result["verdict_ppl"] = verdicts(rows, "ppl")
    if args.plot:
        result["plot"] = str(plot_study(rows, args.plot, "ppl" if args.ppl else "rel_error", fp_ppl=fp_ppl))
    result["seconds"] = round(time.perf_counter() - t0, 2)
    return result


def print_table(rows, fp_ppl=None, file=sys.stderr) -> None:
    """Scheme lines x block sizes, relative weight error (and ppl) per cell."""
    blocks = sorted({r.block for r in rows})
    labels = list(dict.fromkeys(r.label for r in rows))
    cell = {(r.label, r.block): r for r in rows}
    width = max(len(x) for x in labels + ["scheme"])
    print(f"{'scheme':<{width}}  " + "  ".join(f"{'block ' + str(b):>20}" for b in blocks), file=file)
    for label in labels:
        parts = []
        for b in blocks:
            r = cell.get((label, b))
            txt = "" if r is None else f"{r.rel_error:.5f}" + (f" / {r.ppl:7.3f}" if r.ppl is not None else "")
            parts.append(f"{txt:>20}")
        print(f"{label:<{width}}  " + "  ".join(parts), file=file)
    if fp_ppl is not None:
        print(f"full-precision perplexity: {fp_ppl:.3f}", file=file)
