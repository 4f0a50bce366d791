"""The eval job: perplexity of any model or checkpoint, and optionally lm-eval tasks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from lowbit.api.common import Evaluation, job_device
from lowbit.configs import check_fields
from lowbit.errors import ConfigError


@dataclass(frozen=True)
class EvalJob:
    """model: any source `load_model` accepts. tasks: lm-eval task names, YAML files or task folders.

    trust_task_code: let task files run Python (lm-eval's ``!function``, unsandboxed
    templates); without it such a task file is refused before the model loads.
    """

    model: str | None = None
    evaluation: Evaluation = field(default_factory=Evaluation)
    tasks: tuple[str, ...] = ()
    limit: int | None = None
    device: str | None = None
    progress: bool = True
    trust_task_code: bool = False

    def __post_init__(self) -> None:
        check_fields(self, ConfigError, "eval setting")
        object.__setattr__(self, "tasks", tuple(self.tasks))
        if self.limit is not None and not self.tasks:
            raise ConfigError("--limit applies to zero-shot tasks; pass --tasks too (or drop --limit)")
        if self.trust_task_code and not self.tasks:
            raise ConfigError("--trust-task-code applies to zero-shot task files; pass --tasks too (or drop it)")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"--limit must be a positive number of examples per task, got {self.limit}")


def evaluate(job: EvalJob) -> dict[str, Any]:
    from lowbit.models import load_model
    from lowbit.models.placement import on_device
    from lowbit.nn.kv_quant import kv_schemes

    t0 = time.perf_counter()
    device = job_device(job.device)
    if job.tasks:  # task files are checked (syntax, code) before the model loads
        from lowbit.eval.tasks import parse_tasks

        parse_tasks(list(job.tasks), job.trust_task_code)
    lm = load_model(job.model)
    tokens = job.evaluation.tokens(lm.tokenizer)
    with on_device(lm.model, device):
        r = job.evaluation.perplexity(lm.model, tokens, job.progress)
        result: dict[str, Any] = {"model": lm.source, "ppl": r.ppl, "tokens": r.tokens, "windows": r.windows}
        names = [s.name for s in kv_schemes(lm.model).values()]
        if names:  # a checkpoint quantized with --kv: the perplexity was measured with its cache
            result["kv_cache"] = names[0] if len(set(names)) == 1 else {n: names.count(n) for n in dict.fromkeys(names)}
        if job.tasks:
            from lowbit.eval import zero_shot

            result["tasks"] = zero_shot(lm.model, lm.tokenizer, list(job.tasks), limit=job.limit,
                                        trust_code=job.trust_task_code)
    result["seconds"] = round(time.perf_counter() - t0, 2)
    return result
