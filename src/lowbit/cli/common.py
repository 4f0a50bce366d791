"""Arguments shared by several commands, so flags mean the same everywhere.

Flags whose meaning depends on the path a run takes (a method's knobs, calibration and
evaluation settings) default to ``argparse.SUPPRESS``: they appear in the parsed
namespace only when the user gave them, so a job can refuse a flag its path cannot
honour instead of silently ignoring it.
"""

from __future__ import annotations

import argparse
from typing import Any

UNSET = argparse.SUPPRESS


def add_model(p: argparse.ArgumentParser, required: bool = False) -> None:
    help_ = ("model: a local HF folder, a .gguf file, a lowbit checkpoint, or a hub id; "
             "omitted = the bundled SmolLM2-135M-Instruct")
    if required:
        p.add_argument("model", metavar="MODEL", help=help_)
    else:
        p.add_argument("model", metavar="MODEL", nargs="?", default=None, help=help_)


def add_data(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", metavar="SRC", default=None,
                   help="text: a .txt or .jsonl file or a saved HF dataset folder; "
                        "omitted = the bundled corpus (Python's documentation)")


def add_eval(p: argparse.ArgumentParser, seqlen_flag: str = "--eval-seqlen") -> None:
    """Evaluation window flags plus --no-eval (refused together)."""
    p.add_argument(seqlen_flag, dest="eval_seqlen", type=positive(seqlen_flag), default=UNSET, metavar="N",
                   help="tokens per eval window (512)")
    p.add_argument("--windows", type=nonnegative("--windows"), default=UNSET, metavar="N",
                   help="eval windows from the start of the eval split (40); 0 = the whole text")
    p.add_argument("--no-eval", action="store_true", help="skip the perplexity evaluations")


def evaluation(args: argparse.Namespace, data: str | None = None) -> Any:
    """The `Evaluation` the flags describe, or None with --no-eval (then window flags are an error)."""
    from lowbit.api import Evaluation
    from lowbit.errors import ConfigError

    got = given(args, "eval_seqlen", "windows")
    if getattr(args, "no_eval", False):
        if got:
            raise ConfigError(f"{', '.join(flag(k) for k in got)} set the evaluation, which --no-eval skips; "
                              "drop one of them")
        return None
    return Evaluation(data=data, seqlen=got.get("eval_seqlen", 512), windows=got.get("windows", 40))


class OldName(argparse.Action):
    """A flag kept under its old name: it works, and says once on stderr which name to use instead."""

    def __init__(self, option_strings: list[str], dest: str, new: str, **kw: Any) -> None:
        super().__init__(option_strings, dest, **kw)
        self.new = new

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        import sys

        print(f"{parser.prog}: note: {option_string} is now {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")


def add_out(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--out", metavar="DIR", required=required, help="output folder (written atomically)")
    p.add_argument("--force", action="store_true",
                   help="replace --out if it is an earlier lowbit output holding only lowbit's files")


def add_device(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--device", default=None, help=f"compute device (cpu, cuda, cuda:N) for {what}; under "
                   "torchrun each rank uses its own GPU")


def given(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """The named flags the user actually gave (those defaulting to `UNSET` are absent otherwise)."""
    d = vars(args)
    return {k: d[k] for k in names if k in d}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def positive(kind: str):
    def conv(text: str) -> int:
        v = int(text)
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{kind} must be a positive integer, got {text}")
        return v

    return conv


def nonnegative(kind: str):
    def conv(text: str) -> int:
        v = int(text)
        if v < 0:
            raise argparse.ArgumentTypeError(f"{kind} must be >= 0, got {text}")
        return v

    return conv


def add_keep(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keep", metavar="PATTERNS", default=None,
                   help="matmul weights to keep in float on purpose (comma-separated): a kind (attention, mlp, "
                        "experts, shared_experts, router, embeddings, lm_head, other) or a glob over names "
                        "('model.layers.0.*'). Without it, a plan that leaves more than embeddings, routers and the "
                        "lm_head in float (e.g. a mixture-of-experts model's experts) is refused")


def keep(args: argparse.Namespace) -> tuple[str, ...]:
    """--keep as a tuple of patterns (empty when not given)."""
    from lowbit.errors import ConfigError

    given_ = vars(args).get("keep")
    if given_ is None:
        return ()
    pats = tuple(s.strip() for s in given_.split(",") if s.strip())
    if not pats:
        raise ConfigError("--keep takes kinds or name globs, comma-separated (e.g. --keep experts)")
    return pats
