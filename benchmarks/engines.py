"""Every export lowbit writes of the bundled model, in the engines users run: vLLM (CPU) and transformers.

    python -m benchmarks.engines                       # every export x every engine (needs the vllm extra)
    python -m benchmarks.engines --exports ct-w4a16-g64,ct-w8a8-int8 --engines lowbit,vllm
    python -m benchmarks.engines --table               # the table from benchmarks/results/engines.json
    python -m benchmarks.engines --exports ct-w8a8-int8 --engines lowbit,transformers --windows 1 --seqlen 64 \\
        --gen 4 --out /tmp/engines.json                # smoke, without vLLM

Protocol. Each export is made the way a user makes it: `lowbit quantize --method rtn
--no-search` (static input scales from 32 x 256 calibration tokens, seed 0; the engines'
agreement, not the quantizer, is measured here) of the bundled SmolLM2-135M
(whose "float" weights are a Q4_1 GGUF dequantized), then `lowbit export`. Every
(export, engine) pair runs in a fresh process on one thread and reports:

* perplexity on the first ``--windows`` x ``--seqlen`` windows of lowbit's evaluation split,
  the same token ids for every engine (saved once beside the exports); vLLM scores them
  as prompt log-probabilities, transformers and lowbit as logits (lowbit's convention:
  tokens 2..L of each window, ppl = exp(mean NLL));
* a fixed prompt generated greedily for ``--gen`` tokens (the text is recorded) and the
  decode rate in tokens/s (one thread; compare rates within one machine only).

Engines: ``lowbit`` (the native checkpoint, float32: lowbit's own evaluation, the column
every other engine is compared with), ``transformers`` / ``transformers-bf16`` (the
exported folder through transformers + compressed-tensors, decompressed in that dtype;
GGUF through transformers' GGUF loader; the native checkpoint through lowbit's
transformers quantizer), ``vllm`` (vLLM's CPU build, bf16: its INT4 path needs bf16),
``vllm-w4a8`` (INT4 files: vLLM's CPU default on AMX processors, which runs W4A16 files
with int8 dynamic activations, ``VLLM_CPU_INT4_W4A8=1``; ``vllm`` sets it to 0),
``vllm-emulation`` (NVFP4 only: vLLM's own NVFP4 emulation kernel registered for the
CPU, which vLLM ships but selects only on GPUs: a diagnostic of lowbit's file through
vLLM's loader, fused-layer global scales included; W4A16 NVFP4 runs vLLM's dequantization
function with unquantized inputs, since vLLM's emulation kernel always quantizes inputs)
and ``llama.cpp`` (GGUF exports, when llama-cpp-python is installed in the environment).
Where vLLM refuses a file, the row records the vLLM source line that raised and its message.

vLLM comes from the ``vllm`` extra in a separate environment (``make vllm-setup``:
``.venv-vllm``, see benchmarks/README.md); run this script with that environment's python.
Results: ``benchmarks/results/engines.json`` (one row per export and engine), lab note
``benchmarks/results/engines.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import (
    NSAMPLES,
    SEQLEN,
    emit,
    load_results,
    machine,
    markdown_table,
    merge_row,
    out_path,
    run_child,
)

RESULT = "engines"
VLLM_MIN = (0, 32)
VLLM_HOW = "the vllm extra in its own environment: make vllm-setup (then run with .venv-vllm/bin/python)"
PROMPT = "The Python standard library module for regular expressions is"
ENGINES = ("lowbit", "transformers", "transformers-bf16", "vllm", "vllm-w4a8", "vllm-emulation", "llama.cpp")
INT4_EXPORTS = ("ct-w4a16-g64", "ct-w4a16-g64-asym")


@dataclass(frozen=True)
class Export:
    """One export of the bundled model: the recipe quantized, and the format written."""

    recipe: str
    to: str  # compressed-tensors | gguf | native
    what: str
    kv: str | None = None  # a KV-cache scheme (`--kv`) quantized with the weights; vLLM runs it with its fp8 cache


EXPORTS = {
    "ct-w4a16-g64": Export("w4g64", "compressed-tensors", "INT4 W4A16 g64 symmetric (pack-quantized)"),
    "ct-w4a16-g64-asym": Export("w4g64a", "compressed-tensors", "INT4 W4A16 g64 asymmetric"),
    "ct-w8a16": Export("w8", "compressed-tensors", "INT8 weight-only, per channel"),
    "ct-w8a8-int8": Export("w8a8-int8", "compressed-tensors", "W8A8 INT8 (dynamic per-token inputs)"),
    "ct-fp8-a16": Export("fp8", "compressed-tensors", "FP8 E4M3 weight-only, per channel"),
    "ct-w8a8-fp8": Export("w8a8-fp8", "compressed-tensors", "W8A8 FP8 (dynamic per-token inputs)"),
    "ct-nvfp4-a16": Export("nvfp4", "compressed-tensors", "NVFP4 weight-only (W4A16)"),
    "ct-mxfp4-a16": Export("mxfp4", "compressed-tensors", "MXFP4 weight-only (W4A16)"),
    "ct-w4a4-nvfp4": Export("w4a4-nvfp4", "compressed-tensors", "W4A4 NVFP4 (static input global scale)"),
    "ct-w4a4-mxfp4": Export("mxfp4@mxfp4:round=even", "compressed-tensors", "W4A4 MXFP4 (E8M0 round-even inputs)"),
    "ct-w8a8-int8-kv-fp8": Export("w8a8-int8", "compressed-tensors",
                                  "W8A8 INT8 + FP8 E4M3 KV cache (static per-tensor k/v scales, kv_cache_scheme)", kv="fp8"),
    "gguf-q4_0": Export("w4g32", "gguf", "GGUF Q4_0 (INT4 sym g32)"),
    "gguf-q4_k_m": Export("q4_k_m", "gguf", "GGUF Q4_K_M (llama.cpp's mix)"),
    "native-w4g64": Export("w4g64", "native", "lowbit checkpoint through transformers (lowbit's quantizer)"),
}
NVFP4_EXPORTS = ("ct-nvfp4-a16", "ct-w4a4-nvfp4")
FP4_EXPORTS = (*NVFP4_EXPORTS, "ct-mxfp4-a16", "ct-w4a4-mxfp4")


def engines_for(name: str, wanted: list[str]) -> list[str]:
    """The engines that can be asked to load an export (vLLM is asked for every compressed-tensors file)."""
    to = EXPORTS[name].to
    ok = {"lowbit", "transformers"}
    if to == "compressed-tensors":  # bf16 transformers for the FP4 files, which failed in float32
        ok |= {"vllm"} | ({"vllm-emulation"} if name in NVFP4_EXPORTS else set()) | (
            {"transformers-bf16"} if name in FP4_EXPORTS else set()) | ({"vllm-w4a8"} if name in INT4_EXPORTS else set())
    if to == "gguf":
        ok.add("llama.cpp")
    return [e for e in wanted if e in ok]


def vllm_problem() -> str | None:
    """Why vLLM cannot run here (not installed, too old), or None."""
    try:
        import vllm
    except ImportError:
        return f"vLLM is not installed in this environment ({sys.executable}); install {VLLM_HOW}"
    version = tuple(int(p) for p in vllm.__version__.split(".")[:2] if p.isdigit())
    if version < VLLM_MIN:
        return f"vLLM {vllm.__version__} is older than {'.'.join(map(str, VLLM_MIN))}; install {VLLM_HOW}"
    return None


# ------------------------------------------------------------------ files
def make_export(name: str, keep: Path) -> tuple[Path, Path]:
    """The checkpoint and its export for ``name`` under ``keep`` (made once, reused after)."""
    from lowbit import api

    spec = EXPORTS[name]
    ckpt = keep / f"ckpt-{spec.recipe.replace('@', '_').replace(':', '_').replace('=', '_')}{'-kv-' + spec.kv if spec.kv else ''}"
    if not (ckpt / "lowbit.json").is_file():
        api.quantize(api.QuantizeJob(out=ckpt, scheme=spec.recipe, method="rtn", settings={"search": False},
                                     evaluation=None, force=True, progress=False, kv=spec.kv,
                                     calib=api.Calibration(nsamples=NSAMPLES, seqlen=SEQLEN),
                                     export_to=None if spec.to == "native" else spec.to))
    if spec.to == "native":
        return ckpt, ckpt
    out = keep / (f"{name}.gguf" if spec.to == "gguf" else name)
    if not out.exists():
        api.export(api.ExportJob(ckpt, spec.to, out, force=True))
    return ckpt, out


def save_windows(keep: Path, windows: int, seqlen: int) -> Path:
    """lowbit's evaluation windows as token ids, one file every engine reads."""
    import torch

    from benchmarks.common import bundled_model
    from lowbit.data import eval_tokens
    from lowbit.eval.perplexity import eval_windows

    path = keep / f"windows-{windows}x{seqlen}.json"
    if not path.is_file():
        lm = bundled_model()
        win = eval_windows(eval_tokens(lm.tokenizer), seqlen, windows)
        prompt = lm.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
        path.write_text(json.dumps({"windows": win.tolist(), "prompt": prompt}))
        del lm, torch
    return path


