"""`lowbit formats`: the block-size study (weight error, optional perplexity, PNG plot)."""

from __future__ import annotations

import argparse
import sys

from lowbit.cli import common
from lowbit.cli.common import UNSET
from lowbit.errors import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    from lowbit.api.formats import (
        DEFAULT_BLOCKS,
        DEFAULT_INPUT_SCHEMES,
        DEFAULT_SCHEMES,
        QUICK_WINDOWS,
        SAMPLE_BLOCKS,
    )

    p = sub.add_parser("formats", help="block-size study of FP4 formats and scale rules",
                       description="For each scheme and block size: the relative weight error (sum sq err / "
                                   "sum sq) over the Linears of a sample of decoder blocks and, with --ppl, the "
                                   "perplexity with those Linears quantized; a table, --json and a PNG plot. "
                                   "The defaults answer in a couple of minutes on a small CPU; --full studies "
                                   "every block with 40 perplexity windows.")
    common.add_model(p)
    p.add_argument("--schemes", default=UNSET,
                   help="comma-separated schemes (an item with '=' continues the options of the one "
                        "before), e.g. 'nvfp4,nvfp4:guard=1,nvfp4-46,nvfp4-46:rule=span'; block sizes "
                        "come from --block-sizes. Default: " + ",".join(DEFAULT_SCHEMES))
    p.add_argument("--block-sizes", default=",".join(map(str, DEFAULT_BLOCKS)),
                   help="comma-separated block sizes (8,16,32,64)")
    p.add_argument("--ppl", action="store_true", help="also measure perplexity per point (slower)")
    p.add_argument("--sample", type=common.nonnegative("--sample"), default=UNSET, metavar="N",
                   help=f"study the Linears of N decoder blocks spread evenly over the depth ({SAMPLE_BLOCKS}); "
                        "0 = every block")
    p.add_argument("--full", action="store_true",
                   help=f"every decoder block, and 40 perplexity windows with --ppl (the default study samples "
                        f"{SAMPLE_BLOCKS} blocks and {QUICK_WINDOWS} windows)")
    p.add_argument("--inputs", action="store_true",
                   help="study the Linear layers' calibration inputs (activations) instead of their weights: "
                        "relative error and underflowed E4M3 block scales per input scheme and block size, and "
                        "with --ppl the W4A4 perplexity. Default schemes: " + ",".join(DEFAULT_INPUT_SCHEMES))
    p.add_argument("--nsamples", type=common.positive("--nsamples"), default=UNSET,
                   help="with --inputs: calibration samples whose activations are studied (8)")
    p.add_argument("--seqlen", type=common.positive("--seqlen"), default=UNSET,
                   help="with --inputs: tokens per calibration sample (256)")
    p.add_argument("--plot", metavar="FILE", default=None, help="write a PNG plot (error, or ppl with --ppl)")
    common.add_device(p, "the perplexity passes (--ppl)")
    common.add_data(p)
    p.add_argument("--eval-seqlen", type=common.positive("--eval-seqlen"), default=UNSET, metavar="N",
                   help="with --ppl: tokens per eval window (512)")
    p.add_argument("--windows", type=common.nonnegative("--windows"), default=UNSET, metavar="N",
                   help=f"with --ppl: eval windows ({QUICK_WINDOWS}; 40 with --full); 0 = the whole text")
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
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ConfigError(f"--block-sizes must be comma-separated integers, got {text!r}") from None


def run(args: argparse.Namespace) -> dict:
    from lowbit import api

    ev = common.given(args, "eval_seqlen", "windows")
    if ev and not args.ppl:
        raise ConfigError(f"{', '.join(common.flag(k) for k in ev)} set the perplexity passes; add --ppl")
    if args.data is not None and not args.ppl and not args.inputs:
        raise ConfigError("--data is the text of the perplexity passes (and of --inputs' calibration activations); "
                          "add --ppl or --inputs (the weight error needs no text)")
    from lowbit.api.formats import QUICK_WINDOWS, SAMPLE_BLOCKS

    sample = vars(args).get("sample")
    if sample is not None and args.full:
        raise ConfigError("--full studies every block; drop --sample (or --full)")
    evaluation = api.Evaluation(args.data, ev.get("eval_seqlen", 512),
                                ev.get("windows", 40 if args.full else QUICK_WINDOWS))
    cal = common.given(args, "nsamples", "seqlen")
    if cal and not args.inputs:
        raise ConfigError(f"{', '.join(common.flag(k) for k in cal)} set the calibration activations of --inputs; "
                          "add --inputs (the weight study needs no data)")
    from lowbit.api.formats import DEFAULT_INPUT_SCHEMES, DEFAULT_SCHEMES

    default = DEFAULT_INPUT_SCHEMES if args.inputs else DEFAULT_SCHEMES
    schemes = parse_schemes(vars(args).get("schemes") or ",".join(default))
    job = api.FormatsJob(schemes=schemes, blocks=parse_blocks(args.block_sizes),
                         model=args.model, ppl=args.ppl, plot=args.plot, evaluation=evaluation, device=args.device,
                         progress=not args.json, inputs=args.inputs,
                         calib=api.Calibration(args.data if args.inputs else None, **{"nsamples": 8, **cal}),
                         sample_blocks=0 if args.full else (SAMPLE_BLOCKS if sample is None else sample))
    result, rows = api.formats_study(job)
    if args.json:
        return result
    print_table(rows, result["fp_ppl"])
    print_verdicts(result)
    return {k: v for k, v in result.items() if k not in ("rows", "schemes", "block_sizes") and
            not k.startswith("verdict_")}


def print_verdicts(result: dict, file=None) -> None:
    """One line per scheme: does a finer block help, by how much (stdout by default)."""
    for key, metric, what in (("verdict_error", "rel_error", "rel error"), ("verdict_underflow", "underflow",
                              "underflow"), ("verdict_ppl", "ppl", "ppl")):
        for label, v in result.get(key, {}).items():
            fine, coarse = v[f"{metric}_finest"], v[f"{metric}_coarsest"]
            print(f"{label}: {what} {fine:.5g} at block {v['finest']}, {coarse:.5g} at block {v['coarsest']}: "
                  f"finer is {'better' if v['finer_is_better'] else 'not better'}"
                  f"{'' if v['monotone'] else ' (not monotone)'}", file=file if file is not None else sys.stdout)


def print_table(rows, fp_ppl=None, file=None) -> None:
    """Scheme lines x block sizes, relative weight error (and ppl) per cell (to stdout by default).

    ``sys.stdout`` is looked up when called: a default bound at import would keep a stream
    that was replaced (and closed) since, e.g. by a test's output capture.
    """
    file = file if file is not None else sys.stdout
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
            if r is not None and r.underflow:  # inputs mode: share of underflowed block scales
                txt += f" u{100 * r.underflow:.1f}%"
            parts.append(f"{txt:>20}")
        print(f"{label:<{width}}  " + "  ".join(parts), file=file)
    if fp_ppl is not None:
        print(f"full-precision perplexity: {fp_ppl:.3f}", file=file)
