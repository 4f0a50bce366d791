"""Arguments shared by several commands, so flags mean the same everywhere."""

from __future__ import annotations

import argparse


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


def add_eval(p: argparse.ArgumentParser) -> None:
    p.add_argument("--eval-seqlen", type=int, default=512, metavar="N", help="tokens per eval window (512)")
    p.add_argument("--windows", type=int, default=40, metavar="N",
                   help="eval windows from the start of the eval split (40); 0 = the whole text")


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")


def add_out(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--out", metavar="DIR", required=required, help="output folder (written atomically)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")


def positive(kind: str):
    def conv(text: str) -> int:
        v = int(text)
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{kind} must be a positive integer, got {text}")
        return v

    return conv
