"""KV-cache quantization: perplexity at long context and the cache's bytes per token (issue 36).

For each weight setting (float, W4A4 NVFP4, W8A8 INT8, RTN) and each KV scheme (none, FP8,
INT8, INT4, NVFP4, each 4-bit one with and without the Hadamard Q/K rotation), the
perplexity over the first ``--windows`` windows of ``--seqlen`` tokens of the evaluation
split, static KV scales calibrated on ``--nsamples`` x ``--calib-seqlen`` tokens of the
calibration split. The default window is the longest the model supports that the text
fills (SmolLM2: 8192 of its 51k evaluation tokens). Rows with a ``-rot`` KV scheme run on
weights quantized after the value / output rotation is folded in (a float pre-step, as
``lowbit quantize --kv ...-rot`` does); the others on the plain weights. Each row keeps the
relative cost against the same weights with float KV, and the KV bytes per token
(`lowbit.formats.kv.KVScheme.bytes_per_token`: elements plus run-time scales; 16-bit = 2
bytes an element).

    python -m benchmarks.kv                                            # benchmarks/results/kv.json
    python -m benchmarks.kv --seqlen 2048 --windows 1 --weights float,w4a4-nvfp4  # a loaded CPU
    python -m benchmarks.kv --model offgrid --seqlen 2048 --windows 1
    python -m benchmarks.kv --model organism-moe --windows 8 --nsamples 8   # the float MoE organism, 1024 tokens
    python -m benchmarks.kv --weights float --kv none,int4:block=16,mix:int8+int4@6 --seqlen 2048 --windows 3
    python -m benchmarks.kv --weights float --kv none,fp8,fp8:center=rope --seqlen 8192 --windows 3 --threads 1
    python -m benchmarks.kv --weights float --kv none,fp8 --seqlen 8192 --windows 3 --threads 1 --kl /tmp/klref

``--kl DIR`` adds each row's mean KL divergence to the float-KV model's next-token distribution on the same
tokens (`benchmarks.kv_kl`: paired and second order, so it ranks caches with far less noise than perplexity);
the float-KV row of the same weights and windows writes the reference under DIR first (1.6 GB per 8192-token
window), so list ``none`` first.

``--model organism`` / ``organism-moe``: a float organism of ``benchmarks/organism.py`` (a model trained in 32-bit
floats here, not a dequantized GGUF; ``--organism DIR`` for another folder): its own saved token ids, the
evaluation split for perplexity and ``--nsamples`` x ``--calib-seqlen`` windows of its training split drawn
from ``--seed`` as `lowbit.data.calibration_batches` draws them.

A ``mix:A+B@BITS`` entry is a per-layer choice among A, B by DeltaLoss within BITS per cached
element (``lowbit quantize --kv A,B --kv-bits BITS``); ``--seed`` moves the calibration samples.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from typing import Any

from benchmarks import common

WEIGHTS = ("float", "w4a4-nvfp4", "w8a8-int8")
KV = ("none", "fp8", "fp8-head", "int8", "int4", "int4-rot", "nvfp4", "nvfp4-rot")
RESULTS = "kv.json"
MIXED = "mix:"  # a per-layer KV choice: mix:int8+int4@6 (options, average bits per cached element)
ORGANISMS = ("organism", "organism-moe")  # the float organisms of benchmarks/organism.py (default folders there)


def row_key(r: dict[str, Any]) -> tuple:
    """A row's identity in ``kv.json`` (rows from before ``calib_seed`` existed were calibrated with seed 0); the CPU
    is part of it, since GEMMs round differently on another one (the same row moves by ~0.02 % between machines)."""
    return (r.get("model"), r.get("weights"), r.get("kv"), r.get("values_rotated"), r.get("seqlen"), r.get("windows"),
            r.get("calib_seed", 0), cpu(r))


def cpu(r: dict[str, Any]) -> str | None:
    """The CPU a row ran on (None for rows that did not record it)."""
    m = r.get("machine")
    return m.get("cpu") if isinstance(m, dict) else None


def rotates(kv: str) -> bool:
    """Whether a ``--kv`` entry rotates keys and values (``int4-rot``, ``fp8-rot:center``): its weights get the value
    rotation folded in first."""
    from lowbit.formats.kv import ROTATE_SUFFIX

    return kv.partition(":")[0].endswith(ROTATE_SUFFIX)


def longest_window(model: Any, n_tokens: int) -> int:
    """The longest power-of-two window the model's positions allow that the evaluation text fills once."""
    limit = int(getattr(model.config, "max_position_embeddings", 2048) or 2048)
    w = 1 << (min(limit, n_tokens).bit_length() - 1)
    return max(w, 2)


