"""llama.cpp K-quant files of the bundled model: lowbit (searched RTN, SignRoundV2) vs llama.cpp's quantizer.

    python -m benchmarks.gguf [--mixes q4_k_m,q3_k_m,gguf:q2_k] [--methods rtn,gptq,signround2,llamacpp,llamacpp-imatrix]
                              [--seeds 0,1] [--iters 50] [--windows 8] [--seqlen 512] [--threads 2]
                              [--model offgrid]   (the off-grid copy; its files go in a subfolder of --keep)

Every file has the same per-tensor types, hence the same size: lowbit's mix plans reproduce
llama.cpp's ``llama_tensor_get_type`` and width fallbacks. With ``--embeddings f16`` (the
default, the rows before issue 39) the tied token embedding is F16 in every file (lowbit's
export is told ``embeddings="f16"``, llama.cpp's quantizer ``token_embedding_type =
output_tensor_type = F16``); with ``--embeddings llama.cpp`` every file has llama.cpp's own
default embedding types (the bundled model's tied 576-wide table: Q8_0), lowbit's
quantized by its search at export. Rows (merged into benchmarks/results/gguf.json as they
finish; ``embeddings`` is part of a row's identity):

- ``rtn``: lowbit's importance-weighted K-quant search (no tuning).
- ``signround2``: lowbit SignRoundV2 through the double-quantized scales, per seed.
- ``gptq``: lowbit GPTQ (act-order, static groups: every super-block's scales from the
  float weights, then column-by-column rounding with error feedback under them);
  ``gptq-noact``: columns in order, each super-block's scales chosen from the error-updated
  weights when GPTQ reaches it.
- ``autoround`` / ``autoround-rtn``: auto-round 0.16's GGUF export of the same file type from
  its tuned weights (``--iters``; 0 = its RTN), run in the peer's interpreter
  (``--peer-python``); q2_k is its q2_k_s (it has no plain Q2_K file type).
- ``llamacpp``: llama.cpp's own quantizer (``llama_model_quantize``) from an F32 GGUF of
  the same float weights, without an importance matrix.
- ``llamacpp-imatrix``: llama.cpp's quantizer with an importance matrix computed on the same
  calibration text. llama-cpp-python does not expose llama.cpp's imatrix tool nor a way to
  pass an imatrix to ``llama_model_quantize`` (it takes a C++ map), so each tensor is
  quantized by ggml's own ``ggml_quantize_chunk`` (the function llama-quantize calls) with
  the per-column mean of squared activations (what llama-imatrix collects), into the types
  llama.cpp's file has.

Perplexity through llama.cpp on lowbit's evaluation windows (same token ids for every
file), lowbit's own perplexity for lowbit's models, file bytes and seconds. NOTE: the
bundled SmolLM2-135M is itself a Q4_1 GGUF; its "float" weights are a 4-bit model
dequantized, which flatters every >= 4-bit re-quantization.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks import common

NAME = "gguf"
FTYPES = {"q4_k_m": 15, "q3_k_m": 12, "gguf:q2_k": 10, "q4_k_s": 14, "q3_k_s": 11, "q3_k_l": 13, "q2_k_s": 21,
          "q5_k_m": 17, "q5_k_s": 16, "gguf:q6_k": 18}
GGML_F16 = 1


def llamacpp_ppl(path: Path, windows: torch.Tensor, threads: int) -> float:
    from benchmarks.llamacpp import llamacpp_nll

    nll, n = llamacpp_nll(path, windows, threads)
    return math.exp(nll / n)


def lowbit_file(model, tokenizer, out: Path, mix: str, embeddings: str = "f16") -> dict:
    from lowbit.files import gguf_export
    from lowbit.models.loading import bundled_gguf

    # allow_requant: the float32 token embedding (dequantized Q4_1) is rounded to F16, as in
    # llama.cpp's files here; Q5_1 fallback mins are rounded to fp16 (llama.cpp's Q5_1 format)
    return gguf_export.export(model, tokenizer, out, allow_requant=True, source_gguf=bundled_gguf(),
                              file_type=gguf_export.FILE_TYPES.get(mix, 1), embeddings=embeddings)


# auto-round's GGUF presets for lowbit's mixes (auto-round has no plain Q2_K file type: its q2_k_s)
AUTOROUND = {"q2_k_s": "gguf:q2_k_s", "q3_k_m": "gguf:q3_k_m", "q4_k_m": "gguf:q4_k_m", "q3_k_s": "gguf:q3_k_s",
             "q4_k_s": "gguf:q4_k_s", "q5_k_m": "gguf:q5_k_m"}


def autoround_child(mix: str, out_dir: Path, iters: int, seed: int, nsamples: int, model: str = "bundled") -> dict:
    """auto-round's GGUF export of ``mix`` from its tuned weights (runs in the peer's interpreter).

    The same loader, float weights and calibration tokens as lowbit's rows. The token
    embedding (tied head) is F16 in every other file here; auto-round's converter gives a
    16-bit layer the file type's default type (Q8_0 / Q6_K), so its type selector is
    wrapped to answer F16 for that one tensor (``bits: 16`` in its layer_config keeps it
    out of tuning): equal file sizes, the same embedding bytes, Linears as auto-round makes
    them. auto-round converts through llama.cpp's converter and checks the checkpoint's
    tensor names, reading both from the model's folder: the loaded model is saved to one
    (safetensors) first.
    """
    import auto_round
    import gguf
    from auto_round import AutoRound
    from auto_round.export.export_to_gguf.gguf_dtype import GGUFDTypeSelector

    from lowbit.data import calibration_batches

    select = GGUFDTypeSelector.select_qtype

    def embedding_f16(self, name: str, n_dims: int, fallback_index: int = 0):
        if name.startswith(("token_embd.", "output.")):
            return gguf.GGMLQuantizationType.F16
        return select(self, name, n_dims, fallback_index)

    GGUFDTypeSelector.select_qtype = embedding_f16
    lm = common.bundled_model(threads=1, model=model)
    calib = calibration_batches(lm.tokenizer, nsamples=nsamples, seqlen=256)
    folder = tempfile.mkdtemp(prefix="ar-hf-")
    lm.model.save_pretrained(folder)
    lm.tokenizer.save_pretrained(folder)
    lm.model.name_or_path = folder
    lm.model.config._name_or_path = folder
    t0 = time.perf_counter()
    ar = AutoRound(lm.model, lm.tokenizer, scheme=AUTOROUND[mix], dataset=[r.unsqueeze(0) for r in calib],
                   nsamples=len(calib), seqlen=calib.shape[1], batch_size=8, iters=iters, seed=seed, amp=False,
                   device_map="cpu", layer_config={"model.embed_tokens": {"bits": 16}, "lm_head": {"bits": 16}})
    ar.quantize_and_save(str(out_dir), format=AUTOROUND[mix])
    files = sorted(out_dir.rglob("*.gguf"))
    return {"file": str(files[0]), "seconds": round(time.perf_counter() - t0, 1), "autoround": auto_round.__version__}


def run_autoround(python: str, mix: str, out: Path, iters: int, seed: int, nsamples: int,
                  model: str = "bundled") -> dict:
    """``autoround_child`` in a fresh process of the peer's interpreter; its file moved to ``out``."""
    import json
    import os
    import shutil
    import subprocess

    work = Path(tempfile.mkdtemp(prefix="ar-gguf-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{common.ROOT / 'src'}:{common.ROOT}"}
    cmd = [python, "-m", "benchmarks.gguf", "--autoround-child",
           json.dumps([mix, str(work), iters, seed, nsamples, model])]
    done = subprocess.run(cmd, cwd=common.ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"auto-round failed ({done.returncode}):\n{done.stderr[-3000:]}")
    info = json.loads(done.stdout.strip().splitlines()[-1])
    shutil.move(info["file"], out)
    shutil.rmtree(work, ignore_errors=True)
    return info


# lowbit's scheme for each GGUF type (the exact round trips of lowbit.files.gguf_export)
GGUF_SCHEMES = {"Q4_0": "w4g32", "Q4_1": "w4g32a", "Q5_0": "w5g32", "Q5_1": "w5g32a", "Q8_0": "w8g32",
                "Q2_K": "q2_k", "Q3_K": "q3_k", "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k"}


def plan_like(model, path: Path):
    """lowbit's plan with the per-tensor GGUF types of another tool's file: the same mix, the same size.

    auto-round's presets choose other types than llama.cpp for the same file-type name (e.g.
    Q5_0 where llama.cpp falls back to Q4_0), so its files are larger; comparing at equal
    size means quantizing to its types.
    """
    import gguf

    from lowbit.models import linear_layers
    from lowbit.plans.plan import Plan

    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    names = list(linear_layers(model))
    g = gguf_names(model, names)
    return Plan({n: GGUF_SCHEMES[types[g[n]]] for n in names})


def gguf_types(path: Path) -> dict[str, int]:
    """Tensor count per GGUF type of a file."""
    import gguf

    out: dict[str, int] = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        out[t.tensor_type.name] = out.get(t.tensor_type.name, 0) + 1
    return out


def float_file(model, out: Path) -> None:
    from lowbit.files import gguf_export
    from lowbit.models.loading import bundled_gguf

    gguf_export.export(model, None, out, source_gguf=bundled_gguf())


def llamacpp_quantize(src: Path, out: Path, mix: str, threads: int, embeddings: str = "f16") -> None:
    import llama_cpp

    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = FTYPES[mix]
    p.nthread = threads
    if embeddings == "f16":  # otherwise llama.cpp's own choice (its default file)
        p.token_embedding_type = GGML_F16
        p.output_tensor_type = GGML_F16
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(p))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize failed ({rc})")


