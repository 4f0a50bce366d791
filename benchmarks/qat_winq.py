"""WinQ vs the STE baseline on the model organism: speed-up, eval ppl, ablations, sweep, curvature.

Issue 25. Every run starts from the same float model (the organism of
`benchmarks/organism.py`, or the bundled model with ``--plan bundled``), converts the
decoder Linears to QAT layers of one scheme (w2 = 2-bit stretched elastic, ternary, w1 =
sign) and trains ``--steps`` steps on the training split (lowbit's loop: AdamW, warm-up
+ cosine, the same data order for every variant of one seed). Variants:

- ``ste``: the baseline (no re-init, no noise: the ParetoQ recipe);
- ``winq``: lowbit's defaults (re-init every K = steps/4 with a = 0.2, noise 1e-3 absolute);
- ``reinit`` / ``noise``: one of the two mechanisms alone;
- sweep (``--plan sweep``): a in {0.5, 0.8}; K = steps/8 (7 re-inits) and steps/2 (one);
  sigma absolute 1e-4 and 1e-2; sigma relative to each row's scale 0.01 and 0.05.

Per run: the loss curve, the eval loss every steps/8, the final eval perplexity of the
exact quantized model (128 windows of 128 tokens spread over the eval split), the share
of codes that changed, and (``--diag``, main plan) the curvature diagnostics:

- the top eigenvalue of the Hessian of the training loss w.r.t. the latent weights, as the
  optimizer sees it through the STE (``lowbit.train.curvature``: power iteration on
  Hessian-vector products; through the STE this is the Hessian w.r.t. the quantized weights
  at Q(W), restricted to the entries inside the clipping range), on one fixed batch, at
  steps K, 2K, 3K and T, and right after each re-init;
- with ``--float-curvature-seeds``: the same for the float loss at the latent weights
  (quantizer bypassed), the curvature of the point the latent weights sit at;
- the share of weights inside the clipping range, the mean distance of the latent weights
  to the nearest decision boundary (in grid steps), the codes a re-init flips, and the
  share of codes that flip in the steps/16 steps after each of K, 2K, 3K and before T.

Speed-up = steps STE needs to reach its own final smoothed training loss / steps the
variant needs (`lowbit.train.metrics.speedup`), smoothing windows 50 (primary, declared
before the runs) and 10. Rows are merged into ``benchmarks/results/qat_winq.json`` as they
finish; runs already there are skipped and an interrupted run resumes from its last
checkpoint in ``--workdir``, so the protocol is restartable at any point:

    nice -n 10 python -m benchmarks.qat_winq --plan main,sweep          # hours, in the background
    python -m benchmarks.qat_winq --report                              # tables, PNGs, lab-note tables
    nice -n 10 python -m benchmarks.qat_winq --plan bundled             # the short bundled-model protocol
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import load_results, machine, markdown_table, merge_row, result_path

NAME = "qat_winq"
KEY = ("model", "scheme", "variant", "seed", "steps", "lr")
ORGANISM = Path.home() / ".cache" / "lowbit" / "organism"
MAIN = ("ste", "winq", "reinit", "noise")
SWEEP = ("a0.5", "a0.8", "K/8", "K/2", "abs1e-4", "abs1e-2", "rel0.01", "rel0.05")
WINDOWS = (50, 10)  # speed-up smoothing windows; the first is the primary one


@dataclass(frozen=True)
class Spec:
    model: str  # "organism" or "bundled"
    scheme: str
    variant: str
    seed: int
    diag: bool

    @property
    def ident(self) -> str:
        return f"{self.model}-{self.scheme}-{self.variant.replace('/', 'div')}-s{self.seed}"


def winq_config(variant: str, steps: int, seed: int):
    """The WinQ switches of a variant name (module docstring)."""
    from lowbit.qat import STE, WinQConfig

    table = {
        "ste": None, "winq": {}, "reinit": {"noise": False}, "noise": {"reinit": False},
        "a0.5": {"a": 0.5}, "a0.8": {"a": 0.8}, "K/8": {"every": steps // 8}, "K/2": {"every": steps // 2},
        "abs1e-4": {"sigma_w": 1e-4, "sigma_a": 1e-4}, "abs1e-2": {"sigma_w": 1e-2, "sigma_a": 1e-2},
        "rel0.01": {"sigma_w": 0.01, "sigma_a": 0.01, "relative": True},
        "rel0.05": {"sigma_w": 0.05, "sigma_a": 0.05, "relative": True},
    }
    if variant not in table:
        raise SystemExit(f"unknown variant {variant!r}; choose from {sorted(table)}")
    kw = table[variant]
    return STE if kw is None else WinQConfig(seed=seed, **kw)


def plan(args) -> list[Spec]:
    """Runs in priority order, so a protocol cut short keeps the most useful rows: STE and WinQ over
    every seed; the ablations (re-init only, noise only) on the first seed; the sweep on the first
    sweep scheme; the ablations on the other seeds; the sweep on the other schemes; the bundled model."""
    schemes, seeds = args.schemes.split(","), [int(s) for s in args.seeds.split(",")]
    parts, variants = args.plan.split(","), args.variants.split(",")
    first = [v for v in variants if v in ("ste", "winq")]
    rest = [v for v in variants if v not in first]
    sweep_schemes = args.sweep_schemes.split(",")

    def main(seed_list, vs):
        return [Spec("organism", sc, v, s, args.diag) for s in seed_list for sc in schemes for v in vs]

    def sweep(scheme_list):
        return [Spec("organism", sc, v, 0, False) for sc in scheme_list for v in SWEEP]

    out: list[Spec] = []
    if "main" in parts:
        out += main(seeds, first) + main(seeds[:1], rest)
    if "sweep" in parts:
        out += sweep(sweep_schemes[:1])
    if "main" in parts:
        out += main(seeds[1:], rest)
    if "sweep" in parts:
        out += sweep(sweep_schemes[1:])
    if "bundled" in parts:
        out += [Spec("bundled", sc, v, s, False) for s in seeds[:1] for sc in schemes[:1] for v in variants[:2]]
    if args.only:
        out = [s for s in out if args.only in s.ident]
    return out


# ------------------------------------------------------------- diagnostics
class _Float:
    """Stands in for a QAT layer's quantizer: the forward uses the latent weights as they are."""

    learnable = True

    def fake(self, w, alpha):  # noqa: ANN001, ANN201
        return w


