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

__all__ = ["DEFAULT_BLOCKS", "DEFAULT_INPUT_SCHEMES", "DEFAULT_SCHEMES", "FormatsJob", "formats_study"]

BLOCK_RANGE = (4, 256)


@dataclass(frozen=True)
class FormatsJob:
    """schemes: scheme texts (block sizes come from ``blocks``). ppl: also perplexity per point.

    inputs: study the Linear layers' calibration inputs (schemes are input schemes) on
    ``calib`` tokens; with ``ppl`` each point is a W4A4 model of that format.
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

    def __post_init__(self) -> None:
        check_fields(self, ConfigError, "formats setting")
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
    with on_device(lm.model, device if job.ppl else None):
        if job.inputs:
            rows, fp_ppl = _input_study(job, lm, tokens)
        else:
            rows, fp_ppl = model_block_study(lm.model, job.schemes, job.blocks, tokens, ev.seqlen,
                                             ev.windows or None, progress=job.progress)
    result: dict[str, Any] = {"model": str(lm.source), "block_sizes": list(job.blocks), "schemes": list(job.schemes),
                              "mode": "inputs" if job.inputs else "weights",
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


def _input_study(job: FormatsJob, lm: Any, tokens: Any) -> tuple[list[Any], float | None]:
    """The inputs mode: rows over every decoder Linear's calibration inputs (and W4A4 ppl)."""
    from lowbit.models import linear_layers
    from lowbit.studies import input_block_study, w4a4_ppl_fn

    layers = list(linear_layers(lm.model))
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
