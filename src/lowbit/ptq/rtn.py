"""Round-to-nearest PTQ, optionally with the importance-weighted scale search.

Plain RTN needs no data. With ``search=True`` every layer's scales are chosen by the
grid search of formats.md, weighting each input column by the summed squared
calibration activations that feed it ("optimized RTN"); that is also SignRoundV2's
initialisation, which is why it lives in the shared PTQ layer.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from lowbit.formats.plan import Plan
from lowbit.nn import replace_linears


def searched(plan: Plan) -> Plan:
    """The same plan with every scheme switched to the ``search`` scale rule.

    4-over-6 already picks its scales by error, so those schemes keep their rule.
    """
    return Plan({n: s if s.rule == "4over6" else s.replace(rule="search") for n, s in plan.items()})


def rtn_quantize(model: nn.Module, plan: Plan, calib: torch.Tensor | None = None, search: bool = False,
                 imp: Mapping[str, torch.Tensor] | None = None, progress: bool = True) -> Plan:
    """Quantize ``model`` in place; returns the plan actually applied."""
    if search:
        plan = searched(plan)
        if imp is None and calib is not None:
            from lowbit.ptq.importance import collect_importance

            imp = collect_importance(model, calib, list(plan))
    replace_linears(model, plan, imp=imp, progress=progress)
    return plan