def set_attention(model, impl: str) -> None:
    """Switch the attention kernel (transformers >= 4.48 has a method; older ones read the config)."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(impl)
    else:
        model.config._attn_implementation = impl


def codes(model) -> dict:
    from lowbit.qat.convert import qat_layers

    return {n: layer.to_qtensor().codes.cpu().clone() for n, layer in qat_layers(model).items()}


def changed(before: dict, after: dict) -> float:
    total = sum(c.numel() for c in before.values())
    return sum((before[n] != after[n]).sum().item() for n in before) / total


def grid_stats(model) -> dict:
    """Share of latent weights inside the clipping range, and their mean distance to the nearest
    decision boundary in grid steps (0 = on a boundary; 0.5 = on a level for ternary / 2-bit)."""
    import torch

    from lowbit.qat.convert import qat_layers

    inside, margin, n = 0, 0.0, 0
    for layer in qat_layers(model).values():
        q = layer.quantizer
        x = (layer.weight.detach() / layer.alpha.detach()).float()
        if q.name == "sign":
            inside += (x.abs() <= 1).sum().item()
            margin += x.abs().clamp(max=1).sum().item()  # boundary at 0, level at 1 (in alpha)
        else:
            inside += (x.abs() <= 0.99).sum().item()
            t = x.clamp(-0.99, 0.99) * q.n - q.shift
            margin += (0.5 - (t - torch.round(t)).abs()).sum().item()
        n += x.numel()
    return {"in_range": inside / n, "boundary_margin": margin / n}


class Diagnostics:
    """Curvature, clipping and code-flip measurements at fixed steps of a run (module docstring).

    ``pre`` runs before the WinQ callback in the step's event, ``post`` after it, so a
    re-init step is seen on both sides. Records and code snapshots persist in the run's
    work folder, so a resumed run keeps what was measured before the interruption.
    """

    def __init__(self, steps: int, batch, work: Path, float_curvature: bool, iters: int) -> None:
        k = steps // 4
        self.points = [k, 2 * k, 3 * k, steps]
        self.delta = max(steps // 16, 1)
        self.snap_at = {k: k + self.delta for k in self.points[:3]} | {steps - self.delta: steps}
        self.batch, self.work, self.float_curvature, self.iters = batch, work, float_curvature, iters
        self.path = work / "diag.json"
        self.records: dict = json.loads(self.path.read_text()) if self.path.is_file() else {}
        self.snaps: dict = self._load_snaps()

    # -- persistence
    def _load_snaps(self) -> dict:
        from safetensors.torch import load_file

        out = {}
        for f in self.work.glob("codes-*.safetensors"):
            out[int(f.stem.split("-")[1])] = load_file(f)
        return out

    def _save(self) -> None:
        from lowbit.io import atomic_write_text

        self.work.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path, json.dumps(self.records, indent=1))

    def _snapshot(self, step: int, model) -> None:
        from safetensors.torch import save_file

        c = codes(model)
        self.snaps[step] = c
        self.work.mkdir(parents=True, exist_ok=True)
        tmp = self.work / f".codes-{step}.tmp"
        save_file({k: v.contiguous() for k, v in c.items()}, str(tmp))
        tmp.rename(self.work / f"codes-{step}.safetensors")

    # -- measurements
    def measure(self, model) -> dict:
        from lowbit.qat.convert import qat_layers
        from lowbit.train.curvature import top_hessian_eigenvalue
        from lowbit.train.loop import causal_lm_loss

        layers = qat_layers(model)
        params = [layer.weight for layer in layers.values()]
        was = model.training
        model.eval()  # noise off: the clean quantized forward
        impl = model.config._attn_implementation
        set_attention(model, "eager")  # SDPA has no double backward
        t0 = time.perf_counter()
        try:
            rec = {"loss": causal_lm_loss(model, self.batch).item(), **grid_stats(model)}
            top = top_hessian_eigenvalue(lambda: causal_lm_loss(model, self.batch), params, iters=self.iters)
            rec.update(lambda_ste=top.value, lambda_iters=top.iterations, lambda_converged=top.converged)
            if self.float_curvature:
                saved = {n: layer.quantizer for n, layer in layers.items()}
                for layer in layers.values():
                    layer.quantizer = _Float()
                try:
                    rec["loss_float_latent"] = causal_lm_loss(model, self.batch).item()
                    top = top_hessian_eigenvalue(lambda: causal_lm_loss(model, self.batch), params, iters=self.iters)
                    rec.update(lambda_float=top.value, lambda_float_converged=top.converged)
                finally:
                    for n, layer in layers.items():
                        layer.quantizer = saved[n]
        finally:
            set_attention(model, impl)
            model.zero_grad(set_to_none=True)
            model.train(was)
        rec["seconds"] = round(time.perf_counter() - t0, 1)
        return rec

    def on_pre(self, state) -> None:
        s = state.step
        if s in self.points:
            self.records[f"pre@{s}"] = self.measure(state.model)
        if s in self.snap_at.values():
            start = next(a for a, b in self.snap_at.items() if b == s)
            if start in self.snaps:
                self.records[f"flips@{start}-{s}"] = changed(self.snaps[start], codes(state.model))
        if s in self.snap_at:
            self._snapshot(s, state.model)
        if s in self.points or s in self.snap_at or s in self.snap_at.values():
            self._save()

    def on_post(self, state, reinits: list[int]) -> None:
        s = state.step
        if reinits and reinits[-1] == s:
            rec = self.measure(state.model)
            rec["codes_flipped_by_reinit"] = changed(self.snaps[s], codes(state.model)) if s in self.snaps else None
            self.records[f"post@{s}"] = rec
            self._save()


def diag_callbacks(diag: Diagnostics | None, winq_cb):
    from lowbit.train import Callback

    if diag is None:
        return [winq_cb]

    class Pre(Callback):
        def on_after_optimizer_step(self, state) -> None:
            diag.on_pre(state)

    class Post(Callback):
        def on_after_optimizer_step(self, state) -> None:
            diag.on_post(state, winq_cb.reinits)

    return [Pre(), winq_cb, Post()]


# -------------------------------------------------------------------- runs
@dataclass
class Context:
    base: object
    rows: object
    eval_windows: object
    loss_windows: object
    diag_batch: object
    ppl_fp: float


def load_context(model: str, args) -> Context:
    import torch

    from benchmarks.organism import loss_of, spread_windows
    from lowbit.data import eval_tokens
    from lowbit.data.batches import training_windows
    from lowbit.eval import perplexity
    from lowbit.models import load_model

    src, data = (None, None) if model == "bundled" else (str(Path(args.organism) / "model"), args.data)
    seqlen = args.bundled_seqlen if model == "bundled" else args.seqlen
    windows = args.bundled_eval_windows if model == "bundled" else args.eval_windows
    lm = load_model(src)
    cached = None if model == "bundled" else cached_tokens(Path(args.organism), data)
    if cached is None:
        rows = training_windows(lm.tokenizer, data, seqlen, "calib")
        ev = eval_tokens(lm.tokenizer, data)
    else:
        train_ids, ev = cached
        n = train_ids.shape[1] // seqlen
        rows = train_ids[0, : n * seqlen].reshape(n, seqlen)
    ev_win = spread_windows(ev, args.eval_seqlen, windows)
    loss_win = spread_windows(ev, seqlen, args.eval_loss_windows)
    g = torch.Generator().manual_seed(1234)
    diag_batch = rows[torch.randperm(len(rows), generator=g)[: args.diag_batch]]
    device = args.device
    lm.model.to(device)
    ppl_fp = perplexity(lm.model, ev_win.reshape(1, -1).to(device), seqlen=args.eval_seqlen, windows=None,
                        progress=False).ppl
    print(json.dumps({"model": model, "train_windows": len(rows), "ppl_fp": ppl_fp,
                      "fp_eval_loss": loss_of(lm.model, loss_win.to(device))}), flush=True)
    return Context(lm.model, rows, ev_win, loss_win.to(device), diag_batch.to(device), ppl_fp)


def cached_tokens(organism: Path, data: str):
    """The organism's saved token ids ([1, T] train, eval) if they were made from this corpus and tokenizer
    (`benchmarks.organism.save_tokens`), else None: the corpus is then tokenized again (minutes)."""
    from benchmarks.organism import load_tokens

    return load_tokens(organism, Path(data))


def steps_for(spec: Spec, args) -> int:
    return args.bundled_steps if spec.model == "bundled" else args.steps


def lr_for(spec: Spec, args) -> float:
    return args.bundled_lr if spec.model == "bundled" else args.lr


def run_one(spec: Spec, ctx: Context, args) -> dict:
    from benchmarks.organism import loss_of
    from lowbit.eval import perplexity
    from lowbit.qat import WinQCallback, resolve, to_qat, to_quant_linear
    from lowbit.train import TrainConfig, train

    steps = steps_for(spec, args)
    bundled = spec.model == "bundled"
    batch = args.bundled_batch if bundled else args.batch_size
    lr = lr_for(spec, args)
    model = copy.deepcopy(ctx.base)
    to_qat(model, resolve(spec.scheme))
    winq = winq_config(spec.variant, steps, spec.seed)
    work = Path(args.workdir).expanduser() / f"{spec.ident}-{steps}-lr{lr:g}"
    cfg = TrainConfig(steps=steps, batch_size=batch, lr=lr, warmup=max(steps // 20, 1), seed=spec.seed,
                      eval_every=max(steps // 8, 1), checkpoint_every=args.checkpoint_every, out_dir=str(work),
                      progress=args.progress, plot=False, dtype=args.dtype)
    diag = (Diagnostics(steps, ctx.diag_batch, work, spec.seed in args.float_curvature_seeds, args.diag_iters)
            if spec.diag else None)
    cb = WinQCallback(winq)
    before = codes(model)
    ppl_init = perplexity(model, ctx.eval_windows.reshape(1, -1).to(args.device), seqlen=args.eval_seqlen,
                          windows=None, progress=False).ppl  # the quantized start (per-row RTN on the QAT grid)
    extra = {"scheme": spec.scheme, "variant": spec.variant, "winq": winq.to_dict(), "model": spec.model}
    r = train(model, ctx.rows, cfg, callbacks=diag_callbacks(diag, cb), extra=extra,
              eval_fn=lambda m: {"eval_loss": loss_of(m, ctx.loss_windows)})
    changed_codes = changed(before, codes(model))
    to_quant_linear(model)
    ppl = perplexity(model, ctx.eval_windows.reshape(1, -1).to(args.device), seqlen=args.eval_seqlen,
                     windows=None, progress=False).ppl
    row = {"model": spec.model, "scheme": spec.scheme, "variant": spec.variant, "seed": spec.seed, "steps": steps,
           "batch_size": batch, "seqlen": ctx.rows.shape[1], "lr": lr, "winq": winq.to_dict(),
           "reinits": winq.reinit_steps(steps), "ppl": ppl, "ppl_init": ppl_init, "ppl_fp": ctx.ppl_fp,
           "final_loss_smoothed": {str(w): sum(r.losses[-w:]) / w for w in WINDOWS},
           "changed_codes": changed_codes, "losses": [round(x, 4) for x in r.losses],
           "evals": r.evals, "diag": diag.records if diag else None, "train_seconds": r.seconds,
           "resumed_from": r.resumed_from, "machine": machine()}
    return row


# ------------------------------------------------------------------ report
def summary(rows: list[dict]) -> list[dict]:
    """Per (model, scheme, seed, variant != ste): speed-up vs that seed's STE and the ppl pair."""
    from lowbit.train import speedup

    ste = {(r["model"], r["scheme"], r["seed"], r["steps"], r["lr"]): r for r in rows if r["variant"] == "ste"}
    out = []
    for r in rows:
        base = ste.get((r["model"], r["scheme"], r["seed"], r["steps"], r["lr"]))
        if r["variant"] == "ste" or base is None:
            continue
        s = {f"speedup_{w}": speedup(base["losses"], r["losses"], w) for w in WINDOWS}
        out.append({"model": r["model"], "scheme": r["scheme"], "variant": r["variant"], "seed": r["seed"],
                    "steps": r["steps"], **{k: v["speedup"] for k, v in s.items()},
                    **{f"steps_{w}": (s[f"speedup_{w}"]["baseline_steps"], s[f"speedup_{w}"]["other_steps"])
                       for w in WINDOWS},
                    "ste_final": base["final_loss_smoothed"][str(WINDOWS[0])],
                    "final": r["final_loss_smoothed"][str(WINDOWS[0])],
                    "ppl_ste": base["ppl"], "ppl": r["ppl"], "ppl_not_worse": r["ppl"] <= base["ppl"]})
    return out


