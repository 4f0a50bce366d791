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

from lowbit.errors import LowbitError

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
    p = _Parser(prog="lowbit", description="Make LLMs small: quantize, train, fine-tune, evaluate, export.")
    from lowbit import __version__

    p.add_argument("--version", action="version", version=f"lowbit {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for mod in COMMAND_MODULES:
        importlib.import_module(mod).register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit code (a bad flag is one line on stderr and code 2)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or a flag argparse refused (already printed)
        return e.code if isinstance(e.code, int) else 2
    try:
        with _one_line_warnings(args.command):
            result = args.func(args)
    except LowbitError as e:
        print(f"lowbit {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"lowbit {args.command}: interrupted", file=sys.stderr)
        return 130
    emit(result, getattr(args, "json", False))
    return 0


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
        if isinstance(v, float):
            v = f"{v:.4g}"
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    raise SystemExit(main())
