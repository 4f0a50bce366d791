"""Static per-tensor FP8 KV scales chosen by what the attention does with the error, allowing clipping (issue 36).

vLLM serves one FP8 scale per layer for the keys and one for the values (``k_scale`` /
``v_scale``, the ``amax / 448`` family). This script tries the rule: candidates
``c * amax / 448`` with ``c = 2^(j/32)``, j = -32..0 (0.5x to 1x: the smaller ones clip the
rarest largest keys, as llm-compressor's first-row abs-max does by accident), and per layer the
candidate whose error, summed over the calibration rows (never the evaluation split), is least:

* keys: the softmax-weighted variance of the score error of each query,
  ``sum_j p_ij ds_ij^2 - (sum_j p_ij ds_ij)^2`` with ``ds_ij = q_i . (Q(k_j) - k_j) * scaling``
  (queries: every 4th of each row; twice the KL divergence between the float and the quantized attention, to second order: an
  error common to every key of one query costs nothing, an error on a key the query barely
  reads costs little);
* values: the squared error of the attention's mixing of them, ``|sum_j p_ij (Q(v_j) - v_j)|^2``.

Queries are taken at the attention function (transformers' ``ALL_ATTENTION_FUNCTIONS``
entry the model uses, wrapped for the calibration pass), post-RoPE as the cache sees keys.
Then the float model is evaluated with those scales in lowbit's FP8 cache, on
`benchmarks.kv`'s windows; the row lands in ``kv.json`` as ``fp8-kl`` with its calibration
seed and the chosen factors::

    python -m benchmarks.kv_scales --seqlen 2048 --windows 3 --nsamples 8 --seed 1
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from benchmarks import common
from benchmarks.kv import row_key
from benchmarks.kv_peers import fp8_scales_row, protocol_args

STEPS = 32  # candidates per octave below the abs-max scale
QUERY_STRIDE = 4  # every 4th query of each row counts (each sees all its keys): a quarter of the work


def factors() -> Any:
    import torch

    return 2 ** (torch.arange(-STEPS, 1, dtype=torch.float32) / STEPS)


def candidate_errors(q: Any, k: Any, v: Any, k_scale: Any, v_scale: Any, scaling: float) -> tuple[Any, Any]:
    """Per candidate factor: the keys' softmax-weighted score-error variance and the values' mixed error, summed
    over this batch's queries and heads (``q [b, hq, t, d]``, ``k`` / ``v [b, hkv, t, d]``, causal)."""
    import torch

    from lowbit.formats.kv import KVScheme, qdq_kv

    scheme = KVScheme.parse("fp8:scale=amax")
    k, v = k.float(), v.float()
    g = q.shape[1] // k.shape[1]
    t = q.shape[2]
    mask = torch.ones(t, t, dtype=torch.bool).tril()[::QUERY_STRIDE]
    q = q.float()[:, :, ::QUERY_STRIDE]
    s = (q @ k.repeat_interleave(g, 1).transpose(-1, -2)) * scaling
    p = s.masked_fill(~mask, float("-inf")).softmax(-1)
    ek, ev = [], []
    for f in factors():
        dk = (qdq_kv(k, scheme, k_scale * f) - k).repeat_interleave(g, 1)
        ds = (q @ dk.transpose(-1, -2)) * scaling
        m1, m2 = (p * ds).sum(-1), (p * ds * ds).sum(-1)
        ek.append(float((m2 - m1 * m1).sum()))
        dv = (qdq_kv(v, scheme, v_scale * f) - v).repeat_interleave(g, 1)
        ev.append(float((p @ dv).pow(2).sum()))
    return torch.tensor(ek, dtype=torch.float64), torch.tensor(ev, dtype=torch.float64)


def captured(model: Any, amax_scales: dict[Any, tuple[Any, Any]], errors: dict[Any, list]) -> Any:
    """The model's attention function wrapped: at each call, the candidates' errors added to ``errors[module]``."""
    from benchmarks.kv_layers import captured as attention_hook

    def record(module: Any, query: Any, key: Any, value: Any, scaling: float) -> None:
        ks, vs = amax_scales[module]
        ek, ev = candidate_errors(query, key, value, ks, vs, scaling)
        prev = errors.get(module)
        errors[module] = [ek, ev] if prev is None else [prev[0] + ek, prev[1] + ev]

    return attention_hook(model, record)


def kl_scales(model: Any, calib: Any) -> tuple[dict[str, tuple[float, float]], dict[str, tuple[float, float]]]:
    """Attention name -> (k_scale, v_scale) chosen by the errors above, and -> the chosen factors of amax / 448."""
    import torch

    from lowbit.formats.kv import KVScheme
    from lowbit.nn.kv_quant import calibrate_kv, remove_kv

    attns = calibrate_kv(model, calib, KVScheme.parse("fp8:scale=amax"))
    amax = {a: (a.k_scale.clone(), a.v_scale.clone()) for a in attns.values()}
    remove_kv(model)
    errors: dict[Any, list] = {}
    with captured(model, amax, errors), torch.no_grad():
        for batch in calib.split(4):
            model(input_ids=batch, use_cache=False)
    f = factors()
    scales, chosen = {}, {}
    for name, a in attns.items():
        ek, ev = errors[a]
        fk, fv = float(f[int(ek.argmin())]), float(f[int(ev.argmin())])
        scales[name] = (float(amax[a][0]) * fk, float(amax[a][1]) * fv)
        chosen[name] = (fk, fv)
    return scales, chosen


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kv_scales", description=__doc__.split("\n")[0])
    protocol_args(p, "where the calibration samples start")
    args = p.parse_args(argv)
    lm = common.bundled_model(args.threads, model=args.model)
    calib = common.calibration(lm.tokenizer, args.nsamples, args.calib_seqlen, seed=args.seed)
    t0 = time.perf_counter()
    scales, chosen = kl_scales(lm.model, calib)
    took = round(time.perf_counter() - t0, 1)
    print("factor of amax/448 per layer (k, v): " + " ".join(f"{k:.3f},{v:.3f}" for k, v in chosen.values()),
          flush=True)
    row = fp8_scales_row(lm, scales, args, "fp8-kl", "the KL rule")
    row |= {"calibrate_s": took, "factors": chosen,
            "scales_from": "c * amax/448, c = 2^(j/32), j = -32..0, per layer: keys by the softmax-weighted variance "
                           "of the score error, values by the attention-mixed error (benchmarks/kv_scales.py)"}
    common.merge_row(args.out, row, row_key)
    print(f"float fp8-kl (calib seed {args.seed}) ppl {row['ppl']:.4f} [{row['eval_s']:.0f} s]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