def report(args) -> None:
    from lowbit.train.plot import plot_losses

    data = load_results(args.results)
    rows = data.get("rows", [])
    summ = summary(rows)
    diags = diag_table(rows)
    merge_fields = {"summary": summ, "diagnostics": diags, "protocol": data.get("protocol")}
    from benchmarks.common import save_results

    data.update(merge_fields)
    save_results(args.results, data)
    for model in sorted({r["model"] for r in rows}):
        for scheme in sorted({r["scheme"] for r in rows if r["model"] == model}):
            sel = [r for r in rows if (r["model"], r["scheme"]) == (model, scheme) and r["variant"] in MAIN]
            curves = {f"{r['variant']} s{r['seed']}": r["losses"]
                      for r in sorted(sel, key=lambda r: (MAIN.index(r["variant"]), r["seed"]))}
            if curves:
                png = result_path(args.results).with_name(f"{result_path(args.results).stem}_{model}_{scheme}.png")
                plot_losses(curves, png, WINDOWS[0], title=f"QAT {scheme} on the {model}")
    print(markdown_table(["model", "scheme", "variant", "seed", "speed-up (50)", "speed-up (10)", "STE final",
                          "final", "ppl STE", "ppl"],
                         [(s["model"], s["scheme"], s["variant"], s["seed"], _f(s["speedup_50"]),
                           _f(s["speedup_10"]), f"{s['ste_final']:.3f}", f"{s['final']:.3f}", f"{s['ppl_ste']:.2f}",
                           f"{s['ppl']:.2f}") for s in summ]))
    print()
    cols = ("pre_lambda_ste", "post_lambda_ste", "pre_lambda_float", "post_lambda_float", "pre_in_range",
            "post_in_range", "pre_boundary_margin", "post_boundary_margin", "flips_next")
    print(markdown_table(["scheme", "variant", "step", *cols],
                         [(d["scheme"], d["variant"], d["step"], *(_g(d.get(c)) for c in cols)) for d in diags]))


