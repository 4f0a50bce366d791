"""The formats job: the FP4 block-size / scale-rule study on a model's Linear weights, or on their inputs.

``inputs=True`` studies the activations instead: each Linear's calibration inputs per
input scheme and block size (relative error, underflowed E4M3 block scales), and with
``ppl`` the W4A4 perplexity of each point. Calibration tokens come from the
calibration split, perplexity from the evaluation split.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowbit.api.common import Calibration, Evaluation, job_device
from lowbit.configs import check_fields
from lowbit.errors import ConfigError
from lowbit.formats import InputScheme, Scheme
from lowbit.studies import DEFAULT_BLOCKS, DEFAULT_INPUT_SCHEMES, DEFAULT_SCHEMES

__all__ = ["DEFAULT_BLOCKS", "DEFAULT_INPUT_SCHEMES", "DEFAULT_SCHEMES", "QUICK_WINDOWS", "SAMPLE_BLOCKS", "FormatsJob",
           "formats_study", "sample_layers"]

BLOCK_RANGE = (4, 256)
# the default study answers in a couple of minutes on 2 CPU cores: the Linears of a few decoder
# blocks spread over the depth, and perplexities (--ppl) over fewer windows; full=True studies
# every block with the usual 40 windows (on the bundled model ~20 minutes for the weight error alone)
SAMPLE_BLOCKS = 4
QUICK_WINDOWS = 8


@dataclass(frozen=True)
class FormatsJob:
    """schemes: scheme texts (block sizes come from ``blocks``). ppl: also perplexity per point.

    inputs: study the Linear layers' calibration inputs (schemes are input schemes) on
    ``calib`` tokens; with ``ppl`` each point is a W4A4 model of that format.
    sample_blocks: study the Linears of this many decoder blocks, evenly spread over the
    depth (the first and the last included); 0 = every block. With ``ppl`` only those
    Linears are quantized, so the perplexities compare formats on that sample.
    """

    schemes: tuple[str, ...]
    blocks: tuple[int, ...]
    model: str | None = None
    ppl: bool = False
    plot: str | None = None
    evaluation: Evaluation = field(default_factory=Evaluation)
    device: str | None = None
    progress: bool = True
    inputs: bool = False
    calib: Calibration = field(default_factory=lambda: Calibration(nsamples=8))
    sample_blocks: int = SAMPLE_BLOCKS

    def __post_init__(self) -> None:
        check_fields(self, ConfigError, "formats setting")
        if self.sample_blocks < 0:
            raise ConfigError(f"--sample must be >= 0 decoder blocks (0 = all), got {self.sample_blocks}")
        object.__setattr__(self, "schemes", tuple(self.schemes))
        object.__setattr__(self, "blocks", tuple(sorted(set(self.blocks))))
        if not self.schemes:
            raise ConfigError("--schemes is empty; give e.g. nvfp4,nvfp4-46")
        lo, hi = BLOCK_RANGE
        if not self.blocks or any(not lo <= b <= hi for b in self.blocks):
            raise ConfigError(f"--block-sizes must be in {lo}..{hi} for FP block formats, got {list(self.blocks)}")
        for s in self.schemes:
            (InputScheme if self.inputs else Scheme).parse(s)  # reject bad names before loading anything
        if self.device is not None and not self.ppl:
            raise ConfigError("--device applies to the perplexity passes; add --ppl (the weight error runs "
                              "on the CPU)")
        if self.plot is not None and Path(self.plot).suffix.lower() != ".png":
            raise ConfigError(f"--plot writes a PNG; give a .png file name, got {self.plot}")


def formats_study(job: FormatsJob) -> tuple[dict[str, Any], list[Any]]:
    """Run the study; returns the summary and the `StudyRow` s (for a table)."""
    from lowbit.models import load_model
    from lowbit.models.placement import on_device
    from lowbit.studies import model_block_study, plot_study, verdicts

    t0 = time.perf_counter()
    device = job_device(job.device)
    lm = load_model(job.model)
    tokens = job.evaluation.tokens(lm.tokenizer) if job.ppl else None
    ev = job.evaluation
    names, layers_note = sample_layers(lm.model, job.sample_blocks)
    with on_device(lm.model, device if job.ppl else None):
        if job.inputs:
            rows, fp_ppl = _input_study(job, lm, tokens, names)
        else:
            rows, fp_ppl = model_block_study(lm.model, job.schemes, job.blocks, tokens, ev.seqlen,
                                             ev.windows or None, progress=job.progress, names=names)
    result: dict[str, Any] = {"model": str(lm.source), "block_sizes": list(job.blocks), "schemes": list(job.schemes),
                              "mode": "inputs" if job.inputs else "weights", "layers": layers_note,
                              **({"ppl_windows": ev.windows} if job.ppl else {}),
                              "rows": [r.to_dict() for r in rows], "fp_ppl": fp_ppl,
                              "verdict_error": verdicts(rows, "rel_error")}
    if job.inputs:
        result["verdict_underflow"] = verdicts(rows, "underflow")
    if job.ppl:
        result["verdict_ppl"] = verdicts(rows, "ppl")
    if job.plot:
        title = "FP4 block size vs input error (calibration activations)" if job.inputs else None
        result["plot"] = str(plot_study(rows, job.plot, "ppl" if job.ppl else "rel_error", title=title,
                                        fp_ppl=fp_ppl))
    result["seconds"] = round(time.perf_counter() - t0, 2)
    return result, rows


def sample_layers(model: Any, blocks: int) -> tuple[list[str], str]:
    """The decoder Linears of ``blocks`` blocks evenly spread over the depth (0 = all), and a note saying which."""
    from lowbit.models import linear_layers
    from lowbit.models.layers import block_path, decoder_blocks

    names = list(linear_layers(model))
    total = len(decoder_blocks(model))
    if blocks == 0 or blocks >= total:
        return names, f"every decoder block ({len(names)} Linears)"
    picks = sorted({round(i * (total - 1) / (blocks - 1)) for i in range(blocks)}) if blocks > 1 else [total // 2]
    prefix = block_path(model) + "."
    chosen = [n for n in names if int(n[len(prefix):].split(".")[0]) in picks]
    return chosen, (f"a sample: blocks {', '.join(map(str, picks))} of {total} ({len(chosen)} of {len(names)} "
                    "Linears); --full studies every block")


def _input_study(job: FormatsJob, lm: Any, tokens: Any, layers: list[str]) -> tuple[list[Any], float | None]:
    """The inputs mode: rows over the chosen Linears' calibration inputs (and W4A4 ppl)."""
    from lowbit.studies import input_block_study, w4a4_ppl_fn

    calib = job.calib.batches(lm.tokenizer)
    ppl_fn, fp_ppl = None, None
    if tokens is not None:
        ev = job.evaluation

        def run() -> float:
            return ev.perplexity(lm.model, tokens, progress=False).ppl

        fp_ppl = run()
        ppl_fn = w4a4_ppl_fn(lm.model, layers, run)
    rows = input_block_study(lm.model, layers, calib, job.schemes, job.blocks, ppl_fn, progress=job.progress)
    return rows, fp_ppl