def weights_model(float_model: Any, weights: str, rotated: bool, calib: Any) -> Any:
    """A copy of the float model, values rotated through o_proj if asked, then RTN-quantized to ``weights``
    (static input scales calibrated on the same calibration tokens)."""
    from lowbit.api import build_plan
    from lowbit.nn.kv_quant import fold_value_rotation
    from lowbit.ptq import quantize_model

    model = copy.deepcopy(float_model)
    if rotated:
        fold_value_rotation(model)
    if weights != "float":
        quantize_model(model, build_plan(model, weights, None), "rtn", calib=calib, progress=False)
    return model


def measure(model: Any, kv: str, tokens: Any, calib: Any, seqlen: int, windows: int,
            kl: dict[str, Any] | None = None) -> dict[str, Any]:
    """One row: the cache installed and calibrated, perplexity over the windows; with ``kl`` (``root``, ``fields``,
    ``reference``) also the mean KL divergence to the float-KV model (`benchmarks.kv_kl`; the reference row writes
    the float distributions instead)."""
    from lowbit.formats.kv import KVScheme
    from lowbit.nn.kv_quant import cache_shape, calibrate_kv, remove_kv

    row: dict[str, Any] = {"kv": kv}
    layers, heads, dim = cache_shape(model)
    row["kv_bytes_per_token_16bit"] = 2 * layers * heads * dim * 2
    if kv.startswith(MIXED):
        row |= mixed_cache(model, kv, calib)
    elif kv != "none":
        scheme = KVScheme.parse(kv)
        t0 = time.perf_counter()
        attns = calibrate_kv(model, calib, scheme, values_folded=scheme.rotate)
        row["calibrate_s"] = round(time.perf_counter() - t0, 1)
        if scheme.static and not scheme.per_head:  # the calibrated scales, to compare with a peer's
            row |= {f"{b}s": {n: float(getattr(a, b)) for n, a in attns.items()} for b in ("k_scale", "v_scale")}
        row["kv_bytes_per_token"] = scheme.bytes_per_token(layers, heads, dim)
    else:
        row["kv_bytes_per_token"] = row["kv_bytes_per_token_16bit"]
    r, kl_row = metered_perplexity(model, tokens, seqlen, windows, kl)
    remove_kv(model)
    row |= {"ppl": r.ppl, "eval_tokens": r.tokens, "eval_s": r.seconds} | kl_row
    return row


def metered_perplexity(model: Any, tokens: Any, seqlen: int, windows: int,
                       kl: dict[str, Any] | None) -> tuple[Any, dict[str, Any]]:
    """`lowbit.eval.perplexity`, with the KL meter on the model's forward when ``kl`` asks for it; the row's
    ``kl`` fields (the mean over predicted tokens, and the reference it was measured against)."""
    from lowbit.eval import perplexity

    if kl is None:
        return perplexity(model, tokens, seqlen=seqlen, windows=windows, progress=False), {}
    from benchmarks.kv_kl import kl_meter, reference_folder

    with kl_meter(model, kl["root"], kl["fields"], kl["reference"]) as meter:
        r = perplexity(model, tokens, seqlen=seqlen, windows=windows, progress=False)
    if kl["reference"]:
        return r, {"kl_reference": True}
    return r, {"kl": meter.mean, "kl_ref": reference_folder(kl["root"], kl["fields"]).name}


def kl_args(args: argparse.Namespace, weights: str, seqlen: int, fields: dict[str, Any],
            reference: bool) -> dict[str, Any] | None:
    """The ``kl`` argument of `measure` for ``--kl ROOT`` (None without it)."""
    if not args.kl:
        return None
    return {"root": args.kl, "reference": reference,
            "fields": fields | {"weights": weights, "seqlen": seqlen, "windows": args.windows, "cpu": cpu_now()}}


def cpu_now() -> str:
    return common.machine()["cpu"]