def _ggml():
    import llama_cpp

    libdir = Path(llama_cpp.__file__).parent / "lib"
    for name in ("libggml-base.so", "libggml.so"):
        if (libdir / name).exists():
            lib = ctypes.CDLL(str(libdir / name))
            if hasattr(lib, "ggml_quantize_chunk"):
                lib.ggml_quantize_chunk.restype = ctypes.c_size_t
                lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                                    ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
                return lib
    raise RuntimeError(f"no ggml_quantize_chunk in {libdir}")


def ggml_quantize(w: np.ndarray, qtype: int, imatrix: np.ndarray | None, row_bytes: int) -> np.ndarray:
    """ggml's own quantizer (what llama-quantize runs per tensor), with an importance matrix."""
    lib = _ggml()
    w = np.ascontiguousarray(w, dtype=np.float32)
    rows, cols = w.shape
    dst = np.zeros((rows, row_bytes), dtype=np.uint8)
    imp = None if imatrix is None else np.ascontiguousarray(imatrix, dtype=np.float32)
    n = lib.ggml_quantize_chunk(qtype, w.ctypes.data, dst.ctypes.data, 0, rows, cols,
                                None if imp is None else imp.ctypes.data)
    if n != dst.nbytes:
        raise RuntimeError(f"ggml_quantize_chunk wrote {n} bytes, expected {dst.nbytes}")
    return dst