# ------------------------------------------------------------------ engines (children)
def _torch_model(engine: str, name: str, path: Path):
    import torch

    dtype = torch.bfloat16 if engine.endswith("bf16") else torch.float32
    spec = EXPORTS[name]
    if engine == "lowbit":
        import lowbit

        model, _ = lowbit.load(path)
        return model
    if spec.to == "compressed-tensors":
        from lowbit.files.compressed_read import load_decompressed

        return load_decompressed(path, dtype)
    from transformers import AutoModelForCausalLM

    if spec.to == "gguf":
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()
    import lowbit  # noqa: F401  (registers lowbit's transformers quantizer for native checkpoints)

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def run_torch(engine: str, name: str, path: Path, data: dict, gen: int) -> dict:
    import torch

    from lowbit.eval import perplexity

    t0 = time.perf_counter()
    model = _torch_model(engine, name, path)
    load_s = time.perf_counter() - t0
    win = torch.tensor(data["windows"])
    r = perplexity(model, win, win.shape[1], win.shape[0], batch_size=1, progress=False)
    prompt = torch.tensor([data["prompt"]])
    with torch.inference_mode():
        model.generate(prompt, max_new_tokens=2, do_sample=False)  # warm-up
        t1 = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=gen, min_new_tokens=gen, do_sample=False)
        dt = time.perf_counter() - t1
    new = out[0, prompt.shape[1]:].tolist()
    return {"ppl": r.ppl, "tokens": r.tokens, "load_s": round(load_s, 1), "ppl_s": r.seconds,
            "prompt_tok_s": round(r.tokens / r.seconds, 1), "gen_ids": new, "gen_tok_s": round(len(new) / dt, 2)}


