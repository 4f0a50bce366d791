"""The `lowbit` command line: thin commands over the public API.

Each command lives in its own module exposing ``register(subparsers)``; its ``run(args)``
returns a dict. With ``--json`` that dict is printed as one JSON object on the last line
of stdout (scripts rely on it); without, as aligned ``key: value`` lines. Any
`LowbitError` becomes one line on stderr and a non-zero exit, and a warning one line
``lowbit COMMAND: warning: ...`` (no source line of lowbit's code under it).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
import warnings
from collections.abc import Sequence
from typing import NoReturn

from lowbit.errors import LowbitError, did_you_mean

COMMAND_MODULES = [
    "lowbit.cli.quantize",
    "lowbit.cli.evaluate",
    "lowbit.cli.inspect",
    "lowbit.cli.formats",
    "lowbit.cli.qat",
    "lowbit.cli.finetune",
    "lowbit.cli.export",
]


class _Parser(argparse.ArgumentParser):
    """argparse with lowbit's error contract: one line on stderr naming the fix, exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="lowbit", description="Make LLMs small: quantize, train, fine-tune, evaluate, export.",
                epilog="A first run: `lowbit quantize --out out/q` quantizes the bundled SmolLM2-135M to w4g128 "
                       "and prints its perplexity before and after. `lowbit COMMAND --help` lists a command's flags.")
    from lowbit import __version__

    p.add_argument("--version", action="version", version=f"lowbit {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for mod in COMMAND_MODULES:
        importlib.import_module(mod).register(sub)
    for name, command in sub.choices.items():
        if name != "inspect":  # reads headers only
            command.add_argument("--threads", type=int, default=None, metavar="N",
                                 help="CPU threads for torch (default: one per core; on a busy machine 1 is "
                                      "often several times faster)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit code (a bad flag is one line on stderr and code 2)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:  # a first try: show what there is to do rather than "COMMAND is required"
        parser.print_help(sys.stderr)
        return 2
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:
            _unknown(parser, args, extra)
    except SystemExit as e:  # --help, --version, or a flag argparse refused (already printed)
        return e.code if isinstance(e.code, int) else 2
    from lowbit.api.common import busy_note, set_threads

    try:
        set_threads(getattr(args, "threads", None))
        with _one_line_warnings(args.command):
            result = args.func(args)
    except LowbitError as e:
        print(f"lowbit {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"lowbit {args.command}: interrupted", file=sys.stderr)
        return 130
    emit(result, getattr(args, "json", False))
    note = busy_note(getattr(args, "threads", None)) if "threads" in args else None
    if note is not None:  # after the result: an error stays one line, and the run's load is known by now
        print(f"lowbit {args.command}: {note}", file=sys.stderr)
    return 0


def _unknown(parser: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str]) -> NoReturn:
    """Refuse flags the chosen command does not take, naming that command and the closest flag it has."""
    sub = _subparser(parser, args.command)
    flags = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
    first = next((x for x in extra if x.startswith("-")), extra[0])
    hint = did_you_mean(first.split("=", 1)[0], flags) if first.startswith("-") else ""
    sub.error(f"unrecognized argument{'s' if len(extra) > 1 else ''}: {' '.join(extra)}{hint}")


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[command]


@contextlib.contextmanager
def _one_line_warnings(command: str):
    """Show each warning as one stderr line naming the command, for the body.

    Only the text is changed (``formatwarning``), not where warnings go, so a caller that
    records them (``warnings.catch_warnings(record=True)``, pytest) still receives them.
    """
    def fmt(message, category, filename, lineno, line=None):  # noqa: ANN001 - warnings' signature
        return f"lowbit {command}: warning: {message}\n"

    saved = warnings.formatwarning
    warnings.formatwarning = fmt
    try:
        yield
    finally:
        warnings.formatwarning = saved


def emit(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, default=str), flush=True)
        return
    width = max((len(k) for k in result), default=0)
    for k, v in result.items():
        print(f"{k:<{width}}  {_text(v)}")


def _text(v: object) -> str:
    """A value as a person reads it: None as -, floats to 4 digits, mappings as ``k: v, ...``, lists comma-separated."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k}: {_text(x)}" for k, x in v.items()) or "-"
    if isinstance(v, (list, tuple)):
        return ", ".join(_text(x) for x in v) or "-"
    return str(v)


if __name__ == "__main__":
    raise SystemExit(main())