def mixed_cache(model: Any, kv: str, calib: Any) -> dict[str, Any]:
    """``mix:A+B+...@BITS``: each attention's scheme chosen among A, B, ... by DeltaLoss's KV term within BITS per
    cached element (`lowbit.ptq.mixed.mixed_kv`, what ``lowbit quantize --kv A,B --kv-bits BITS`` runs), then
    installed and calibrated on the same calibration tokens."""
    from lowbit.nn.kv_quant import cache_shapes, calibrate_kv
    from lowbit.ptq.mixed import mixed_kv

    options, _, bits = kv[len(MIXED):].partition("@")
    t0 = time.perf_counter()
    choice = mixed_kv(model, options.split("+"), float(bits), calib, nsamples=len(calib), progress=False)
    calibrate_kv(model, calib, choice, values_folded=next(iter(choice.values())).rotate)
    shapes = cache_shapes(model)
    names = [s.name for s in choice.values()]
    return {"calibrate_s": round(time.perf_counter() - t0, 1), "per_layer": {n: s.name for n, s in choice.items()},
            "counts": {n: names.count(n) for n in dict.fromkeys(names)},
            "kv_bytes_per_token": sum(s.bytes_per_token(1, *shapes[n]) for n, s in choice.items())}


def load(args: argparse.Namespace) -> tuple[Any, Any, Any, dict[str, Any]]:
    """(float model, [1, T] evaluation ids, [nsamples, calib_seqlen] calibration windows, the rows' model fields)."""
    if args.model not in ORGANISMS:
        from lowbit.data import eval_tokens

        lm = common.bundled_model(args.threads, model=args.model)
        calib = common.calibration(lm.tokenizer, args.nsamples, args.calib_seqlen, seed=args.seed)
        return lm.model, eval_tokens(lm.tokenizer), calib, common.model_fields(args.model)
    return organism(args)


def organism(args: argparse.Namespace) -> tuple[Any, Any, Any, dict[str, Any]]:
    """A float organism's model and its saved token ids (`benchmarks.organism.load_tokens`); calibration windows
    drawn from its training split at seeded random starts, as `lowbit.data.calibration_batches` draws them."""
    from pathlib import Path

    import torch

    from benchmarks.organism import DEFAULT_OUT, DEFAULT_OUT_MOE, load_tokens
    from lowbit.io import sha256_file
    from lowbit.models import load_model

    folder = Path(args.organism or (DEFAULT_OUT if args.model == "organism" else DEFAULT_OUT_MOE)).expanduser()
    arch = " --arch qwen3moe" if args.model == "organism-moe" else ""
    saved = load_tokens(folder, folder / "corpus.jsonl")
    if not (folder / "model" / "config.json").is_file() or saved is None:
        raise SystemExit(f"error: {folder} holds no finished organism (model/ and its token ids); build it first: "
                         f"python -m benchmarks.organism{arch}")
    train, ev = saved
    ids = train[0]
    if len(ids) < args.nsamples * args.calib_seqlen:
        raise SystemExit(f"error: the organism's training split has {len(ids)} tokens, fewer than --nsamples x "
                         f"--calib-seqlen")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(args.seed)
    starts = torch.randint(0, len(ids) - args.calib_seqlen + 1, (args.nsamples,), generator=g)
    calib = torch.stack([ids[s:s + args.calib_seqlen] for s in starts.tolist()])
    fields = {"model": args.model, "model_sha256": sha256_file(folder / "model" / "model.safetensors")}
    return load_model(folder / "model").model, ev, calib, fields


