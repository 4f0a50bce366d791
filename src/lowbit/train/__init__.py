"""One training loop for QAT and adapter training (PEFT).

The loop knows nothing about which method trains: methods plug in through the
``trainable`` selection, a ``loss_fn`` and callbacks (step events), which is how WinQ's
re-initialisation and noise and an adapter's bookkeeping attach without forking it.
"""

from lowbit.train.callbacks import Callback, TrainState
from lowbit.train.config import TrainConfig
from lowbit.train.curvature import TopEigen, top_hessian_eigenvalue
from lowbit.train.loop import TrainResult, causal_lm_loss, check_resume, kd_loss, train
from lowbit.train.metrics import smooth, speedup, steps_to_reach

__all__ = ["Callback", "TopEigen", "TrainConfig", "TrainResult", "TrainState", "causal_lm_loss", "check_resume",
           "kd_loss", "smooth", "speedup", "steps_to_reach", "top_hessian_eigenvalue", "train"]
