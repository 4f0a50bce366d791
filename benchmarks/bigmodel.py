"""Models bigger than the machine: the data-free streaming path (``lowbit quantize --stream``) at real shapes.

Random-weight bf16 checkpoints are built once (sharded safetensors, one tensor in memory at a
time) and cached under ``~/.cache/lowbit/bigmodel/<shape>``, at the TinyLlama-1.1B,
Llama-3.2-3B and (when the disk allows) Llama-3.1-8B shapes. Random weights measure time and
memory, not quality: nothing here says anything about accuracy.

Each row runs ``python -m lowbit quantize SRC --stream --scheme S --no-search --out OUT --json`` as a child
process and records its wall seconds, its peak RSS as the kernel reports it for that child
(``os.wait4``'s ``ru_maxrss``: resident pages, file-backed ones included, not Python's
allocator) and the output's bytes. Rows use plain round-to-nearest (``--no-search``), what llm-compressor's
``model_free_ptq`` and auto-round's ``iters=0`` do too: RTN's scale search costs about 25x the CPU of plain
rounding for INT and 30x-70x for K-quants and FP8 (a 256 x 2048 matrix on this machine: w4g128 0.22 s
plain vs 5.6 s searched, q4_k 0.75 s vs 23 s, fp8 48.7 s searched), the same in and out of the streaming
path, so a searched row at 1.1B would take hours on 2 shared cores; ``--search`` runs it anyway. The ``read`` row is the physical floor measured in the same
run: a child that only reads every source tensor (the same reader, no quantization).

    python -m benchmarks.bigmodel --shapes tinyllama-1.1b,llama-3.2-3b --schemes w4g128,nvfp4-46,q4_k_m,fp8
    python -m benchmarks.bigmodel --table

Tools: ``lowbit-stream`` (lowbit's native checkpoint), ``lowbit-stream-gguf`` (``--export-to gguf``: llama.cpp's
file written tensor by tensor, e.g. q4_k_m), ``llama.cpp-quantize`` (llama.cpp's own quantizer through
llama-cpp-python, ``--llama-python``, from a BF16 GGUF of the checkpoint written first and untimed: llama.cpp
quantizes GGUF files only; its Q4_K search is its own ``make_qkx2_quants``, beside lowbit's K-quant rule: plain
ranges before session 5, the ``fit`` rule since, the row's ``rule``),
``llmc-model_free_ptq``, ``autoround-rtn`` / ``autoround-rtn-blocks`` (auto-round's ``iters=0`` with plain rounding:
its model-free route / its model path, ``--autoround-python``; see ``AUTOROUND_RTN``) and ``read``.

Peer: llm-compressor's ``model_free_ptq`` (safetensors file by file, no model built; plain RTN) on the
same checkpoints: W4A16 (int4 g128 symmetric) beside w4g128, FP8_DYNAMIC (per-channel FP8 weights) beside
fp8, NVFP4A16 beside nvfp4-46; no K-quant counterpart. llm-compressor 0.14.0.1 pins an older transformers,
so it is installed apart, without its dependencies, and put on the path of lowbit's own environment::

    .venv/bin/pip install --target /tmp/llmc --no-deps llmcompressor==0.14.0.1 loguru datasets pyarrow dill \
        multiprocess xxhash pandas python-dateutil pytz tzdata
    python -m benchmarks.bigmodel --peer-path /tmp/llmc ...
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

CACHE = Path.home() / ".cache" / "lowbit" / "bigmodel"
RESULTS = Path(__file__).parent / "results" / "bigmodel.json"
SHAPES = {  # the public configs' sizes (random weights)
    "tinyllama-1.1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                           num_attention_heads=32, num_key_value_heads=4, tie_word_embeddings=False),
    "llama-3.2-3b": dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                         rope_theta=500000.0),
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
                         rope_theta=500000.0),
}
SHARD_BYTES = 2 << 30
LLMC = {"w4g128": "W4A16", "fp8": "FP8_DYNAMIC", "nvfp4-46": "NVFP4A16"}  # llm-compressor presets, same weights


def build(shape: str) -> Path:
    """The cached random bf16 checkpoint of ``shape`` (built once, atomically: a partial build is rebuilt)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lowbit.files.safetensors_stream import write_file
    from lowbit.nn.meta import params_on_meta

    final = CACHE / shape
    if (final / "complete.json").is_file():
        return final
    if final.exists():  # a build of an older version of this script, interrupted: never complete
        shutil.rmtree(final)
    # built in a hidden folder beside it and renamed when complete, so a reader (another benchmark
    # waiting for the 8B checkpoint) never sees a half-written one; a killed build starts over
    folder = CACHE / f".{shape}.building"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    config = LlamaConfig(**SHAPES[shape])
    with params_on_meta():
        model = LlamaForCausalLM(config)
    state = {k: v for k, v in model.state_dict().items() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    gen = torch.Generator().manual_seed(0)
    groups: list[list[str]] = [[]]
    size = 0
    for k, v in state.items():
        n = v.numel() * 2
        if groups[-1] and size + n > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += n
    weight_map = {}
    for i, names in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for k in names:
            shp = tuple(state[k].shape)
            t = torch.ones(shp) if len(shp) == 1 else torch.randn(shp, generator=gen) * 0.02
            tensors[k] = t.to(torch.bfloat16)
            weight_map[k] = fname
        write_file(folder / fname, tensors, {"format": "pt"})
        del tensors
        print(f"{shape}: wrote {fname}", file=sys.stderr, flush=True)
    total = sum(state[k].numel() * 2 for k in weight_map)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    config.save_pretrained(folder)
    (folder / "complete.json").write_text(json.dumps({"bytes": total, "random": True}))
    os.replace(folder, final)
    return final


# The child is started by this small launcher, which forks and execs the command and reports the command's own
# wait4 figures: a process's ru_maxrss starts from the high-water mark of the memory it was forked from (exec
# records the old address space's peak: with vfork, which subprocess uses, that is the parent's peak so far), so a
# child started straight from this script would report this script's peak whenever it exceeded the child's (the
# 3B BF16 GGUF written here before the llama.cpp row: 3.3 GiB reported for both tools' rows in that run).
LAUNCH = """import os, sys, time
t = time.perf_counter()
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, ru = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(repr((os.waitstatus_to_exitcode(status), time.perf_counter() - t, ru.ru_utime + ru.ru_stime, ru.ru_maxrss)))
"""


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants now (``/proc``; 0 where they are gone).

    ``wait4``'s ``ru_maxrss`` is the largest peak of the child and the descendants it reaped, not their sum: a tool
    that quantizes in worker processes (auto-round's model-free path spawns one) holds both at once, so its rows
    also carry this sum, sampled while it runs (a lower bound of the true simultaneous peak: samples are 1 s apart).
    """
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    family, grew = {pid}, True
    while grew:
        more = {c for c, par in parents.items() if par in family} - family
        family |= more
        grew = bool(more)
    total = 0
    for q in family:
        try:
            total += int(Path(f"/proc/{q}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
    return total


def child(cmd: list[str], log: Path, env: dict | None = None, loads: list[float] | None = None,
          tree: list[int] | None = None) -> tuple[int, float, float, int]:
    """(exit code, wall seconds, CPU seconds, peak RSS bytes from the kernel) of one child process.

    CPU seconds (user + system) are reported beside the wall time because this machine is shared:
    under contention the wall time measures the neighbours as much as the tool. The peak is the command's own
    (started through ``LAUNCH``, a ~10 MB interpreter, not from this process: see there). ``loads`` receives the
    1-minute load average sampled every few seconds while the child runs, so a row says how busy the machine was
    during it, not only at its end. ``tree`` (when given) receives `tree_rss` of the command's process tree, sampled
    every second.
    """
    t0 = time.perf_counter()
    samples = loads if loads is not None else []
    samples.append(os.getloadavg()[0])
    rusage = log.with_name(log.name + ".rusage")
    rusage.unlink(missing_ok=True)
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, "-S", "-E", "-c", LAUNCH, str(rusage), *cmd], stdout=f,
                             stderr=subprocess.STDOUT, env=env)
        while p.poll() is None:
            time.sleep(0.2 if time.perf_counter() - t0 < 5 else 1.0 if tree is not None else 5.0)
            samples.append(os.getloadavg()[0])
            if tree is not None:
                tree.append(tree_rss(p.pid))
    if not rusage.is_file():  # the launcher itself failed (killed): what wait4 says of it
        return p.returncode, time.perf_counter() - t0, 0.0, 0
    import ast

    rc, wall, cpu, maxrss = ast.literal_eval(rusage.read_text())
    rusage.unlink()
    return rc, wall, cpu, maxrss * 1024


def cpu_model() -> str:
    """This machine's CPU as rows name it (model, AVX-512 or not): CPU seconds of different machines differ, so rows
    of one shape / scheme / tool measured on different CPUs are kept side by side (``save``'s key), not replaced.
    /proc/cpuinfo is read by `lowbit.nn.precision`'s parser (``""`` where there is none)."""
    from lowbit.nn.precision import _cpu_flags, _cpuinfo_field

    flags = _cpu_flags()
    return f"{_cpuinfo_field('model name')}{' AVX-512' if 'avx512f' in flags else ''}{' AMX' if 'amx_tile' in flags else ''}"


def _size(path: Path) -> int:
    if path.is_file():  # a one-file output (GGUF)
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def bf16_gguf(src: Path, work: Path) -> Path:
    """The checkpoint as a BF16 GGUF (llama.cpp's quantizer reads GGUF only), written one tensor at a time with
    gguf-py under lowbit's GGUF names, q/k rows in llama.cpp's order; no tokenizer (quantizing needs none)."""
    import gguf
    import numpy as np
    import torch

    from lowbit.files import gguf_export as ge
    from lowbit.models.stream_source import StreamSource

    out = work / f"{src.name}-bf16.gguf"
    if out.is_file():
        return out
    source = StreamSource.open(src)
    model = source.skeleton()
    config, arch = model.config, ge.arch_of(model.config)
    names = ge._tensor_name_map(arch, config)
    keys = [k for k in source.entries if "rotary" not in k]
    tmp = out.with_suffix(".partial")
    w = gguf.GGUFWriter(str(tmp), arch.gguf)
    ge.add_model_metadata(w, config, src.name, arch, 32)  # LlamaFileType.MOSTLY_BF16
    for k in keys:
        e = source.entries[k]
        raw = gguf.GGMLQuantizationType.BF16 if len(e.shape) > 1 else None
        shape = (*e.shape[:-1], e.shape[-1] * 2) if raw else e.shape
        w.add_tensor_info(ge._gguf_name(names, k), shape, np.dtype(np.uint8 if raw else np.float32),
                          e.numel * (2 if raw else 4), raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for k in keys:
        t = source.tensor(k)
        heads = ge._heads_for(k.rsplit(".", 1)[0], config, arch)
        if heads and t.dim() == 2:
            t = t[ge.rope_rows(t.shape[0], heads)]
        arr = t.to(torch.bfloat16).view(torch.uint8).numpy() if t.dim() > 1 else t.float().numpy()
        w.write_tensor_data(arr)
    w.close()
    os.replace(tmp, out)
    return out


LLAMA_CPP_QUANTIZE = """import sys, llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = {"q4_k_m": 15}[sys.argv[3]]
p.nthread = 1
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p)
sys.exit(rc)
"""


# auto-round's RTN (`iters=0`) with plain rounding (`disable_opt_rtn=True`: its full-range symmetric int4 from each
# group's extreme, fp16 scales, what lowbit's w4g128 with --no-search computes); without it, iters=0 is its
# "optimized RTN", which needs calibration data (an importance matrix) and searches 300 scales per group. With a path
# and plain RTN it routes itself to its model-free path (safetensors shard by shard in a spawned worker process);
# "blocks" forces its model path instead (`disable_model_free`: the model built, each block quantized in turn).
AUTOROUND_RTN = """import sys, torch
torch.set_num_threads(int(sys.argv[4]))
from auto_round import AutoRound
kw = {"disable_model_free": True} if sys.argv[3] == "blocks" else {}
ar = AutoRound(sys.argv[1], scheme="W4A16", iters=0, disable_opt_rtn=True, device_map="cpu", **kw)
ar.quantize_and_save(sys.argv[2], format="auto_round")
"""
AUTOROUND = {"w4g128": "W4A16"}  # auto-round presets holding the same weights


def run_row(shape: str, scheme: str, tool: str, src: Path, work: Path, search: bool = False,
            peer_path: str | None = None, llama_python: str | None = None, threads: int | None = None,
            keep: bool = False, autoround_python: str | None = None) -> dict:
    out = work / f"{shape}-{scheme}-{tool}"
    log = work / f"{shape}-{scheme}-{tool}.log"
    py = sys.executable
    env = None
    if tool == "llama.cpp-quantize":  # the BF16 GGUF it reads is made first, untimed
        out = out.with_suffix(".gguf")
        cmd = [llama_python, "-c", LLAMA_CPP_QUANTIZE, str(bf16_gguf(src, work)), str(out), scheme]
    elif tool == "lowbit-stream-gguf":
        out = out.with_suffix(".gguf")
        cmd = [py, "-m", "lowbit", "quantize", str(src), "--stream", "--scheme", scheme, "--out", str(out),
               "--export-to", "gguf", "--force", "--json", "--search" if search else "--no-search"]
    elif tool == "llmc-model_free_ptq":
        env = {**os.environ, "PYTHONPATH": str(peer_path)}
        pin = f"import torch; torch.set_num_threads({threads}); " if threads else ""
        cmd = [py, "-c", pin + "import sys; from llmcompressor import model_free_ptq; model_free_ptq(sys.argv[1], "
               "sys.argv[2], scheme=sys.argv[3], ignore=['lm_head'], max_workers=1, device='cpu')", str(src), str(out),
               LLMC[scheme]]
    elif tool.startswith("autoround-rtn"):  # autoround-rtn (its model-free route), autoround-rtn-blocks
        # one thread in the spawned worker too (it does not inherit torch.set_num_threads); no network
        env = {**os.environ, "OMP_NUM_THREADS": str(threads or 1), "AR_MODEL_FREE_SHARD_PARALLELISM": "1",
               "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
        # its model path loads a tokenizer, which these checkpoints lack: the links + tokenizer folder of
        # bigmodel_calib.py's rows
        from benchmarks.bigmodel_calib import prepare

        where = prepare(shape) if tool.endswith("-blocks") else src
        cmd = [autoround_python, "-c", AUTOROUND_RTN, str(where), str(out),
               "blocks" if tool.endswith("-blocks") else "free", str(threads or 1)]
    elif tool == "read":
        cmd = [py, "-c", "import sys; from pathlib import Path; from lowbit.models.stream_source import StreamSource; "
               "s = StreamSource.open(Path(sys.argv[1]))\nfor n in s.entries: s._raw(n)", str(src)]
    else:
        cmd = [py, "-m", "lowbit", "quantize", str(src), "--stream", "--scheme", scheme, "--out", str(out),
               "--force", "--json", "--search" if search else "--no-search"]
    if threads and tool.startswith("lowbit"):
        cmd += ["--threads", str(threads)]
    loads: list[float] = []
    tree: list[int] | None = [] if tool.startswith("autoround") else None
    rc, secs, cpu, rss = child(cmd, log, env, loads, tree)
    row = {"shape": shape, "scheme": scheme, "tool": tool, "rc": rc, "seconds": round(secs, 1),
           "cpu_seconds": round(cpu, 1), "search": search and tool.startswith("lowbit"), "load_avg_1m": round(os.getloadavg()[0], 1),
           "load_avg_1m_during": [round(min(loads), 1), round(sorted(loads)[len(loads) // 2], 1), round(max(loads), 1)],
           "peak_rss_gib": round(rss / 2**30, 3), "output_bytes": _size(out), "source_bytes": _size(src),
           "machine": f"{os.cpu_count()} cores, shared", "cpu": cpu_model(), "random_weights": True, "commit": _commit(),
           "threads": 1 if tool == "llama.cpp-quantize" else threads}
    if tree:  # the process tree's summed resident set, sampled each second (a worker process beside the main one)
        row["tree_rss_sampled_max_gib"] = round(max(tree) / 2**30, 3)
    if tool.startswith("lowbit") and _is_kquant(scheme):  # which K-quant rounding the row ran (session 5: fit)
        from lowbit.formats.kquants import DEFAULT_RULE

        row["rule"] = "search" if search else DEFAULT_RULE
    if out.exists():
        row["output_tensors"] = _stored(out)
    if rc != 0:
        row["error"] = log.read_text()[-400:]
    if keep:
        row["kept"] = str(out)
    elif out.is_file():
        out.unlink()
    else:
        shutil.rmtree(out, ignore_errors=True)
    return row


def _is_kquant(scheme: str) -> bool:
    """A K-quant scheme or llama.cpp mix (q4_k, q4_k_m, gguf:q6_k)."""
    return scheme.split(":")[-1].startswith("q") and "_k" in scheme


def _stored(out: Path) -> dict:
    """Bytes of the output by what they hold: quantized-layer parts vs float tensors by dtype, from the headers.

    What each tool keeps in float (embeddings, lm_head) decides much of an output's size, so rows say it.
    """
    from lowbit.files.safetensors_stream import read_header

    sizes: dict[str, int] = {}
    for f in ([out] if out.is_file() else sorted(out.rglob("*.safetensors"))):
        if f.suffix != ".safetensors":
            return {}
        for name, e in read_header(f)[0].items():
            float_ = e.dtype in ("F32", "F16", "BF16") and name.endswith(".weight")
            key = f"float {e.dtype} {name.rsplit('.', 2)[-2]}" if float_ and len(e.shape) == 2 else \
                f"float {e.dtype}" if float_ else "quantized"
            sizes[key] = sizes.get(key, 0) + e.nbytes
    return sizes


def _commit() -> str:
    """The lowbit commit a row ran (the tree may move while a long benchmark runs)."""
    r = subprocess.run(["git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD"], capture_output=True,
                       text=True)
    return r.stdout.strip()


def save(rows: list[dict], results: Path = RESULTS) -> None:
    old = json.loads(results.read_text())["rows"] if results.is_file() else []
    # searched rows beside plain ones, (session 5) a K-quant rule's rows beside the rows before rules were recorded,
    # and (session 6) one machine's rows beside another's: rows before session 6 name no `cpu`
    key = lambda r: (r["shape"], r["scheme"], r["tool"], bool(r.get("search")), r.get("rule", ""), r.get("cpu", ""))  # noqa: E731
    merged = {key(r): r for r in old} | {key(r): r for r in rows}
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps({"note": "random bf16 weights: time and memory only, no quality",
                                   "rows": sorted(merged.values(), key=key)}, indent=1))


def table(results: Path = RESULTS, cpu: str | None = None) -> None:
    """The rows, those of one CPU (``cpu_model()``'s name; '' for the rows before session 6) when ``cpu`` is given."""
    rows = [r for r in json.loads(results.read_text())["rows"] if cpu is None or r.get("cpu", "") == cpu]
    print(f"{'shape':16} {'scheme':10} {'tool':20} {'rule':6} {'threads':>7} {'s':>8} {'cpu s':>8} {'peak RSS GiB':>13} "
          f"{'out GiB':>8} {'src GiB':>8}  cpu")
    for r in rows:  # threads '-': torch's default (one per core), the rows before session 3
        rule = "-" if r["tool"] == "read" else "llama" if r["tool"] == "llama.cpp-quantize" else \
            r.get("rule") or ("search" if r.get("search") else "plain")
        print(f"{r['shape']:16} {r['scheme']:10} {r['tool']:20} {rule:6} {r.get('threads') or '-':>7} {r['seconds']:8.1f} "
              f"{r.get('cpu_seconds', 0):8.1f} "
              f"{r['peak_rss_gib']:13.2f} "
              + (f"{r['output_bytes'] / 2**30:8.2f}" if r["output_bytes"] is not None else f"{'-':>8}")
              + f" {r['source_bytes'] / 2**30:8.2f}  {r.get('cpu') or '-'}" + ("  FAILED" if r["rc"] else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="tinyllama-1.1b")
    ap.add_argument("--schemes", default="w4g128,nvfp4-46,q4_k_m,fp8")
    ap.add_argument("--work", default=str(CACHE / "out"))
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--search", action="store_true", help="RTN's scale search (slow: see the module doc)")
    ap.add_argument("--peer-path", default=None, help="a folder holding llm-compressor (see the module doc)")
    ap.add_argument("--tools", default="lowbit-stream",
                    help="lowbit-stream,lowbit-stream-gguf,llmc-model_free_ptq,llama.cpp-quantize,autoround-rtn,"
                         "autoround-rtn-blocks")
    ap.add_argument("--llama-python", default=None, help="a Python with llama-cpp-python (the llama.cpp-quantize "
                    "tool: llama.cpp's own Q4_K_M from a BF16 GGUF of the checkpoint, written first and untimed)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of every tool's child (lowbit's "
                    "--threads, torch.set_num_threads in llm-compressor's; llama.cpp runs one): on a shared machine "
                    "idle threads spin at every parallel region and inflate CPU seconds, so rows pin both tools to 1")
    ap.add_argument("--keep-gguf", action="store_true", help="keep the BF16 GGUF the llama.cpp-quantize row read "
                    "(deleted after the row by default: it is as large as the checkpoint)")
    ap.add_argument("--keep-outputs", action="store_true", help="keep every row's output (deleted by default); the "
                    "row's 'kept' names it (kquant_error.py reads llama.cpp's Q4_K_M GGUF)")
    ap.add_argument("--autoround-python", default="/work/venvs/peers/bin/python",
                    help="a Python with auto-round (the autoround-rtn tools; its pins clash with lowbit's, so apart)")
    ap.add_argument("--table", action="store_true")
    ap.add_argument("--this-cpu", action="store_true", help="--table: only the rows measured on this machine's CPU")
    ap.add_argument("--no-read", action="store_true", help="skip the read-only floor row")
    ap.add_argument("--results", default=str(RESULTS), help="the JSON file rows are merged into")
    args = ap.parse_args()
    results = Path(args.results)
    if args.table:
        return table(results, cpu_model() if args.this_cpu else None)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    for shape in args.shapes.split(","):
        src = build(shape)
        if args.build_only:
            continue
        if not args.no_read:
            save([run_row(shape, "-", "read", src, work)], results)
        for scheme in args.schemes.split(","):
            for tool in args.tools.split(","):
                if tool == "llmc-model_free_ptq" and scheme not in LLMC:
                    continue
                if tool.startswith("autoround") and scheme not in AUTOROUND:
                    continue
                if tool == "llama.cpp-quantize" and scheme != "q4_k_m":
                    continue
                row = run_row(shape, scheme, tool, src, work, args.search, args.peer_path, args.llama_python,
                              args.threads, args.keep_outputs, args.autoround_python)
                save([row], results)
                print(json.dumps(row), flush=True)
                if tool == "llama.cpp-quantize" and not args.keep_gguf:  # 6.4 GB at 3B, 16 GB at 8B
                    (work / f"{src.name}-bf16.gguf").unlink(missing_ok=True)
    if not args.build_only:
        table(results, cpu_model())


if __name__ == "__main__":
    main()
