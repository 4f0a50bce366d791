"""Evaluation: perplexity and zero-shot tasks."""

from lowbit.eval.perplexity import PplResult, eval_windows, perplexity
from lowbit.eval.tasks import zero_shot

evaluate = perplexity

__all__ = ["PplResult", "eval_windows", "evaluate", "perplexity", "zero_shot"]