def imatrix_file(float_path: Path, types_from: Path, out: Path, imatrix: dict[str, np.ndarray]) -> None:
    """llama.cpp's file ``types_from`` re-quantized from ``float_path`` with per-tensor importance."""
    import gguf

    ref = gguf.GGUFReader(str(types_from))
    src = {t.name: t for t in gguf.GGUFReader(str(float_path)).tensors}
    w = gguf.GGUFWriter(str(out), ref.fields["general.architecture"].contents())
    for key, field in ref.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for t in ref.tensors:
        if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor(t.name, np.array(t.data))
            continue
        f = np.array(src[t.name].data, dtype=np.float32).reshape(-1, int(t.shape[0]))
        raw = ggml_quantize(f, int(t.tensor_type), imatrix.get(t.name), int(t.data.shape[-1]))
        w.add_tensor(t.name, raw, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()


def retable_file(src: Path, float_path: Path, out: Path) -> None:
    """``src`` with its ``token_embd`` rewritten from the float file as ggml's own Q8_0 (abs-max RTN, what
    llama-quantize writes), every other tensor and key as they were: the table quantizer's share of a file's
    perplexity, measured through llama.cpp."""
    import gguf

    ref = gguf.GGUFReader(str(src))
    table_f32 = next(np.array(t.data, dtype=np.float32) for t in gguf.GGUFReader(str(float_path)).tensors
                     if t.name == "token_embd.weight")
    w = gguf.GGUFWriter(str(out), ref.fields["general.architecture"].contents())
    for key, field in ref.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        w.add_key_value(key, field.contents(), vtype, sub_type=field.types[1] if vtype == gguf.GGUFValueType.ARRAY
                        else None)
    for t in ref.tensors:
        if t.name != "token_embd.weight":
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
        else:
            q8 = gguf.GGMLQuantizationType.Q8_0
            raw = ggml_quantize(table_f32, int(q8), None, table_f32.shape[1] // 32 * gguf.GGML_QUANT_SIZES[q8][1])
            w.add_tensor(t.name, raw, raw_dtype=q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()


def retable_rows(src: Path, float_path: Path, win: torch.Tensor, args: argparse.Namespace) -> dict:
    """lowbit's searched Q8_0 table vs ggml's abs-max Q8_0 table in otherwise the same file (issue 39: is the
    export's search on the 49152 x 576 table worth its time?)."""
    other = src.with_name(f"{src.stem}-table-ggml-q8_0.gguf")
    retable_file(src, float_path, other)
    for table, path in (("lowbit-search", src), ("ggml-q8_0", other)):
        row = {"file": src.name, "table": table, "windows": args.windows, "seqlen": args.seqlen,
               "file_bytes": path.stat().st_size, "ppl_llamacpp": llamacpp_ppl(path, win, args.threads),
               **common.model_fields(args.model)}
        common.merge_row("gguf_table", row, ("file", "table", "windows", "model"))
        print(row, flush=True)
    return common.load_results("gguf_table")


def gguf_imatrix(model, calib: torch.Tensor, names: list[str]) -> dict[str, np.ndarray]:
    """Per GGUF tensor name, the mean squared input activation per column (llama-imatrix's statistic)."""

    from lowbit.models.activations import importance

    imp = importance(model, calib, names)
    tokens = calib.numel()
    return {gguf_names(model, [n])[n]: (v / tokens).numpy() for n, v in imp.items()}


def gguf_names(model, names: list[str]) -> dict[str, str]:
    """HF Linear name -> GGUF tensor name (llama layout)."""
    import gguf

    nmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, model.config.num_hidden_layers)
    return {n: nmap.get_name(f"{n}.weight", try_suffixes=(".weight",)) for n in names}


def weight_errors(model, imatrix: dict[str, np.ndarray], nmap_names: dict[str, str]) -> list[dict]:
    """Importance-weighted relative error of every K type on the layers whose rows fit 256:
    lowbit's search vs ggml's quantizer with the same importance (llama.cpp's make_qkx* search)."""
    import gguf

    from lowbit.formats import Scheme, quantize

    rows = []
    for bits in (2, 3, 4, 5, 6):
        num_l = num_g = den = 0.0
        t0 = time.perf_counter()
        for hf, gg in nmap_names.items():
            w = model.get_submodule(hf).weight.detach().float()
            if w.shape[1] % 256 or gg not in imatrix:
                continue
            imp = torch.from_numpy(imatrix[gg])
            ours = quantize(w, Scheme.parse(f"q{bits}_k:rule=search"), imp).dequantize()
            qt = gguf.GGMLQuantizationType[f"Q{bits}_K"]
            raw = ggml_quantize(w.numpy(), int(qt), imatrix[gg], w.shape[1] // 256 * gguf.GGML_QUANT_SIZES[qt][1])
            theirs = torch.from_numpy(gguf.quants.dequantize(raw, qt)).reshape(w.shape)
            num_l += float((((ours - w) ** 2) * imp).sum())
            num_g += float((((theirs - w) ** 2) * imp).sum())
            den += float(((w**2) * imp).sum())
        rows.append({"mix": f"q{bits}_k", "method": "weight-error", "seed": None,
                     "lowbit_search": num_l / den, "ggml_imatrix": num_g / den,
                     "seconds": round(time.perf_counter() - t0, 1)})
    return rows


def _key(r: dict) -> tuple:
    """A row's identity; rows older than the per-row calibration size were all 16 x 256, rows older than the
    off-grid model all on the bundled one."""
    return (r.get("mix"), r.get("method"), r.get("seed"), r.get("nsamples", 16), r.get("model", "bundled"),
            r.get("embeddings", "f16"))


def table(data: dict, model: str = "bundled") -> str:
    """Markdown table of the perplexity rows on ``model``: per mix and method (and calibration size), mean over
    seeds."""
    groups: dict[tuple, list[dict]] = {}
    rows_of_model = [r for r in data.get("rows", []) if r.get("model", "bundled") == model]
    for r in rows_of_model:
        if r.get("method") != "weight-error":
            n = r.get("nsamples", 16)
            emb = r.get("embeddings", "f16")  # rows at llama.cpp's embedding types are other files (issue 39)
            label = r["method"] + ("" if n == 16 else f" ({n} x 256 calib)") + ("" if emb == "f16" else f", {emb} emb.")
            groups.setdefault((r["mix"], label), []).append(r)
    rows = []
    for (mix, method), rs in sorted(groups.items()):
        def mean(k, rs=rs, digits=3):
            v = [r[k] for r in rs if r.get(k) is not None]
            return f"{sum(v) / len(v):.{digits}f}" + (f" ({', '.join(f'{x:.2f}' for x in v)})" if len(v) > 1 else "") \
                if v else "-"
        rows.append([mix, method, len(rs), mean("ppl_llamacpp"), mean("ppl_lowbit"),
                     f"{rs[0]['file_bytes'] / 2**20:.1f}", mean("seconds", digits=0)])
    out = common.markdown_table(["mix", "method", "runs", "ppl llama.cpp (mean, runs)", "ppl lowbit", "file MiB",
                                 "seconds"], rows)
    err = [r for r in rows_of_model if r.get("method") == "weight-error"]
    if err:
        out += "\n\n" + common.markdown_table(
            ["type", "lowbit search", "ggml + imatrix", "ratio"],
            [[r["mix"], f"{r['lowbit_search']:.5f}", f"{r['ggml_imatrix']:.5f}",
              f"{r['lowbit_search'] / r['ggml_imatrix']:.3f}"] for r in err])
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mixes", default="q4_k_m,q3_k_m,gguf:q2_k")
    p.add_argument("--methods", default="rtn,gptq,signround2,llamacpp,llamacpp-imatrix")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--nsamples", type=int, default=16)
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--keep", default=None, help="folder to keep the GGUF files in")
    p.add_argument("--eval-missing", action="store_true",
                   help="only fill in llama.cpp perplexities of kept lowbit files whose rows lack one")
    p.add_argument("--table", action="store_true", help="print the markdown table of the results file and stop")
    p.add_argument("--like", default=None, metavar="FILE",
                   help="a GGUF file in --keep (e.g. auto-round's): lowbit's and the imatrix rows take its per-tensor "
                        "types (one --mixes entry; rows recorded as MIX~FILE)")
    p.add_argument("--peer-python", default=None, help="python of a venv with auto-round 0.16 (autoround rows)")
    p.add_argument("--model", choices=common.MODELS, default="bundled", help=common.MODEL_HELP)
    p.add_argument("--embeddings", choices=("f16", "llama.cpp"), default="f16",
                   help="token_embd / output: F16 in every file, or llama.cpp's default types in every file")
    p.add_argument("--retable", default=None, metavar="FILE",
                   help="a lowbit GGUF in --keep: its token_embd rewritten as ggml's own Q8_0 (abs-max RTN), both "
                        "files' perplexity through llama.cpp on --windows (rows in gguf_table.json)")
    p.add_argument("--autoround-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.autoround_child:
        import json

        mix, work, iters, seed, nsamples, model = json.loads(args.autoround_child)
        print(json.dumps(autoround_child(mix, Path(work), iters, seed, nsamples, model)), flush=True)
        return {}
    if args.table:
        print(table(common.load_results(NAME), args.model))
        return common.load_results(NAME)

    from lowbit.api import build_plan
    from lowbit.data import calibration_batches, eval_tokens
    from lowbit.eval import perplexity
    from lowbit.eval.perplexity import eval_windows
    from lowbit.models import linear_layers
    from lowbit.models.activations import importance
    from lowbit.ptq.gptq import GPTQSettings, gptq_quantize
    from lowbit.ptq.rtn import rtn_quantize
    from lowbit.ptq.signround import make_config, signround_quantize

    lm = common.bundled_model(threads=args.threads, model=args.model)
    tokens = eval_tokens(lm.tokenizer)
    win = eval_windows(tokens, args.seqlen, args.windows)
    calib = calibration_batches(lm.tokenizer, nsamples=args.nsamples, seqlen=256)
    methods = args.methods.split(",")
    folder = Path(args.keep or tempfile.mkdtemp(prefix="lowbit-gguf-"))
    if args.model != "bundled":  # the same file names, another model's weights
        folder = folder / args.model
    folder.mkdir(parents=True, exist_ok=True)
    setup = {"model": "SmolLM2-135M-Instruct (bundled; its weights are a dequantized Q4_1 GGUF); rows with "
                      "model=offgrid: its off-grid copy (benchmarks/results/offgrid.md)",
             "windows": args.windows, "seqlen": args.seqlen, "calib": f"{args.nsamples} x 256 tokens",
             "machine": common.machine(),
             "embedding": "F16 in every file (bundled: tied token_embd/output; offgrid: token_embd and the untied "
                          "output both F16); rows with embeddings=llama.cpp: llama.cpp's default types (bundled: "
                          "the tied table Q8_0), lowbit's quantized by its export"}

    def record(row: dict) -> None:
        row.setdefault("nsamples", args.nsamples)
        if args.embeddings != "f16" and row.get("method") not in ("float", "weight-error"):
            row.setdefault("embeddings", args.embeddings)
        row.update(common.model_fields(args.model))
        if args.model == "bundled":
            common.merge_row(NAME, row, _key, setup=setup)
        else:  # the file's setup describes the bundled rows' run: another model's row carries its own
            common.merge_row(NAME, dict(row, setup=setup), _key)
        print(row, flush=True)

    if args.eval_missing:
        for row in common.load_results(NAME)["rows"]:
            if row.get("model", "bundled") != args.model:
                continue
            f = folder / str(row.get("file"))
            if row.get("ppl_llamacpp") is None and f.is_file():
                record(dict(row, ppl_llamacpp=llamacpp_ppl(f, win, args.threads)))
        return common.load_results(NAME)
    float_path = folder / "float-f32.gguf"
    if not float_path.exists():
        float_file(lm.model, float_path)
    if args.retable:
        return retable_rows(folder / args.retable, float_path, win, args)
    if "float" in methods:
        record({"mix": "f32", "method": "float", "seed": None, "file_bytes": float_path.stat().st_size,
                "ppl_llamacpp": llamacpp_ppl(float_path, win, args.threads),
                "ppl_lowbit": perplexity(lm.model, tokens, args.seqlen, args.windows, progress=False).ppl})
    imatrix, imp = None, None
    if "weight-error" in methods:
        names = list(linear_layers(lm.model))
        imatrix = gguf_imatrix(lm.model, calib, names)
        for row in weight_errors(lm.model, imatrix, gguf_names(lm.model, names)):
            record(row)
    like = None if args.like is None else folder / args.like
    if args.embeddings != "f16" and "autoround" in methods:
        raise SystemExit("autoround rows keep F16 embeddings (its export is patched so): run them with --embeddings f16")
    if like is not None and ("," in args.mixes or not like.is_file()):
        raise SystemExit("--like takes a GGUF file in the --keep folder and one --mixes entry")
    for mix in args.mixes.split(","):
        tag = mix.replace(":", "-") + ("" if args.embeddings == "f16" else "-emb")
        label = mix  # the mix as rows name it: with --like, the other file's types
        if like is not None:
            tag, label = f"{tag}~{like.stem}", f"{mix}~{like.stem}"
        ref = folder / f"llamacpp-{tag}.gguf"
        if "llamacpp" in methods or ("llamacpp-imatrix" in methods and like is None):
            t0 = time.perf_counter()
            llamacpp_quantize(float_path, ref, mix, args.threads, args.embeddings)
            if "llamacpp" in methods:
                record({"mix": mix, "method": "llamacpp", "seed": None, "file_bytes": ref.stat().st_size,
                        "seconds": round(time.perf_counter() - t0, 1),
                        "ppl_llamacpp": llamacpp_ppl(ref, win, args.threads)})
        if "llamacpp-imatrix" in methods:
            if imatrix is None:
                imatrix = gguf_imatrix(lm.model, calib, list(linear_layers(lm.model)))
            out = folder / f"llamacpp-imatrix-{tag}.gguf"
            t0 = time.perf_counter()
            imatrix_file(float_path, like or ref, out, imatrix)
            record({"mix": label, "method": "llamacpp-imatrix", "seed": None, "file_bytes": out.stat().st_size,
                    "seconds": round(time.perf_counter() - t0, 1),
                    "ppl_llamacpp": llamacpp_ppl(out, win, args.threads)})
        if "rtn" in methods and imp is None:  # one importance pass serves every mix
            imp = importance(lm.model, calib, list(linear_layers(lm.model)))
        if "autoround" in methods:
            if args.peer_python is None or mix not in AUTOROUND:
                raise SystemExit(f"autoround rows need --peer-python and a mix auto-round has ({sorted(AUTOROUND)})")
            for seed in (int(x) for x in args.seeds.split(",")):
                out = folder / f"autoround-{args.iters}it-{seed}-{tag}.gguf"
                info = run_autoround(args.peer_python, mix, out, args.iters, seed, args.nsamples, args.model)
                method = "autoround" if args.iters else "autoround-rtn"  # iters 0: its RTN (no tuning)
                record({"mix": mix, "method": method, "seed": seed, "file": out.name,
                        "file_bytes": out.stat().st_size, "seconds": info["seconds"], "iters": args.iters,
                        "autoround": info["autoround"], "types": gguf_types(out),
                        "ppl_llamacpp": llamacpp_ppl(out, win, args.threads)})
        runs = [(m, None) for m in ("rtn", "gptq", "gptq-noact") if m in methods]
        runs += [("signround2", int(s)) for s in args.seeds.split(",")] if "signround2" in methods else []
        for method, seed in runs:
            model = copy.deepcopy(lm.model)
            plan = build_plan(model, mix) if like is None else plan_like(model, like)
            t0 = time.perf_counter()
            if method == "rtn":
                rtn_quantize(model, plan, calib, search=True, imp=imp, progress=False)
            elif method.startswith("gptq"):  # gptq-noact: columns in order, each super-block's scales chosen
                settings = GPTQSettings(act_order=False, static_groups=False) if method == "gptq-noact" \
                    else GPTQSettings()  # from the error-updated weights when GPTQ reaches it
                gptq_quantize(model, plan, settings, calib, progress=False)
            else:
                signround_quantize(model, plan, make_config(iters=args.iters, v2=True, seed=seed), calib,
                                   progress=False)
            seconds = round(time.perf_counter() - t0, 1)
            out = folder / f"lowbit-{method}-{seed}-{tag}.gguf"
            t0 = time.perf_counter()
            info = lowbit_file(model, lm.tokenizer, out, mix, args.embeddings)
            row = {"mix": label, "method": method, "seed": seed, "file": out.name, "file_bytes": out.stat().st_size,
                   "seconds": seconds, "export_seconds": round(time.perf_counter() - t0, 1),
                   **({"iters": args.iters} if method == "signround2" else {}),
                   "ppl_lowbit": perplexity(model, tokens, args.seqlen, args.windows, progress=False).ppl,
                   "types": info["types"], "verified_tensors": info["verified"],
                   "not_exact": info["requantized"] + info.get("rounded_to_f16", [])}
            try:
                row["ppl_llamacpp"] = llamacpp_ppl(out, win, args.threads)
            except ImportError:
                row["ppl_llamacpp"] = None
            record(row)
            del model
    return common.load_results(NAME)


if __name__ == "__main__":
    main(sys.argv[1:])
