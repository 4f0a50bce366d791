"""FP4 formats benchmark: lowbit vs fouroversix, scale rules, and the block-size study.

Measured in one run, on one CPU thread (torch.set_num_threads(1)), medians of --repeats
runs for timings:

1. A synthetic heavy-tailed tensor (Student-t, 3 dof, 4096x4096, seed 0) and the bundled
   model's quantized Linear weights: relative MSE and seconds of quantize+dequantize for
   plain NVFP4 and 4-over-6, lowbit vs ``fouroversix`` (its PyTorch CPU path), and a plain
   tensor copy of the same data as the memory-bound reference.
2. Scale rules at block 8 on the bundled model: abs-max, 4-over-6, span, brute force.
3. The block-size study (8, 16, 32, 64) on the bundled model, optionally with perplexity.
4. ``offgrid``: NVFP4 4-over-6 element by element, lowbit vs fouroversix, on the off-grid
   copy's Linear weights (each its own tensor scale) and on their inputs (a forward over
   calibration tokens, each input's own abs-max as its tensor scale, fouroversix's
   convention), plus lowbit's weight error with each fused q/k/v or gate/up group's shared
   tensor scale (what vLLM keeps) against each weight's own.

Results go to benchmarks/results/formats.json (written atomically after every part, so a
partial run keeps what it finished; parts not run keep their earlier results) and a table
on stdout. The ``tensor`` and ``model`` parts compare against fouroversix and need it
installed (``make bench-setup``); ``study`` and ``rules`` are lowbit alone.

    python -m benchmarks.formats [--parts study,tensor,model,rules]
    python -m benchmarks.formats --parts study,rules --layer-stride 30 --blocks 8,16 \
        --schemes nvfp4,nvfp4-46 --out /tmp/formats_smoke.json                       # smoke
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import load_results, machine, out_path, require_peer, save_results, timed
from lowbit.formats import qdq, relative_error

PARTS = ("study", "tensor", "model", "rules", "offgrid")
PEER_PARTS = ("tensor", "model", "offgrid")  # the parts that compare against fouroversix


def timed_result(fn, repeats: int):
    """(median seconds, last result) of ``fn()`` over ``repeats`` runs, none untimed."""
    last = {}

    def run() -> None:
        last["out"] = fn()

    seconds, _ = timed(run, repeats, warmup=0)
    return seconds, last["out"]


def fouroversix_qdq(rule: str):
    """fouroversix quantize + dequantize (PyTorch backend = its CPU path), or None if absent."""
    try:
        from fouroversix.quantize.config import QuantizationConfig
        from fouroversix.quantize.frontend import dequantize, quantize_to_fp4
    except ImportError:
        return None
    cfg = QuantizationConfig(scale_rule=rule, backend="pytorch")
    return lambda w: dequantize(quantize_to_fp4(w, cfg), torch.float32)


def compare(weights: list[torch.Tensor], repeats: int, fos_repeats: int | None = None) -> dict:
    """lowbit vs fouroversix on a list of tensors (errors pooled, times summed)."""
    out = {}
    den = sum(float((w.double() ** 2).sum()) for w in weights)
    t_copy, _ = timed_result(lambda: [w.clone() for w in weights], max(repeats, 3))
    out["copy_seconds"] = t_copy
    for ours, theirs in (("nvfp4", "static_6"), ("nvfp4-46", "mse")):
        for who, fn in (("lowbit", lambda w, s=ours: qdq(w, s)), ("fouroversix", fouroversix_qdq(theirs))):
            if fn is None:
                continue
            n = repeats if who == "lowbit" or fos_repeats is None else fos_repeats
            secs, outs = timed_result(lambda fn=fn: [fn(w) for w in weights], n)
            num = sum(float(((o.double() - w.double()) ** 2).sum()) for o, w in zip(outs, weights, strict=True))
            out[f"{who}/{ours}"] = {"rel_mse": num / den, "seconds": secs, "x_copy": secs / t_copy}
    for ours in ("nvfp4", "nvfp4-46"):
        a, b = out.get(f"lowbit/{ours}"), out.get(f"fouroversix/{ours}")
        if a and b:
            out[f"{ours}_rel_mse_diff"] = abs(a["rel_mse"] - b["rel_mse"]) / b["rel_mse"]
            out[f"{ours}_speedup_vs_fouroversix"] = b["seconds"] / a["seconds"]
    return out


def student_t() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.distributions.StudentT(3.0).sample((4096, 4096))


def model_weights(stride: int = 1) -> dict[str, torch.Tensor]:
    """The bundled model's quantized Linear weights; ``stride`` > 1 keeps every stride-th layer."""
    from lowbit.models import linear_layers, load_model

    model = load_model().model
    items = list(linear_layers(model).items())[::stride]
    return {n: m.weight.detach().clone() for n, m in items}