def diag_table(rows: list[dict]) -> list[dict]:
    """Curvature / clipping / flip diagnostics per (scheme, variant), seeds averaged, per measurement point.

    For each re-init step s (K, 2K, 3K) of a run: the value just before the step's re-init (``pre``) and
    right after it (``post``; STE and noise-only runs have no re-init, so only ``pre``), and the share of
    codes that flip in the steps/16 steps after s; ``end``: step T, and the flips in the last steps/16.
    """
    from statistics import mean

    groups: dict = {}
    for r in rows:
        if r.get("diag"):
            groups.setdefault((r["model"], r["scheme"], r["variant"]), []).append(r)
    out = []
    for (model, scheme, variant), rs in sorted(groups.items()):
        steps = rs[0]["steps"]
        k, d = steps // 4, max(steps // 16, 1)
        for s in (k, 2 * k, 3 * k, steps):
            rec = {"model": model, "scheme": scheme, "variant": variant, "step": s, "seeds": len(rs)}
            for side in ("pre", "post"):
                vals = [r["diag"].get(f"{side}@{s}") for r in rs]
                vals = [v for v in vals if v]
                for key in ("loss", "lambda_ste", "lambda_float", "in_range", "boundary_margin"):
                    got = [v[key] for v in vals if v.get(key) is not None]
                    if got:
                        rec[f"{side}_{key}"] = mean(got)
            start = s if s < steps else steps - d
            flips = [r["diag"].get(f"flips@{start}-{start + d}") for r in rs]
            flips = [f for f in flips if f is not None]
            if flips:
                rec["flips_next"] = mean(flips)
            out.append(rec)
    return out


