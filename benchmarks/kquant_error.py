"""Weight error of K-quant rounding, like for like: lowbit plain, fit and searched, and llama.cpp's own Q4_K_M.

The Q4_K_M speed rows of `benchmarks/bigmodel.py` compare lowbit's streamed path with llama.cpp's quantizer,
and the two do different work unless their rounding is alike: lowbit's plain rule (``absmax``, what
``--no-search`` did before session 5) takes each sub-block's range as its scale, its searched rule fits
scales by least squares and refines the stored grid, llama.cpp (no importance matrix) searches 20 range
candidates per sub-block (``make_qkx2_quants``; Q6_K: ``make_qx_quants``). This script says which lowbit rule matches llama.cpp's quality: for a few matrices of a
checkpoint it reads llama.cpp's quantized tensor from its Q4_K_M GGUF (dequantized with gguf-py), quantizes the
same source matrix with lowbit to the same K type (the type llama.cpp's mix chose for it), plain, ``fit``
(`lowbit.formats.kquant_fit`, the K-quants' default since bigmodel.md's session 5) and searched,
and prints the relative squared error ``sum((w - w_q)^2) / sum(w^2)`` of each, in float64.

    python -m benchmarks.kquant_error --src ~/.cache/lowbit/bigmodel/tinyllama-1.1b --gguf Q4_K_M.gguf
    python -m benchmarks.kquant_error --synthetic .../llama_cpp/lib/libggml-base.so   # every K type, normal matrices

The GGUF comes from `benchmarks/bigmodel.py`'s ``llama.cpp-quantize`` tool (a BF16 GGUF of the checkpoint
through ``llama_model_quantize``, one thread). On the random checkpoints of bigmodel.py (normal weights)
the error measures the rounding rule alone, which is what the comparison needs; it is no statement about a
trained model's accuracy.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results" / "kquant_error.json"
KINDS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
         "mlp.up_proj", "mlp.down_proj")


def rel_error(w: torch.Tensor, wq: torch.Tensor) -> float:
    w64 = w.double()
    return float((w64 - wq.double()).pow(2).sum() / w64.pow(2).sum())


RULES = {"lowbit plain": "absmax", "lowbit fit": "fit", "lowbit search": "search"}


def lowbit_dequant(w: torch.Tensor, scheme: str, rule: str) -> tuple[torch.Tensor, float]:
    """lowbit's K-quant of ``w`` under ``rule`` (absmax / fit / search) dequantized, and the quantization's CPU seconds."""
    from lowbit.formats import Scheme, quantize

    s = Scheme.parse(scheme).replace(rule=rule)
    t = time.process_time()
    q = quantize(w, s)
    cpu = time.process_time() - t
    return q.dequantize(torch.float32), cpu


def rows_for(src: Path, gguf_path: Path, layers: list[int]) -> list[dict]:
    import gguf

    from lowbit.files import gguf_export as ge
    from lowbit.models.stream_source import StreamSource

    source = StreamSource.open(src)
    config = source.skeleton().config
    arch = ge.arch_of(config)
    names = ge._tensor_name_map(arch, config)
    reader = gguf.GGUFReader(str(gguf_path))
    by_name = {t.name: t for t in reader.tensors}
    rows = []
    for layer in layers:
        for kind in KINDS:
            key = f"model.layers.{layer}.{kind}.weight"
            t = by_name[ge._gguf_name(names, key)]
            gtype = t.tensor_type.name  # Q4_K / Q6_K: what llama.cpp's Q4_K_M mix chose for this matrix
            w = source.tensor(key).float()
            heads = ge._heads_for(key.rsplit(".", 1)[0], config, arch)
            if heads:  # llama.cpp's rows of q / k are in its rotary order
                w = w[ge.rope_rows(w.shape[0], heads)]
            ref = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).reshape(w.shape)
            row = {"tensor": key, "shape": list(w.shape), "type": gtype, "llama.cpp": rel_error(w, ref)}
            scheme = {"Q4_K": "q4_k", "Q6_K": "q6_k", "Q5_K": "q5_k", "Q3_K": "q3_k", "Q2_K": "q2_k"}[gtype]
            for rule, name in RULES.items():
                wq, cpu = lowbit_dequant(w, scheme, name)
                row[rule] = rel_error(w, wq)
                row[f"{rule} cpu s"] = round(cpu, 3)
            rows.append(row)
            print(f"{key:40} {gtype:5} llama.cpp {row['llama.cpp']:.5e}  plain {row['lowbit plain']:.5e}  "
                  f"fit {row['lowbit fit']:.5e}  search {row['lowbit search']:.5e}", flush=True)
    return rows


def summary(rows: list[dict]) -> dict:
    """Per K type, the weight-count-weighted mean of each rule's relative error and its ratio to llama.cpp's."""
    out: dict = {}
    for gtype in sorted({r["type"] for r in rows}):
        sel = [r for r in rows if r["type"] == gtype]
        n = sum(r["shape"][0] * r["shape"][1] for r in sel)
        mean = {k: sum(r[k] * r["shape"][0] * r["shape"][1] for r in sel) / n for k in ("llama.cpp", *RULES)}
        out[gtype] = {"tensors": len(sel), "weights": n, **{k: round(v, 8) for k, v in mean.items()},
                      **{f"{k} / llama.cpp": round(mean[k] / mean["llama.cpp"], 4) for k in RULES}}
    return out


def synthetic_rows(lib: str, seeds: int, shape: tuple[int, int] = (512, 4096)) -> list[dict]:
    """Every K type on seeded normal matrices (std 0.02): llama.cpp's own ``ggml_quantize_chunk`` (no importance,
    dequantized by gguf-py) beside lowbit's three rules: the types a Q4_K_M file does not use (Q2_K, Q3_K, Q5_K)
    checked too, since the default rule is every K type's."""
    import ctypes

    import gguf
    import numpy as np

    from lowbit.formats.kquants import KTYPES

    ggml = ctypes.CDLL(lib)
    fn = ggml.ggml_quantize_chunk
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_void_p]
    rows = []
    for seed in range(seeds):
        w = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02
        for bits, kt in KTYPES.items():
            qt = gguf.GGMLQuantizationType[kt.name]
            raw = np.zeros((shape[0], shape[1] // 256 * kt.block_bytes), dtype=np.uint8)
            wn = w.numpy().copy()
            ggml.ggml_quantize_init(int(qt))
            fn(int(qt), wn.ctypes.data, raw.ctypes.data, 0, shape[0], shape[1], None)
            ref = torch.from_numpy(gguf.quants.dequantize(raw, qt).copy()).reshape(w.shape)
            row = {"tensor": f"normal seed {seed}", "shape": list(shape), "type": kt.name, "llama.cpp": rel_error(w, ref)}
            for rule, name in RULES.items():
                row[rule] = rel_error(w, lowbit_dequant(w, f"q{bits}_k", name)[0])
            rows.append(row)
            print(f"{row['tensor']:14} {kt.name:5} llama.cpp {row['llama.cpp']:.5e}  "
                  + "  ".join(f"{k.split()[1]} {row[k] / row['llama.cpp']:.4f}x" for k in RULES), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", help="the safetensors checkpoint folder the GGUF was made from")
    ap.add_argument("--gguf", help="llama.cpp's Q4_K_M GGUF of that checkpoint")
    ap.add_argument("--layers", default="0,11,21")
    ap.add_argument("--synthetic", default=None, metavar="LIBGGML_BASE",
                    help="instead: every K type on seeded normal 512 x 4096 matrices, llama.cpp's ggml_quantize_chunk "
                    "from this libggml-base.so beside lowbit's rules (written under the JSON's 'synthetic' key)")
    ap.add_argument("--seeds", type=int, default=2, help="matrices of the --synthetic rows")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.synthetic:
        out = Path(args.out)
        old = json.loads(out.read_text()) if out.is_file() else {}
        rows = synthetic_rows(args.synthetic, args.seeds)
        old["synthetic"] = {"note": "seeded normal matrices (std 0.02), llama.cpp = ggml_quantize_chunk without "
                            "importance, dequantized by gguf-py", "summary": summary(rows), "rows": rows}
        out.write_text(json.dumps(old, indent=1))
        for gtype, s in old["synthetic"]["summary"].items():
            print(f"{gtype}: {s}")
        return
    if not (args.src and args.gguf):
        ap.error("--src and --gguf (or --synthetic)")
    rows = rows_for(Path(args.src).expanduser(), Path(args.gguf), [int(i) for i in args.layers.split(",")])
    summ = summary(rows)
    for gtype, s in summ.items():
        print(f"{gtype}: {s}")
    out = Path(args.out)
    keep = {k: v for k, v in json.loads(out.read_text()).items() if k == "synthetic"} if out.is_file() else {}
    out.write_text(json.dumps({
        "note": "relative squared weight error sum((w-wq)^2)/sum(w^2) per matrix; llama.cpp = its Q4_K_M GGUF "
                "(llama_model_quantize, no imatrix) dequantized by gguf-py; lowbit = the same matrix to the type "
                "llama.cpp chose, plain (rule=absmax), fit (rule=fit) and searched (rule=search); random normal "
                "weights: rounding only",
        "source": str(args.src), "summary": summ, "rows": rows, **keep}, indent=1))


if __name__ == "__main__":
    main()
