"""Zero-shot tasks through lm-eval's HFLM wrapper (optional dependency)."""

from __future__ import annotations

from typing import Any

from lowbit.errors import LowbitError


def zero_shot(model: Any, tokenizer: Any, tasks: list[str], limit: int | None = None,
              batch_size: int = 8) -> dict:
    """Accuracy-style metrics per task; task data must already be available locally."""
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
    except ModuleNotFoundError:
        raise LowbitError("zero-shot tasks need lm-eval: pip install 'lowbit[eval]'") from None
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    try:
        out = lm_eval.simple_evaluate(model=lm, tasks=tasks, limit=limit)
    except Exception as e:  # lm-eval raises many types for missing/offline task data
        raise LowbitError(f"lm-eval could not run {tasks}: {str(e).splitlines()[0] if str(e) else e!r}; "
                          "task data must be available offline (HF datasets cache)") from None
    return {task: {k: v for k, v in res.items() if isinstance(v, (int, float))}
            for task, res in out["results"].items()}