def _g(x) -> str:
    return "" if x is None else f"{x:.4g}"


def _f(x) -> str:
    return "never" if x is None else f"{x:.2f}"


def fit_budget(args, contexts: dict) -> None:
    """Lower ``--steps`` (to a multiple of 16) so every organism run of the plan fits ``--budget-s``.

    Timed on a QAT copy of the model (fake quantization included); the diagnostics and evals
    are covered by a 40% allowance. For a GPU session with a fixed device time.
    """
    from benchmarks.organism import steps_within
    from lowbit.qat import resolve, to_qat

    specs = [s for s in plan(args) if s.model == "organism"]
    if not specs:
        return
    contexts["organism"] = ctx = load_context("organism", args)
    m = copy.deepcopy(ctx.base)
    to_qat(m, resolve(specs[0].scheme))
    args.steps = max(steps_within(args.budget_s / len(specs), m, ctx.rows, args, overhead=1.4) // 16 * 16, 16)
    del m


# -------------------------------------------------------------------- main
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", default="main", help="comma list of main, sweep, bundled")
    p.add_argument("--schemes", default="w2,ternary,w1")
    p.add_argument("--sweep-schemes", default="w2,ternary")
    p.add_argument("--variants", default="ste,winq,reinit,noise",
                   help="main plan: these variants (ste and winq first); bundled plan: the first two, first "
                        "scheme, first seed")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--only", default=None, help="run only specs whose id contains this text")
    p.add_argument("--organism", default=str(ORGANISM))
    p.add_argument("--data", default=None, help="default: ORGANISM/corpus.jsonl")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--bundled-steps", type=int, default=200)
    p.add_argument("--bundled-batch", type=int, default=2)
    p.add_argument("--bundled-lr", type=float, default=1e-4)
    p.add_argument("--bundled-seqlen", type=int, default=64)
    p.add_argument("--bundled-eval-windows", type=int, default=32)
    p.add_argument("--eval-seqlen", type=int, default=128)
    p.add_argument("--eval-windows", type=int, default=128, help="final ppl: windows spread over the eval split")
    p.add_argument("--eval-loss-windows", type=int, default=32, help="eval loss logged every steps/8")
    p.add_argument("--diag", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--diag-iters", type=int, default=20)
    p.add_argument("--diag-batch", type=int, default=4)
    p.add_argument("--float-curvature-seeds", default="0")
    p.add_argument("--workdir", default=str(Path.home() / ".cache" / "lowbit" / "qat_winq"))
    p.add_argument("--checkpoint-every", type=int, default=250)
    p.add_argument("--keep-work", action="store_true", help="keep each finished run's checkpoint folder")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--progress", action="store_true")
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="lower --steps so all organism runs of the plan fit this many seconds (GPU sessions)")
    p.add_argument("--results", default=NAME, help="results file (name under benchmarks/results, or a path)")
    p.add_argument("--report", action="store_true", help="only rebuild the summary and PNGs from the JSON")
    args = p.parse_args()
    args.data = args.data or str(Path(args.organism) / "corpus.jsonl")
    args.float_curvature_seeds = {int(s) for s in args.float_curvature_seeds.split(",") if s}
    if args.report:
        report(args)
        return

    import torch

    torch.set_num_threads(args.threads)
    contexts: dict[str, Context] = {}
    if args.budget_s:
        fit_budget(args, contexts)
    done = {tuple(r.get(k) for k in KEY) for r in load_results(args.results).get("rows", [])}
    todo = [s for s in plan(args) if (s.model, s.scheme, s.variant, s.seed, steps_for(s, args), lr_for(s, args))
            not in done]
    print(json.dumps({"todo": [s.ident for s in todo], "steps": args.steps}), flush=True)
    protocol = {k: v for k, v in vars(args).items() if k not in ("only", "progress", "report", "plan", "budget_s")}
    protocol["float_curvature_seeds"] = sorted(args.float_curvature_seeds)
    for spec in todo:
        if spec.model not in contexts:
            contexts[spec.model] = load_context(spec.model, args)
        t0 = time.perf_counter()
        row = run_one(spec, contexts[spec.model], args)
        row["wall_seconds"] = round(time.perf_counter() - t0, 1)
        merge_row(args.results, row, KEY, **{"protocol" if spec.model == "organism" else f"protocol_{spec.model}": protocol})
        work = Path(args.workdir).expanduser() / f"{spec.ident}-{row['steps']}-lr{row['lr']:g}"
        if not args.keep_work:
            shutil.rmtree(work / "checkpoint", ignore_errors=True)
        print(json.dumps({k: row[k] for k in ("model", "scheme", "variant", "seed", "ppl", "changed_codes",
                                              "final_loss_smoothed", "wall_seconds")}), flush=True)


if __name__ == "__main__":
    main()