def kv_names(text: str) -> list[str]:
    """``--kv none,fp8,fp8:center=rope,scale=headroom``: the schemes, each once, in order. Commas also separate one
    scheme's options, so an item with ``=`` and no ``:`` continues the scheme before it (as `parse_kv_options`
    reads ``lowbit quantize --kv``; a plain split ran ``fp8:center=rope`` and then failed on ``scale=headroom``)."""
    names: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if "=" in part and ":" not in part and names:
            names[-1] += "," + part
        elif part:
            names.append(part)
    return list(dict.fromkeys(names))


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    float_model, tokens, calib, fields = load(args)
    seqlen = args.seqlen or longest_window(float_model, tokens.numel())
    rows = []
    for weights in args.weights.split(","):
        base: dict[bool, float] = {}
        for rotated in (False, True):
            kvs = [k for k in kv_names(args.kv) if rotates(k) == rotated]
            if not kvs:
                continue
            if rotated and args.rotated_baseline:
                kvs = ["none", *kvs]
            model = weights_model(float_model, weights, rotated, calib)
            for kv in kvs:
                kl = kl_args(args, weights, seqlen, fields, reference=kv == "none" and not rotated)
                row = measure(model, kv, tokens, calib, seqlen, args.windows, kl)
                row |= {"weights": weights, "values_rotated": rotated, "seqlen": seqlen, "windows": args.windows,
                        "calib": f"{args.nsamples}x{args.calib_seqlen}", "calib_seed": args.seed,
                        **fields,
                        "machine": common.machine()}
                if kv == "none":
                    base[rotated] = row["ppl"]
                ref = base.get(rotated, base.get(False))
                if ref is not None:
                    row["ppl_vs_float_kv"] = row["ppl"] / ref - 1
                rows.append(row)
                common.merge_row(args.out, row, row_key)
                print(f"{weights:12s} {kv:10s} rot={int(rotated)} ppl {row['ppl']:.4f} "
                      f"({100 * row.get('ppl_vs_float_kv', 0):+.2f} %) {row['kv_bytes_per_token']:.0f} B/token"
                      + (f" KL {row['kl']:.5f}" if "kl" in row else "") + f" [{row['eval_s']:.0f} s]", flush=True)
            del model
    return rows


def with_costs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with ``ppl_vs_float_kv`` against the float-KV row of the same model, weights and window
    (rows from separate runs of the script have no baseline of their own)."""
    base = {(r["model"], r["weights"], r["seqlen"], r["windows"], cpu(r)): r["ppl"] for r in rows
            if r["kv"] == "none" and not r["values_rotated"]}
    out = []
    for r in rows:
        ref = base.get((r["model"], r["weights"], r["seqlen"], r["windows"], cpu(r)))
        out.append(r | ({"ppl_vs_float_kv": r["ppl"] / ref - 1} if ref is not None else {}))
    return out


def table(rows: list[dict[str, Any]]) -> str:
    rows = with_costs(rows)
    return common.markdown_table(
        ["model", "weights", "KV", "seqlen x windows", "ppl", "vs float KV", "KL to float KV", "KV bytes/token"],
        [[r["model"], r["weights"], r["kv"] + (f" (calib seed {r['calib_seed']})" if r.get("calib_seed") else ""),
          f"{r['seqlen']} x {r['windows']}", f"{r['ppl']:.3f}",
          f"{100 * r['ppl_vs_float_kv']:+.2f} %" if "ppl_vs_float_kv" in r else "",
          f"{r['kl']:.5f}" if "kl" in r else "", f"{r['kv_bytes_per_token']:.0f}"]
         for r in rows])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kv", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="bundled", choices=(*common.MODELS, *ORGANISMS),
                   help=common.MODEL_HELP + "; organism / organism-moe: the float organisms of benchmarks/organism.py")
    p.add_argument("--organism", default=None, help="the organism's folder (default: benchmarks/organism.py's)")
    p.add_argument("--weights", default=",".join(WEIGHTS), help=f"comma-separated weight recipes ({','.join(WEIGHTS)})")
    p.add_argument("--kv", default=",".join(KV), help=f"comma-separated KV schemes ({','.join(KV)})")
    p.add_argument("--rotated-baseline", action="store_true",
                   help="also measure float KV on the value-rotated weights (the -rot rows' own baseline)")
    p.add_argument("--seqlen", type=int, default=None, help="evaluation window (default: the longest the text fills)")
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--nsamples", type=int, default=16)
    p.add_argument("--calib-seqlen", type=int, default=512)
    p.add_argument("--seed", type=int, default=0, help="where the calibration samples start (rows keep it)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--kl", metavar="DIR", default=None,
                   help="also the mean KL divergence to the float-KV model's next-token distribution (benchmarks/kv_kl.py):"
                        " the float-KV row writes its distributions under DIR (1.6 GB per 8192-token window), the "
                        "other rows compare with them")
    p.add_argument("--table", action="store_true", help="print the table of the --out file's rows and exit")
    args = p.parse_args(argv)
    if args.table:
        rows = common.load_results(args.out)["rows"]
        print(table(sorted(rows, key=lambda r: (r["model"], WEIGHTS.index(r["weights"]) if r["weights"] in WEIGHTS
                                                else 9, r["values_rotated"], r["kv"] != "none", r["kv"]))))
        return 0
    rows = run(args)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