def per_tensor_check(weights: dict[str, torch.Tensor]) -> dict:
    """On every tensor: |lowbit - fouroversix| for plain NVFP4 and lowbit 4-over-6 <= fouroversix's."""
    f6, f46 = fouroversix_qdq("static_6"), fouroversix_qdq("mse")
    if f6 is None:
        return {"skipped": "fouroversix not installed"}
    worst_diff, violations = 0.0, []
    for n, w in weights.items():
        e6 = relative_error(w, qdq(w, "nvfp4")), relative_error(w, f6(w))
        e46 = relative_error(w, qdq(w, "nvfp4-46")), relative_error(w, f46(w))
        worst_diff = max(worst_diff, abs(e6[0] - e6[1]) / e6[1])
        if e46[0] > e46[1] * (1 + 1e-9):
            violations.append(n)
    return {"tensors": len(weights), "nvfp4_worst_rel_mse_diff": worst_diff,
            "4over6_worse_than_fouroversix": violations}


def rules_table(weights: dict[str, torch.Tensor], block: int = 8) -> dict:
    from lowbit.formats import Scheme
    from lowbit.studies import weight_error

    out = {}
    for name in ("nvfp4", "nvfp4-46:rule=absmax", "nvfp4-46", "nvfp4-46:rule=span", "nvfp4-46:rule=brute"):
        s = Scheme.parse(name).replace(group_size=block)
        t0 = time.perf_counter()
        err = weight_error(weights, s)
        out[s.name] = {"rel_mse": err, "seconds": time.perf_counter() - t0}
        print(f"  rules  {s.name:<32} {err:.6f}  {out[s.name]['seconds']:.1f}s", flush=True)
    return out


def study(weights, schemes, blocks, ppl_windows: int) -> dict:
    from lowbit.studies import block_size_study, verdicts

    ppl_fn = fp = None
    if ppl_windows:
        from lowbit.data import eval_tokens
        from lowbit.eval import perplexity
        from lowbit.models import linear_layers, load_model

        loaded = load_model()
        layers = linear_layers(loaded.model)
        tokens = eval_tokens(loaded.tokenizer)

        def ppl_fn(s):
            for n, m in layers.items():
                m.weight.data.copy_(qdq(weights[n], s))
            return perplexity(loaded.model, tokens, 512, ppl_windows, progress=False).ppl

        fp = perplexity(loaded.model, tokens, 512, ppl_windows, progress=False).ppl
    rows = block_size_study(weights, schemes, blocks, ppl_fn, progress=False)
    res = {"rows": [r.to_dict() for r in rows], "fp_ppl": fp, "verdict_error": verdicts(rows)}
    if ppl_windows:
        res["verdict_ppl"] = verdicts(rows, "ppl")
    return res


def print_compare(name: str, r: dict) -> None:
    print(f"\n{name}: copy {r['copy_seconds']:.3f}s")
    print(f"{'impl/scheme':<24} {'rel MSE':>12} {'seconds':>9} {'x copy':>8}")
    for k, v in r.items():
        if isinstance(v, dict):
            print(f"{k:<24} {v['rel_mse']:>12.7f} {v['seconds']:>9.2f} {v['x_copy']:>8.1f}")


def agreement(ours: torch.Tensor, theirs: torch.Tensor, x: torch.Tensor, block: int = 16) -> dict:
    """Relative squared errors of two quantize-dequantize results of ``x``, and the share of elements
    (and of blocks) where they differ by more than float rounding (1e-5 relative)."""
    differ = (ours - theirs).abs() > 1e-5 * theirs.abs()
    return {"rel_mse_lowbit": relative_error(x, ours), "rel_mse_fouroversix": relative_error(x, theirs),
            "elements_differing": float(differ.float().mean()),
            "blocks_differing": float(differ.reshape(x.shape[0], -1, block).any(-1).float().mean())}


