"""Studies: sweeps that people compare, as tables, JSON and PNG plots."""

from lowbit.studies.blocks import (
                                   DEFAULT_BLOCKS,
                                   DEFAULT_SCHEMES,
                                   StudyRow,
                                   block_size_study,
                                   model_block_study,
                                   verdicts,
                                   weight_error,
)
from lowbit.studies.inputs import DEFAULT_INPUT_SCHEMES, input_block_study, w4a4_ppl_fn
from lowbit.studies.plot import plot_study

__all__ = ["DEFAULT_BLOCKS", "DEFAULT_INPUT_SCHEMES", "DEFAULT_SCHEMES", "StudyRow", "block_size_study",
           "input_block_study", "model_block_study", "plot_study", "verdicts", "w4a4_ppl_fn", "weight_error"]
