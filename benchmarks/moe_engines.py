"""lowbit's compressed-tensors export of the MoE organism, in the engines users run: vLLM (CPU), transformers, lowbit.

    python -m benchmarks.moe_engines --vllm-python /path/to/.venv-vllm/bin/python
    python -m benchmarks.moe_engines --engines lowbit,lowbit-ct,transformers      # without vLLM
    python -m benchmarks.moe_engines --table

Protocol. The Qwen3-MoE organism (``python -m benchmarks.organism --arch qwen3moe``: 4 layers, 16
experts, top-2) is quantized the way a user does it, ``lowbit quantize MODEL --scheme w4g128
--method rtn`` (every expert and attention projection; routers, embeddings and head 16-bit), then
``lowbit export --to compressed-tensors`` (per-expert pack-quantized tensors,
`lowbit.files.compressed_experts`). Every (model, engine) pair runs in a fresh process on one
thread and reports perplexity on the same token ids: the first 40 x 512 windows of the organism's
evaluation split (the windows benchmarks/moe_peers.py scores), saved once as JSON so the vLLM
process (its own environment) reads the very same ids.

Engines: ``lowbit`` (the native checkpoint, float32: lowbit's own evaluation, the reference column),
``lowbit-ct`` (the exported folder through lowbit's reader, `compressed_read.load_decompressed`:
experts rebuilt as `QuantExperts` from the file's codes), ``transformers`` (the folder through
``AutoModelForCausalLM.from_pretrained`` with compressed-tensors installed: its MoE loader
decompresses the experts into float ``Qwen3MoeExperts``), ``vllm-w4a8`` (vLLM's CPU build, bf16,
``VLLM_CPU_INT4_W4A8=1``: its default on AMX processors and the only INT4 MoE path that runs here;
activations are quantized to int8 per token, so its column is W4A8, not W4A16), ``vllm`` (the same with
``VLLM_CPU_INT4_W4A8=0``, pure W4A16; recorded as it ends). The ``float`` rows score the organism itself
(lowbit: transformers float32; vLLM: bf16), so the vLLM - lowbit gap of the export can be read against
the same gap of the float model.

vLLM runs from its own environment (``--vllm-python``; its lowbit is not used: the child imports only
vllm and this package). Results: ``benchmarks/results/moe_engines.json``, lab note
``benchmarks/results/moe_engines.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import ROOT, emit, load_results, machine, markdown_table, merge_row

RESULTS = "moe_engines"
ORGANISM = Path.home() / ".cache" / "lowbit" / "organism-moe"
WINDOWS, SEQLEN = 40, 512
MODELS = {"float": None, "ct-w4g128": "w4g128"}
ENGINES = ("lowbit", "lowbit-ct", "transformers", "vllm-w4a8", "vllm")
FLOAT_ENGINES = ("lowbit", "vllm-w4a8")  # the float organism: transformers float32, vLLM bf16


def engines_for(model: str, wanted: list[str]) -> list[str]:
    return [e for e in wanted if model != "float" or e in FLOAT_ENGINES]


# ------------------------------------------------------------------ files (parent, lowbit's environment)
def make_files(organism: Path, keep: Path, scheme: str) -> tuple[Path, Path]:
    """The native checkpoint and its compressed-tensors export under ``keep`` (made once, reused after)."""
    ckpt, ct = keep / f"ckpt-{scheme}", keep / f"ct-{scheme}"
    lowbit = [sys.executable, "-m", "lowbit"]
    if not (ckpt / "lowbit.json").is_file():
        subprocess.run([*lowbit, "quantize", str(organism / "model"), "--scheme", scheme, "--method", "rtn",
                        "--no-eval", "--threads", "1", "--force", "--out", str(ckpt)], check=True)
    if not (ct / "config.json").is_file():
        subprocess.run([*lowbit, "export", str(ckpt), "--to", "compressed-tensors", "--force", "--out", str(ct)],
                       check=True)
    return ckpt, ct


def save_windows(organism: Path, keep: Path) -> Path:
    """The evaluation windows as token ids, one file every engine reads."""
    from benchmarks.moe_peers import organism_data
    from lowbit.eval.perplexity import eval_windows

    path = keep / f"windows-{WINDOWS}x{SEQLEN}.json"
    if not path.is_file():
        _, _, ev = organism_data(organism)
        path.write_text(json.dumps({"windows": eval_windows(ev, SEQLEN, WINDOWS).tolist()}))
    return path


# ------------------------------------------------------------------ engines (children)
def run_torch(engine: str, path: Path, windows: list[list[int]]) -> dict:
    import torch

    from lowbit.eval import perplexity

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    if engine == "lowbit":
        import lowbit

        model = lowbit.load(path)[0] if (path / "lowbit.json").is_file() else None
        if model is None:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    elif engine == "lowbit-ct":
        from lowbit.files.compressed_read import load_decompressed

        model = load_decompressed(path, torch.float32)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    load_s = time.perf_counter() - t0
    experts = sorted({type(m).__name__ for n, m in model.named_modules() if n.endswith("mlp.experts")})
    win = torch.tensor(windows)
    r = perplexity(model, win, win.shape[1], win.shape[0], batch_size=1, progress=False)
    return {"ppl": r.ppl, "tokens": r.tokens, "load_s": round(load_s, 1), "ppl_s": r.seconds, "experts": experts,
            "dtype": "float32"}


def run_vllm(engine: str, path: Path, windows: list[list[int]]) -> dict:
    """Prompt log-probabilities of every window (benchmarks/engines.py's protocol), bf16."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_CPU_INT4_W4A8"] = "1" if engine == "vllm-w4a8" else "0"
    import math

    from vllm import LLM, SamplingParams

    from benchmarks.engines import refusal

    t0 = time.perf_counter()
    try:
        llm = LLM(model=str(path), dtype="bfloat16", max_model_len=len(windows[0]) + 8, enforce_eager=True,
                  enable_prefix_caching=False, seed=0)
    except Exception as e:  # noqa: BLE001 - vLLM refuses the file: record where
        return refusal(e)
    load_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": w} for w in windows],
                        SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0), use_tqdm=False)
    nll, n = 0.0, 0
    for w, o in zip(windows, outs, strict=True):
        for tok, lp in zip(w[1:], o.prompt_logprobs[1:], strict=True):
            nll -= lp[tok].logprob
            n += 1
    try:  # which MoE method vLLM chose for the experts (its internals move between versions: best effort)
        model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        methods = sorted({type(getattr(m, "quant_method", None)).__name__ for m in model.modules()
                          if "Experts" in type(m).__name__})
    except AttributeError:
        methods = []
    return {"ppl": math.exp(nll / n), "tokens": n, "load_s": round(load_s, 1), "ppl_s": round(time.perf_counter() - t1, 1),
            "dtype": "bfloat16", "moe_methods": methods}