def offgrid_agreement(stride: int, samples: int = 2, seqlen: int = 256) -> dict:
    """NVFP4 4-over-6 on the off-grid copy, lowbit vs fouroversix, weights and inputs (module doc, part 4)."""
    from benchmarks.common import offgrid_folder
    from lowbit.data import calibration_batches
    from lowbit.formats import Scheme, quantize
    from lowbit.formats.inputs import InputScheme, qdq_input
    from lowbit.models import linear_layers, load_model
    from lowbit.models.fused import shared_tensor_scales

    lm = load_model(str(offgrid_folder()))
    layers = dict(list(linear_layers(lm.model).items())[::stride])
    inputs: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_pre_hook(lambda _m, a, n=n: inputs.__setitem__(n, a[0].detach()))
             for n, m in layers.items()]
    with torch.no_grad():
        lm.model(calibration_batches(lm.tokenizer, None, nsamples=samples, seqlen=seqlen, seed=0))
    for h in hooks:
        h.remove()
    fos, ws, ins = fouroversix_qdq("mse"), Scheme.parse("nvfp4-46"), InputScheme.base("nvfp4-46")
    weights = {n: m.weight.detach().float() for n, m in linear_layers(lm.model).items()}
    shared = shared_tensor_scales(weights, {n: ws for n in weights})
    rows = {}
    for n in layers:
        w, x = weights[n], inputs[n].reshape(-1, inputs[n].shape[-1]).float()
        sh = quantize(w, ws, tensor_scale=shared[n]).dequantize().float()
        rows[n] = {"weight": agreement(quantize(w, ws).dequantize().float(), fos(w), w),
                   "weight_rel_mse_shared_tensor_scale": relative_error(w, sh),
                   "input": agreement(qdq_input(x, ins, x.abs().max()), fos(x), x),
                   "input_amax": float(x.abs().max())}
        print(n, rows[n], flush=True)
    worst = {f"{part}_elements_differing": max(r[part]["elements_differing"] for r in rows.values())
             for part in ("weight", "input")}
    worst["weight_rel_mse_own"] = max(r["weight"]["rel_mse_lowbit"] for r in rows.values())
    worst["weight_rel_mse_shared_tensor_scale"] = max(r["weight_rel_mse_shared_tensor_scale"] for r in rows.values())
    return {"layer_stride": stride, "tokens": samples * seqlen, "layers": rows, "worst": worst}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.formats", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from {', '.join(PARTS)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--schemes", default="nvfp4,nvfp4:guard=1,nvfp4-46,nvfp4-46:rule=span,nvfp4-ue5m3")
    p.add_argument("--blocks", default="8,16,32,64")
    p.add_argument("--layer-stride", type=int, default=1,
                   help="use every N-th Linear of the bundled model (offgrid part: of its off-grid copy; 1 = all; "
                        "the CPU budget may need more)")
    p.add_argument("--fos-repeats", type=int, default=None, help="repeats for fouroversix (default --repeats)")
    p.add_argument("--ppl-windows", type=int, default=0, help="perplexity windows per study point (0 = none)")
    p.add_argument("--out", default=None, help="results file (default benchmarks/results/formats.json)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    parts = args.parts.split(",")
    if any(x not in PARTS for x in parts):
        raise SystemExit(f"error: --parts takes a comma-separated subset of {', '.join(PARTS)}; got {args.parts!r}")
    if set(PEER_PARTS) & set(parts):
        require_peer("fouroversix", "pass --parts study,rules (lowbit alone)")
    out = out_path(args.out, "formats.json")

    def save(results: dict) -> None:
        save_results(out, results)

    torch.set_num_threads(1)
    results = load_results(out, empty={})
    results["threads"] = 1
    results["machine"] = machine()
    weights = model_weights(args.layer_stride) if {"model", "rules", "study"} & set(parts) else None
    if weights is not None:
        results["model_weights"] = {"layer_stride": args.layer_stride, "tensors": len(weights),
                                    "params": sum(w.numel() for w in weights.values())}
    if "study" in parts:
        from lowbit.cli.formats import parse_schemes, print_table
        from lowbit.studies import StudyRow

        res = study(weights, parse_schemes(args.schemes), [int(b) for b in args.blocks.split(",")],
                    args.ppl_windows)
        results["study"] = res
        save(results)
        print_table([StudyRow(**r) for r in res["rows"]], res["fp_ppl"], file=None)
    if "tensor" in parts:
        results["student_t_4096"] = compare([student_t()], args.repeats, args.fos_repeats)
        print_compare("Student-t 3 dof 4096x4096", results["student_t_4096"])
        save(results)
    if "model" in parts:
        results["bundled_model_per_tensor"] = per_tensor_check(weights)
        print(results["bundled_model_per_tensor"], flush=True)
        save(results)
    if "rules" in parts:
        results["rules_block8"] = rules_table(weights)
        save(results)
    if "offgrid" in parts:
        results["offgrid_nvfp4_46_agreement"] = offgrid_agreement(args.layer_stride)
        save(results)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
