"""Per layer: what per-tensor FP8 KV scales do to each attention on an evaluation window (issue 36).

A diagnostic of the scale rules behind ``kv.json``'s FP8 rows: the float model runs one evaluation
window (``--seqlen`` tokens, window ``--window`` of the split `benchmarks.kv` evaluates); at every
attention the post-RoPE keys, values and queries are taken (transformers' attention function the model
uses, wrapped), and for each scales file (`benchmarks.kv_peers`'s format: llm-compressor's, or a
``kv.json`` row's through `benchmarks.kv_scalefile`) it measures, keys and values quantized one at a time:

* ``k_err``: the softmax-weighted variance of each query's score error, summed over queries and heads
  (twice the KL divergence of the attention distribution to second order; every ``--query-stride``-th
  query, all the keys before it): an error common to all keys of a query costs nothing;
* ``v_err``: the squared error of the attention's mixture of the values, ``|sum_j p_ij (Q(v_j) - v_j)|^2``;
* ``k_clip`` / ``v_clip``: the fraction of elements beyond 448 scales, and ``k_top`` / ``v_top`` the largest
  ``|x| / (448 s)`` (above 1: clipped);

and the same errors along a grid of factors ``2^(j/16)`` times the first file's scales (``curves``: how
much any per-tensor scale of that layer could change them, on the evaluation window itself: an oracle,
not a rule). Writes ``kv_layers.json``::

    python -m benchmarks.kv_layers --scales fp8=rowmax_s0.json llmc=llmc_s0.json --seqlen 8192 --threads 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks import common

GRID = tuple(range(-16, 9))  # factors 2^(j/16) of the first file's scales: half to 1.41x


def attention_errors(q: Any, k: Any, v: Any, scaling: float, stride: int,
                     scales: list[tuple[float, float]]) -> list[dict[str, float]]:
    """For each (k_scale, v_scale): the errors of the module docstring on one attention's ``q [1, hq, t, d]``,
    ``k`` / ``v [1, hkv, t, d]`` (causal)."""
    import torch

    from lowbit.formats.kv import KVScheme, qdq_kv

    scheme = KVScheme.parse("fp8:scale=amax")
    q, k, v = q.float()[0], k.float()[0], v.float()[0]
    hkv, t = k.shape[0], k.shape[1]
    g = q.shape[0] // hkv
    rows = torch.arange(stride - 1, t, stride)
    mask = torch.arange(t).reshape(1, -1) <= rows.reshape(-1, 1)  # [nq, t]
    probs = []
    for h in range(hkv):
        qh = q[h * g:(h + 1) * g, rows]  # [g, nq, d]
        s = (qh @ k[h].T) * scaling
        probs.append((qh, s.masked_fill(~mask, float("-inf")).softmax(-1)))
    out = []
    for ks, vs in scales:
        kst, vst = torch.tensor([ks]), torch.tensor([vs])
        dk = qdq_kv(k.unsqueeze(0), scheme, kst)[0] - k
        dv = qdq_kv(v.unsqueeze(0), scheme, vst)[0] - v
        ek = ev = 0.0
        for h, (qh, p) in enumerate(probs):
            ds = (qh @ dk[h].T) * scaling
            m1 = (p * ds).sum(-1)
            ek += float(((p * ds * ds).sum(-1) - m1 * m1).sum())
            ev += float((p @ dv[h]).pow(2).sum())
        out.append({"k_err": ek, "v_err": ev,
                    "k_clip": float((k.abs() > 448 * ks).float().mean()), "v_clip": float((v.abs() > 448 * vs).float().mean()),
                    "k_top": float(k.abs().max() / (448 * ks)), "v_top": float(v.abs().max() / (448 * vs))})
    return out


@contextlib.contextmanager
def captured(model: Any, fn: Any) -> Iterator[None]:
    """The model's attention function wrapped: ``fn(module, query, key, value, scaling)`` at each call."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = model.config._attn_implementation
    inner = ALL_ATTENTION_FUNCTIONS[impl]

    def wrapper(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
        fn(module, query, key, value, kwargs.get("scaling") or module.scaling)
        return inner(module, query, key, value, attention_mask, **kwargs)

    ALL_ATTENTION_FUNCTIONS[impl] = wrapper
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS[impl] = inner


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from lowbit.data import eval_tokens
    from lowbit.eval.perplexity import eval_windows
    from lowbit.nn.kv_quant import attention_modules

    files = dict(s.split("=", 1) for s in args.scales)
    sets = {label: json.loads(Path(f).read_text())["scales"] for label, f in files.items()}
    lm = common.bundled_model(args.threads, model=args.model)
    names = {m: n for n, m in attention_modules(lm.model).items()}
    window = eval_windows(eval_tokens(lm.tokenizer), args.seqlen, args.window + 1)[args.window:args.window + 1]
    first = next(iter(sets))
    grid = [2 ** (j / 16) for j in GRID]
    layers: dict[str, Any] = {}

    def measure(module: Any, query: Any, key: Any, value: Any, scaling: float) -> None:
        name = names[module]
        pairs = [tuple(sets[label][name]) for label in sets]
        k0, v0 = sets[first][name]
        errs = attention_errors(query, key, value, scaling, args.query_stride, pairs)
        curve = attention_errors(query, key, value, scaling, args.query_stride, [(k0 * f, v0 * f) for f in grid])
        layers[name] = {"sets": dict(zip(sets, errs, strict=True)),
                        "curves": {"factor": grid, "k_err": [c["k_err"] for c in curve],
                                   "v_err": [c["v_err"] for c in curve]}}

    t0 = time.perf_counter()
    with captured(lm.model, measure), torch.no_grad():
        lm.model(input_ids=window, use_cache=False)
    return {"model": args.model, "seqlen": args.seqlen, "window": args.window, "query_stride": args.query_stride,
            "files": files, "grid_of": first, "took_s": round(time.perf_counter() - t0, 1),
            "machine": common.machine(), "layers": layers}


def summary(data: dict[str, Any]) -> str:
    labels = list(data["files"])
    order = sorted(data["layers"], key=lambda n: int("".join(c for c in n if c.isdigit()) or 0))
    lines = [" ".join(f"{x:>10}" for x in ["layer", *(f"k:{lb}" for lb in labels), *(f"v:{lb}" for lb in labels)])]
    for n in order:
        s = data["layers"][n]["sets"]
        lines.append(" ".join([f"{n.split('.')[2]:>10}", *(f"{s[lb]['k_err']:10.4g}" for lb in labels),
                               *(f"{s[lb]['v_err']:10.4g}" for lb in labels)]))
    tot = {lb: [sum(data["layers"][n]["sets"][lb][e] for n in order) for e in ("k_err", "v_err")] for lb in labels}
    lines.append(" ".join([f"{'sum':>10}", *(f"{tot[lb][0]:10.4g}" for lb in labels),
                           *(f"{tot[lb][1]:10.4g}" for lb in labels)]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kv_layers", description=__doc__.split("\n")[0])
    p.add_argument("--scales", nargs="+", required=True, metavar="LABEL=JSON", help="scales files to compare")
    p.add_argument("--model", default="bundled", choices=common.MODELS)
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--window", type=int, default=0, help="which evaluation window")
    p.add_argument("--query-stride", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="kv_layers.json")
    args = p.parse_args(argv)
    if any("=" not in s for s in args.scales):
        raise SystemExit("error: --scales takes LABEL=JSON items")
    data = run(args)
    common.save_results(args.out, data)
    print(summary(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
