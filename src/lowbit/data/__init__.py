"""Text sources to token batches, with a deterministic calibration / evaluation split."""

from lowbit.data.batches import (
                                 calibration_batches,
                                 eval_tokens,
                                 tokenize_split,
                                 training_batches,
                                 training_windows,
)
from lowbit.data.sources import load_corpus, load_documents, split_documents, split_texts

__all__ = ["calibration_batches", "eval_tokens", "load_corpus", "load_documents", "split_documents", "split_texts",
           "tokenize_split", "training_batches", "training_windows"]