def child(args: argparse.Namespace) -> None:
    windows = json.loads(Path(args.windows).read_text())["windows"]
    path = Path(args.path)
    row = run_vllm(args.child, path, windows) if args.child.startswith("vllm") else run_torch(args.child, path, windows)
    emit(row)


def run_child(engine: str, path: Path, windows: Path, python: str) -> dict:
    """One (model, engine) in a fresh process; a crash (vLLM's SIGILL) is recorded with its exit status."""
    cmd = [python, "-m", "benchmarks.moe_engines", "--child", engine, "--path", str(path), "--windows", str(windows)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    if engine.startswith("vllm"):
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = round(time.perf_counter() - t0, 1)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = " | ".join((p.stderr or p.stdout).strip().splitlines()[-3:])[:400]
        killed = f"killed by {signal.Signals(-p.returncode).name}; " if p.returncode < 0 else ""
        return {"status": "crashed", "returncode": p.returncode, "error": killed + tail, "wall_s": wall}
    return {"status": "ok", **json.loads(lines[-1]), "wall_s": wall}


def _versions(python: str) -> dict:
    code = ("import json, importlib.metadata as m\nout = {}\nfor n in ('vllm-cpu', 'vllm', 'torch', 'transformers', "
            "'compressed-tensors'):\n    try: out[n] = m.version(n)\n    except Exception: pass\nprint(json.dumps(out))")
    p = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return json.loads(p.stdout) if p.returncode == 0 else {}


# ------------------------------------------------------------------ driver
def table(data: dict) -> str:
    rows = data.get("rows", [])
    ref = {r["model"]: r.get("ppl") for r in rows if r["engine"] == "lowbit"}

    def cell(r: dict) -> list:
        ppl = r.get("ppl")
        base = ref.get(r["model"])
        gap = f"{100 * (ppl / base - 1):+.2f} %" if ppl and base else ""
        what = f"{ppl:.3f}" if ppl else f"{r.get('status')}: {str(r.get('error', ''))[:80]}"
        return [r["model"], r["engine"], r.get("dtype", ""), what, gap, ", ".join(r.get("experts", []) or
                                                                            r.get("moe_methods", []))]

    return markdown_table(["model", "engine", "dtype", f"ppl ({WINDOWS} x {SEQLEN})", "vs lowbit", "experts run as"],
                          [cell(r) for r in rows])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default="lowbit,lowbit-ct,transformers,vllm-w4a8",
                   help=f"comma-separated: {', '.join(ENGINES)}")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated: {', '.join(MODELS)}")
    p.add_argument("--vllm-python", default=None, help="the python of an environment with vllm-cpu installed")
    p.add_argument("--organism", default=str(ORGANISM))
    p.add_argument("--keep", default=str(Path.home() / ".cache" / "lowbit" / "moe-engines"))
    p.add_argument("--table", action="store_true")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--path", default=None, help=argparse.SUPPRESS)
    p.add_argument("--windows", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    if args.table:
        return print(table(load_results(RESULTS)))
    engines = args.engines.split(",")
    if bad := [e for e in engines if e not in ENGINES]:
        raise SystemExit(f"error: unknown engines {bad}; choose from {', '.join(ENGINES)}")
    if any(e.startswith("vllm") for e in engines) and not args.vllm_python:
        raise SystemExit("error: the vllm engines need --vllm-python (an environment with vllm-cpu); or leave them out")
    organism, keep = Path(args.organism), Path(args.keep)
    keep.mkdir(parents=True, exist_ok=True)
    windows = save_windows(organism, keep)
    versions = {"lowbit_env": _versions(sys.executable)}
    if args.vllm_python:
        versions["vllm_env"] = _versions(args.vllm_python)
    for model in args.models.split(","):
        if model == "float":
            paths = {e: organism / "model" for e in engines}
        else:
            ckpt, ct = make_files(organism, keep, MODELS[model])
            paths = {e: ckpt if e == "lowbit" else ct for e in engines}
        for engine in engines_for(model, engines):
            python = args.vllm_python if engine.startswith("vllm") else sys.executable
            row = {"model": model, "engine": engine, **run_child(engine, paths[engine], windows, python)}
            print(json.dumps(row), flush=True)
            merge_row(RESULTS, row, ("model", "engine"), machine=machine(), versions=versions,
                      protocol=f"{WINDOWS} x {SEQLEN} eval windows of the MoE organism, one thread per process")
    print(table(load_results(RESULTS)))


if __name__ == "__main__":
    main()
