"""One function per job — quantize, evaluate, formats study, qat, finetune, export, inspect.

Each job is a frozen dataclass describing the whole run plus a function that runs it:
it validates every input before heavy work (arguments when the job is built; paths,
devices and data before the model's first pass), holds a lock on its output, and
writes its result atomically. The command line only parses text into these jobs and
prints their summaries; scripts call them directly.
"""

from lowbit.api.common import Calibration, Evaluation
from lowbit.api.evaluate import EvalJob, evaluate
from lowbit.api.export import ExportJob, export
from lowbit.api.finetune import FinetuneJob, TrainingData, finetune
from lowbit.api.formats import FormatsJob, formats_study
from lowbit.api.inspect import inspect
from lowbit.api.qat import QatJob, qat
from lowbit.api.quantize import QuantizeJob, build_plan, quantize

__all__ = ["Calibration", "EvalJob", "Evaluation", "ExportJob", "FinetuneJob", "FormatsJob", "QatJob",
           "QuantizeJob", "TrainingData", "build_plan", "evaluate", "export", "finetune", "formats_study",
           "inspect", "qat", "quantize"]