def register_cpu_nvfp4_emulation() -> None:
    """Make vLLM's NVFP4 emulation kernel selectable on the CPU (vLLM lists it for CUDA and ROCm only).

    W4A4 layers run vLLM's ``EmulationNvFp4LinearKernel`` as shipped. vLLM has no weight-only
    (W4A16) emulation (the kernel quantizes inputs always); for those layers a subclass runs
    vLLM's own ``dequantize_to_dtype`` on the weights (after vLLM's loader folded the fused
    parts' global scales) and multiplies unquantized inputs, which is what W4A16 means.
    """
    import torch
    from vllm.model_executor.kernels import linear as kl
    from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import dequantize_to_dtype
    from vllm.platforms import PlatformEnum

    class EmulationNvFp4W4A16(EmulationNvFp4LinearKernel):
        def apply_weights(self, layer, x, bias=None):
            if hasattr(layer, "input_global_scale_inv"):
                return super().apply_weights(layer, x, bias)
            w = dequantize_to_dtype(layer.weight.data.view(torch.uint8), layer.weight_scale.data,
                                    layer.weight_global_scale, x.dtype, 16, swizzle=False)
            out = x @ w.t()
            return out if bias is None else out + bias

    kl._POSSIBLE_NVFP4_KERNELS[PlatformEnum.CPU] = [EmulationNvFp4W4A16]
    real = kl.init_nvfp4_linear_kernel

    def init(use_a16: bool = False):
        if use_a16:  # vLLM's auto path forces Marlin (GPU-only) for W4A16 before looking at the registry
            return EmulationNvFp4W4A16(kl.NvFp4LinearLayerConfig())
        return real(use_a16)

    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_w4a4_nvfp4 as scheme_mod,
    )

    scheme_mod.init_nvfp4_linear_kernel = init


def run_vllm(engine: str, path: Path, data: dict, gen: int, kv: str | None = None) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: the emulation patch applies
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # vLLM's CPU INT4 kernel quantizes activations to int8 on AMX CPUs unless told not to (VLLM_CPU_INT4_W4A8,
    # default on): "vllm" serves a W4A16 file as W4A16, "vllm-w4a8" measures vLLM's default
    os.environ["VLLM_CPU_INT4_W4A8"] = "1" if engine == "vllm-w4a8" else "0"
    if engine == "vllm-emulation":
        register_cpu_nvfp4_emulation()
    from vllm import LLM, SamplingParams

    windows, seqlen = data["windows"], len(data["windows"][0])
    t0 = time.perf_counter()
    try:
        # an FP8 KV export is served as vLLM users do: kv_cache_dtype="fp8" reads the file's k/v scales, and vLLM's
        # CPU attention reads every key and value back from that cache, prompt tokens included
        cache = {"kv_cache_dtype": "fp8"} if kv else {}
        llm = LLM(model=str(path), dtype="bfloat16", max_model_len=max(seqlen, len(data["prompt"]) + gen) + 8,
                  enforce_eager=True, enable_prefix_caching=False, seed=0, **cache)
    except Exception as e:  # vLLM refuses the file: record where
        return refusal(e)
    load_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": w} for w in windows],
                        SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0), use_tqdm=False)
    ppl_s = time.perf_counter() - t1
    nll, n = 0.0, 0
    for w, o in zip(windows, outs, strict=True):
        for tok, lp in zip(w[1:], o.prompt_logprobs[1:], strict=True):
            nll -= lp[tok].logprob
            n += 1
    sp = SamplingParams(max_tokens=gen, min_tokens=gen, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": data["prompt"]}], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    t2 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": data["prompt"]}], sp, use_tqdm=False)[0].outputs[0]
    dt = time.perf_counter() - t2
    new = list(out.token_ids)
    return {"ppl": math.exp(nll / n), "tokens": n, "load_s": round(load_s, 1), "ppl_s": round(ppl_s, 1),
            "prompt_tok_s": round(n / ppl_s, 1), "gen_ids": new, "gen_tok_s": round(len(new) / dt, 2),
            "dtype": "bfloat16"}


def refusal(e: BaseException) -> dict:
    """Where vLLM raised: its innermost source line, and the message's first line."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "/vllm/" in f.filename]
    where = None
    if frames:
        f = frames[-1]
        where = f"vllm/{f.filename.split('/vllm/', 1)[1]}:{f.lineno} ({f.name})"
    msg = " ".join(str(e).split())[:400]
    return {"status": "refused", "error": f"{type(e).__name__}: {msg}", "where": where}


def run_llamacpp(path: Path, data: dict, gen: int) -> dict:
    import torch
    from llama_cpp import Llama

    from benchmarks.llamacpp import _nll

    win = torch.tensor(data["windows"])
    llm = Llama(model_path=str(path), n_ctx=win.shape[1] + gen + 8, n_batch=win.shape[1], logits_all=True,
                n_threads=1, verbose=False)
    t0 = time.perf_counter()
    nll, n = _nll(llm, win)
    ppl_s = time.perf_counter() - t0
    llm.reset()
    t1 = time.perf_counter()
    new = []
    for tok in llm.generate(data["prompt"], temp=0.0, top_k=1):
        new.append(int(tok))
        if len(new) == gen:
            break
    dt = time.perf_counter() - t1
    return {"ppl": math.exp(nll / n), "tokens": n, "ppl_s": round(ppl_s, 1), "prompt_tok_s": round(n / ppl_s, 1),
            "gen_ids": new, "gen_tok_s": round(len(new) / dt, 2)}


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    data = json.loads(Path(args.windows_file).read_text())
    path = Path(args.path)
    try:
        if args.child.startswith("vllm"):
            row = run_vllm(args.child, path, data, args.gen, EXPORTS[args.export].kv)
        elif args.child == "llama.cpp":
            row = run_llamacpp(path, data, args.gen)
        else:
            row = run_torch(args.child, args.export, path, data, args.gen)
    except Exception as e:  # an engine that fails to load or run a file: recorded, not fatal
        row = refusal(e) if args.child.startswith("vllm") else {"status": "failed",
                                                                "error": f"{type(e).__name__}: {e}"[:400]}
    row.setdefault("status", "ok")
    emit(row)


# ------------------------------------------------------------------ parent
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engines", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--exports", default="all", help=f"comma-separated, or all: {', '.join(EXPORTS)}")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated from: {', '.join(ENGINES)}")
    p.add_argument("--windows", type=int, default=8, help="evaluation windows (8)")
    p.add_argument("--seqlen", type=int, default=512, help="tokens per window (512)")
    p.add_argument("--gen", type=int, default=32, help="greedy tokens generated from the fixed prompt (32)")
    p.add_argument("--keep", default="/tmp/lowbit-engines", help="where checkpoints and exports are kept (reused)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per engine run before it is recorded as such")
    p.add_argument("--out", default=None, help="results JSON (default benchmarks/results/engines.json)")
    p.add_argument("--table", action="store_true", help="print the table of the results file and stop")
    p.add_argument("--redo", action="store_true",
                   help="run pairs the results file already has (same windows); by default they are kept")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--export", default=None, help=argparse.SUPPRESS)
    p.add_argument("--path", default=None, help=argparse.SUPPRESS)
    p.add_argument("--windows-file", default=None, help=argparse.SUPPRESS)
    return p


def check_args(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """Exports and engines asked for, checked before any work (one line naming the fix otherwise)."""
    exports = list(EXPORTS) if args.exports == "all" else [e.strip() for e in args.exports.split(",") if e.strip()]
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in exports if e not in EXPORTS] + [e for e in engines if e not in ENGINES]
    if bad:
        raise SystemExit(f"error: unknown export or engine {bad}; exports: {', '.join(EXPORTS)}; engines: "
                         f"{', '.join(ENGINES)}")
    if any(e.startswith("vllm") for e in engines) and (why := vllm_problem()) is not None:
        raise SystemExit(f"error: {why}; or leave vllm out of --engines")
    if "llama.cpp" in engines:
        import importlib.util

        if importlib.util.find_spec("llama_cpp") is None:
            engines.remove("llama.cpp")
            print("llama-cpp-python is not installed here: the llama.cpp engine is left out "
                  "(pip install -e '.[llamacpp]'; benchmarks/gguf.md has its runs)", file=sys.stderr)
    return exports, engines


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    out = out_path(args.out, RESULT)
    if args.child:
        return child(args)
    if args.table:
        print(table(load_results(out)))
        return None
    exports, engines = check_args(args)
    keep = Path(args.keep)
    keep.mkdir(parents=True, exist_ok=True)
    windows_file = save_windows(keep, args.windows, args.seqlen)
    done = {(r["export"], r["engine"]) for r in load_results(out).get("rows", [])
            if r.get("windows") == args.windows and r.get("seqlen") == args.seqlen and r.get("status") != "failed"}
    data = load_results(out)
    for name in exports:
        todo = [e for e in engines_for(name, engines) if args.redo or (name, e) not in done]
        if not todo:
            continue
        ckpt, path = make_export(name, keep)
        for engine in todo:
            t0 = time.perf_counter()
            try:  # lowbit evaluates its own checkpoint, every other engine the exported file
                row = run_child("engines", ["--child", engine, "--export", name,
                                            "--path", str(ckpt if engine == "lowbit" else path),
                                            "--windows-file", str(windows_file), "--gen", str(args.gen)],
                                timeout=args.timeout, threads=1)
            except Exception as e:  # a crash or a timeout of the child: recorded
                row = {"status": "failed", "error": " ".join(str(e).split())[-400:]}
            row.update(export=name, engine=engine, recipe=EXPORTS[name].recipe, format=EXPORTS[name].to,
                       windows=args.windows, seqlen=args.seqlen, gen=args.gen,
                       wall_s=round(time.perf_counter() - t0, 1), machine=machine())
            data = merge_row(out, row, ("export", "engine"), prompt=PROMPT, exports={k: v.what for k, v in
                                                                                     EXPORTS.items()})
            print(f"{name:18s} {engine:18s} {row.get('status'):8s} ppl {row.get('ppl', float('nan')):.3f}",
                  flush=True)
    print(table(data))
    return None


def table(data: dict) -> str:
    """export x engine: perplexity (vs lowbit's own, %), or where the engine refused."""
    rows = data.get("rows", [])
    by = {(r["export"], r["engine"]): r for r in rows}
    names = [n for n in EXPORTS if any(k[0] == n for k in by)]
    engines = [e for e in ENGINES if any(k[1] == e for k in by)]

    def cell(name: str, engine: str) -> str:
        r = by.get((name, engine))
        if r is None:
            return ""
        if r.get("status") != "ok":
            return f"refused: {r.get('where') or r.get('error', '')[:60]}"
        own = by.get((name, "lowbit"), {}).get("ppl")
        rel = f" ({100 * (r['ppl'] / own - 1):+.2f}%)" if own and engine != "lowbit" else ""
        return f"{r['ppl']:.3f}{rel}, {r['gen_tok_s']} tok/s"

    return markdown_table(["export", *engines], [[n, *(cell(n, e) for e in engines)] for n in names])


if __name__ == "__main__":
    main(sys.argv[1:])
