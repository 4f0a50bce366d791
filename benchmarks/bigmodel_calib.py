"""Models bigger than the machine, calibrated: GPTQ and SignRoundV2 block by block on a lazily loaded model.

The random bf16 checkpoints of ``benchmarks/bigmodel.py`` (TinyLlama-1.1B, Llama-3.2-3B and, once
built, Llama-3.1-8B shapes under ``~/.cache/lowbit/bigmodel``) are read in place: a work folder
per shape links their shards and adds a byte-level BPE tokenizer trained on the bundled corpus
(8000 ids, fewer than any of the shapes' vocabularies; the checkpoints ship none). **Random
weights measure time and memory, not quality**: nothing here says anything about accuracy.

Each row is one child process running ``lowbit quantize SRC --method M --offload-dir D --no-eval``
(the model built on meta, each block read from the checkpoint when its turn comes). The child
records, after every block, the block's wall and CPU seconds and the process's resident set
(``VmRSS``) and high-water mark (``VmHWM``) from ``/proc/self/status``; the parent takes the
child's peak RSS from the kernel (``os.wait4``'s ``ru_maxrss``: resident pages, file-backed ones
included, not Python's allocator). ``--blocks N`` stops a row after N blocks (the 8B shape, where
the whole model does not fit the session): its peak and per-block series cover those blocks.
Beside each row: the up-front estimate of ``lowbit.ptq.memory`` for the same job.

Flatness: the peak RSS after the last block over the peak after the first quarter of the blocks
(1.0 = flat in depth), and the ratio of peaks between shapes per block width (peak minus the
interpreter's floor, over one block's float bytes).

Peer: llm-compressor's ``oneshot`` with ``GPTQModifier`` (W4A16, the sequential pipeline: one
decoder layer onloaded at a time) on the same checkpoint and the same calibration token ids,
``--peer-python`` pointing at an interpreter that imports it (installed apart: its pins clash), or
``--peer-path`` a folder it was installed into with ``pip --target --no-deps`` (run with this interpreter).

    python -m benchmarks.bigmodel_calib --shapes tinyllama-1.1b --methods gptq,signround2
    python -m benchmarks.bigmodel_calib --shapes llama-3.1-8b --methods gptq --blocks 6
    python -m benchmarks.bigmodel_calib --shapes tinyllama-1.1b --methods rtn,awq,rotate --blocks 3 --threads 1
    python -m benchmarks.bigmodel_calib --shapes tinyllama-1.1b --methods rotate-nodata --threads 1 [--whole]

``rotate-nodata`` is RTN without calibration data (``--no-search``) with ``--rotate``: block by block
it reads no data (`lowbit.ptq.blockwise.rounding`); ``--whole`` runs the same job without
``--offload-dir`` (the whole float model loaded, rotated and rounded), the row it replaces.
    python -m benchmarks.bigmodel_calib --table
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

# the checkpoints benchmarks/bigmodel.py builds, and its child runner (peak RSS from wait4)
from benchmarks.bigmodel import CACHE, child

WORK = Path(os.environ.get("LOWBIT_BENCH_WORK", "/tmp/lowbit-bigmodel-calib"))
RESULTS = Path(__file__).parent / "results" / "bigmodel_calib.json"
TOKENIZER_VOCAB = 8000


def prepare(shape: str) -> Path:
    """A folder with links to the cached checkpoint of ``shape`` and a tokenizer of its own (made once)."""
    src = CACHE / shape
    if not (src / "complete.json").is_file():
        raise SystemExit(f"{src} is not built (benchmarks/bigmodel.py builds it); not building it here")
    dst = WORK / "ckpt" / shape
    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.name != "complete.json" and not (dst / p.name).exists():
            os.symlink(p, dst / p.name)
    if not (dst / "tokenizer.json").is_file():
        _tokenizer().save_pretrained(dst)
    return dst


def _tokenizer():
    """A byte-level BPE trained on the bundled corpus: every id below the smallest vocabulary here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from lowbit.data.sources import bundled_documents

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(bundled_documents(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def _status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, and glibc's heap (bytes in live chunks, bytes in free chunks it keeps:
    ``mallinfo2``, where the C library has it), bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(rest.split()[0]) * 1024
    return out | _heap()


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def _heap() -> dict[str, int]:
    """glibc's ``mallinfo2``: bytes in use (``uordblks``) and free but kept (``fordblks``) in its arenas."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (AttributeError, OSError):
        return {}
    fn.restype = _Mallinfo2
    m = fn()
    return {"heap_used": m.uordblks, "heap_free": m.fordblks}


def child_main(argv: list[str]) -> int:
    """Run ``lowbit quantize argv`` here, logging each block (seconds, CPU seconds, RSS) to $BLOCK_LOG;
    $STOP_AFTER blocks end the run (exit code 3) when set.

    Each record holds ``VmRSS`` / ``VmHWM`` when the block's work is done (before it is written out) and
    ``VmRSS_after`` once it is released and the walk has handed the allocator's free pages back (the
    resident set a flat-in-depth run returns to after every block)."""
    from lowbit.cli import main
    from lowbit.ptq import gptq
    from lowbit.ptq.blockwise import loop, rounding, tune

    log = open(os.environ["BLOCK_LOG"], "a")  # noqa: SIM115 - held for the run
    stop = int(os.environ.get("STOP_AFTER", "0"))
    finish, give_back = tune.TunePass.finish, loop.give_back_free_memory
    finish_round = rounding.RoundPass.finish
    last = [time.perf_counter(), _cpu()]
    pending: list[dict] = []

    def timed(self, i, block, result):
        (finish_round if isinstance(self, rounding.RoundPass) else finish)(self, i, block, result)
        now, cpu = time.perf_counter(), _cpu()
        pending.append({"block": i, "s": now - last[0], "cpu_s": cpu - last[1], **_status()})
        last[:] = [now, cpu]

    def released() -> bool:
        done = give_back()
        if not pending:
            return done
        row = pending.pop()
        log.write(json.dumps(row | {"VmRSS_after": _status()["VmRSS"]}) + "\n")
        log.flush()
        if stop and row["block"] + 1 >= stop:
            log.close()
            os._exit(3)
        return done

    def grouped(weights, *args, **kwargs):  # GPTQ: each group of Linears sharing an input, as it finishes
        out = layers(weights, *args, **kwargs)
        log.write(json.dumps({"group": list(weights), "s": time.perf_counter() - last[0], "cpu_s": _cpu() - last[1],
                              **_status()}) + "\n")
        log.flush()
        return out

    from lowbit.ptq import conductor

    scored = conductor.mixed_plan

    def scoring(*args, **kwargs):  # --avg-bits: the DeltaLoss passes and the knapsack, one record before the walk
        out = scored(*args, **kwargs)
        now, cpu = time.perf_counter(), _cpu()
        log.write(json.dumps({"phase": "mixed_plan", "s": now - last[0], "cpu_s": cpu - last[1], **_status()}) + "\n")
        log.flush()
        last[:] = [now, cpu]
        return out

    conductor.mixed_plan = scoring
    tune.TunePass.finish = rounding.RoundPass.finish = timed
    loop.give_back_free_memory = released
    layers, gptq.gptq_layers = gptq.gptq_layers, grouped
    log.write(json.dumps({"block": -1, "s": 0.0, "cpu_s": _cpu(), **_status()}) + "\n")
    log.flush()
    return main(["quantize", *argv])


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def method_args(method: str, iters: int) -> list[str]:
    if method == "gptq":
        return ["--method", "gptq", "--no-search"]
    if method == "signround2":
        return ["--method", "signround2", "--iters", str(iters)]
    if method in PRE_STEP_ROWS:
        return PRE_STEP_ROWS[method]
    if method in MIXED_ROWS:
        return MIXED_ROWS[method]
    raise SystemExit(f"unknown method {method}")


# rows of RTN with its importance search and of the pre-steps, block by block on the lazily loaded model (issue 35):
# method -> the flags; the estimate reads the base method and the pre-steps from them
PRE_STEP_ROWS = {"rtn": ["--method", "rtn"], "awq": ["--method", "rtn", "--awq"],
                 "rotate": ["--method", "rtn", "--rotate"], "rotate-nodata": ["--method", "rtn", "--no-search", "--rotate"]}
DATA_FREE = ("rotate-nodata",)  # rows that read no calibration data (nsamples / seqlen recorded as 0)
# --avg-bits on the lazily loaded model (issue 35): DeltaLoss block by block over two options, then RTN with its
# importance search applies the plan block by block; the child logs the DeltaLoss phase apart (``phase`` records)
MIXED_ROWS = {"mixed": ["--method", "rtn", "--avg-bits", "3", "--options", "w2g128,w4g128"]}
MIXED_NSAMPLES = 16  # MixedSettings.nsamples: DeltaLoss scores on the first 16 calibration samples at most


def run_lowbit(shape: str, method: str, a: argparse.Namespace) -> dict:
    src = prepare(shape)
    if method in DATA_FREE:
        a = argparse.Namespace(**{**vars(a), "nsamples": 0, "seqlen": 0})
    tag = f"{shape}-{method}-n{a.nsamples}x{a.seqlen}" + (f"-b{a.blocks}" if a.blocks else "") + \
        ("-whole" if a.whole else "")
    out, off, blog = WORK / "out" / tag, WORK / "offload" / tag, WORK / "logs" / f"{tag}.blocks.jsonl"
    for p in (out, off):
        shutil.rmtree(p, ignore_errors=True)
    blog.parent.mkdir(parents=True, exist_ok=True)
    blog.unlink(missing_ok=True)
    calib = ["--nsamples", str(a.nsamples), "--seqlen", str(a.seqlen)] if method not in DATA_FREE else []
    scheme = [] if method in MIXED_ROWS else ["--scheme", "w4g128"]
    args = [str(src), *method_args(method, a.iters), *scheme, *calib,
            *([] if a.whole else ["--offload-dir", str(off)]), "--no-eval", "--out", str(out), "--json",
            "--threads", str(a.threads)]
    env = {**os.environ, "BLOCK_LOG": str(blog), "STOP_AFTER": str(a.blocks or 0)}
    cmd = [sys.executable, "-m", "benchmarks.bigmodel_calib", "--child", *args]
    code, wall, cpu, peak = child(cmd, WORK / "logs" / f"{tag}.log", env)
    lines = [json.loads(x) for x in blog.read_text().splitlines()] if blog.is_file() else []
    blocks, groups = [x for x in lines if "block" in x], [x for x in lines if "group" in x]
    phases = [x for x in lines if "phase" in x]
    ok = code == 0 or (a.blocks and code == 3)
    row = {"shape": shape, "method": method, "tool": "lowbit", "nsamples": a.nsamples, "seqlen": a.seqlen,
           "iters": a.iters if method == "signround2" else None, "blocks_run": len(blocks) - 1,
           "stopped_after": a.blocks or None, "ok": bool(ok), "exit": code, "s": round(wall, 1),
           "cpu_s": round(cpu, 1), "peak_rss": peak, "out_bytes": _size(out), "per_block": blocks[1:],
           "per_group": groups, "threads": a.threads,
           "estimate": estimate(src, method, a), "commit": _commit()}
    row |= flatness(blocks[1:])
    if phases:  # the DeltaLoss phase of a mixed row: its seconds and the high-water mark when it ended
        row["phases"] = phases
    if a.variant:  # e.g. an allocator setting from the environment: kept beside the plain row (save_row's key)
        row["variant"] = a.variant
        row["env"] = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    if a.whole:  # the whole-model path of the same job, beside the block-by-block row
        row["variant"] = "whole-model" + (f" {a.variant}" if a.variant else "")
    if blocks and code == 0:  # a whole-model row: what came after the last block (the save, the exit)
        row["after_blocks_cpu_s"] = round(cpu - blocks[0]["cpu_s"] - sum(b["cpu_s"] for b in blocks[1:]), 1)
    if a.check_load and code == 0:
        row["load_check"] = load_check(out, a.threads, WORK / "logs" / f"{tag}.eval.log")
    if a.keep_outputs and code == 0:
        row["kept"] = str(out)
    else:
        shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(off, ignore_errors=True)
    return row


def load_check(out: Path, threads: int, log: Path) -> dict:
    """The written checkpoint loaded back and run: ``lowbit eval OUT`` on 2 windows of 128 tokens of the bundled
    corpus (random weights: the perplexity says the forward ran and is finite, nothing about quality), in a child
    of its own (its peak RSS from the kernel)."""
    cmd = [sys.executable, "-m", "lowbit", "eval", str(out), "--windows", "2", "--eval-seqlen", "128", "--threads",
           str(threads), "--json"]
    code, wall, cpu, peak = child(cmd, log)
    last = [x for x in log.read_text().splitlines() if x.startswith("{")]
    result = json.loads(last[-1]) if last else {}
    return {"exit": code, "s": round(wall, 1), "cpu_s": round(cpu, 1), "peak_rss": peak,
            "ppl": result.get("ppl", result.get("perplexity"))}


def estimate(src: Path, method: str, a: argparse.Namespace) -> dict:
    """What `lowbit.ptq.memory` predicts for the row's job (block by block, blocks released, no evaluation)."""
    from lowbit.ptq.memory import Shape, with_stored_dtype
    from lowbit.ptq.memory import estimate as predict

    shape = Shape.from_config(with_stored_dtype(json.loads((src / "config.json").read_text()), src))
    if method in MIXED_ROWS:
        return predict(shape, "rtn", a.nsamples, a.seqlen, batch_size=min(8, a.nsamples), search=True,
                       deltaloss=(min(MIXED_NSAMPLES, a.nsamples), a.seqlen, False)).to_dict()
    flags = PRE_STEP_ROWS.get(method)
    if flags is not None:
        return predict(shape, flags[1], a.nsamples, a.seqlen, batch_size=max(1, min(8, a.nsamples)),
                       search="--no-search" not in flags, rotate="--rotate" in flags, awq="--awq" in flags,
                       lazy=not a.whole).to_dict()
    return predict(shape, method, a.nsamples, a.seqlen, batch_size=min(8, a.nsamples)).to_dict()


def flatness(blocks: list[dict]) -> dict:
    """How memory moves with depth: the resident set's growth per block after block 0 (bytes; 0 = flat), the
    high-water mark after the last block over the one after block 0, and the blocks' median CPU seconds
    (block 0 also pays for loading and capture, so it is left out where there are others)."""
    if not blocks:
        return {}
    later = blocks[1:] or blocks
    out = {"hwm_first": blocks[0]["VmHWM"], "hwm_last": blocks[-1]["VmHWM"],
           "depth_flatness": round(blocks[-1]["VmHWM"] / blocks[0]["VmHWM"], 3),
           "median_block_cpu_s": round(sorted(b["cpu_s"] for b in later)[len(later) // 2], 1)}
    if len(blocks) >= 2:
        key = "VmRSS_after" if "VmRSS_after" in blocks[0] else "VmRSS"  # after the release, where logged
        out["rss_growth_per_block"] = int((blocks[-1][key] - blocks[0][key]) / (len(blocks) - 1))
    return out


def llmc_child(argv: list[str]) -> int:
    """llm-compressor's sequential GPTQ (W4A16: int4 g128 symmetric, static act-order, dampening 0.01 as lowbit's
    defaults) on ``SRC`` in ``DTYPE`` (float32, or the checkpoint's bfloat16 where float32 would not fit the
    machine: the 3B shape's 12 GiB) with the token ids of ``IDS``; after ``BLOCKS`` decoder layers (0 = all) the
    run stops when the next layer is reached. Each layer's first call is logged to $BLOCK_LOG."""
    import torch
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, ids_file, blocks = argv[0], argv[1], int(argv[2])
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[argv[3] if len(argv) > 3 else "float32"]
    if len(argv) > 4:  # the row's --threads, as lowbit's child gets it
        torch.set_num_threads(int(argv[4]))
    log = open(os.environ["BLOCK_LOG"], "a")  # noqa: SIM115 - held for the run
    log.write(json.dumps({"block": -1, "s": 0.0, "cpu_s": _cpu(), **_status()}) + "\n")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype)
    tok = AutoTokenizer.from_pretrained(src)
    calib = torch.load(ids_file)
    last = [time.perf_counter(), _cpu()]
    seen: set[int] = set()

    def reached(i: int):
        def hook(*_):
            if i in seen:
                return
            seen.add(i)
            now, cpu = time.perf_counter(), _cpu()
            if i > 0:
                log.write(json.dumps({"block": i - 1, "s": now - last[0], "cpu_s": cpu - last[1], **_status()}) + "\n")
                log.flush()
            last[:] = [now, cpu]
            if blocks and i >= blocks:
                log.close()
                os._exit(3)
        return hook

    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(reached(i))
    groups = {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}}}
    recipe = [GPTQModifier(config_groups=groups, ignore=["lm_head"], block_size=128, dampening_frac=0.01,
                           actorder="static")]
    rows = [{"input_ids": r.unsqueeze(0), "attention_mask": torch.ones(1, r.numel(), dtype=torch.long)} for r in calib]
    oneshot(model=model, tokenizer=tok, dataset=DataLoader(rows, batch_size=None), recipe=recipe,
            num_calibration_samples=len(calib), max_seq_length=calib.shape[1], pipeline="sequential")
    return 0


def run_llmc(shape: str, a: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoTokenizer

    from lowbit.data.batches import calibration_batches

    src = prepare(shape)
    tag = f"{shape}-gptq-llmc-{a.peer_dtype}-n{a.nsamples}x{a.seqlen}" + (f"-b{a.blocks}" if a.blocks else "")
    blog, ids = WORK / "logs" / f"{tag}.blocks.jsonl", WORK / "logs" / f"{tag}.ids.pt"
    blog.parent.mkdir(parents=True, exist_ok=True)
    blog.unlink(missing_ok=True)
    torch.save(calibration_batches(AutoTokenizer.from_pretrained(src), None, a.nsamples, a.seqlen), ids)
    cmd = [a.peer_python or sys.executable, "-m", "benchmarks.bigmodel_calib", "--llmc-child", str(src), str(ids),
           str(a.blocks), a.peer_dtype, str(a.threads)]
    path = [str(Path(__file__).parent.parent), *([a.peer_path] if a.peer_path else [])]
    env = {**os.environ, "BLOCK_LOG": str(blog), "PYTHONPATH": os.pathsep.join(path)}
    code, wall, cpu, peak = child(cmd, WORK / "logs" / f"{tag}.log", env)
    blocks = [json.loads(x) for x in blog.read_text().splitlines()] if blog.is_file() else []
    row = {"shape": shape, "method": "gptq", "tool": "llmc-seq", "nsamples": a.nsamples, "seqlen": a.seqlen,
           "iters": None, "blocks_run": len(blocks) - 1, "stopped_after": a.blocks or None,
           "ok": code == 0 or bool(a.blocks and code == 3), "exit": code, "s": round(wall, 1), "cpu_s": round(cpu, 1),
           "peak_rss": peak, "out_bytes": 0, "per_block": blocks[1:], "commit": _commit(), "threads": a.threads,
           "model_dtype": a.peer_dtype}
    if a.peer_dtype != "float32":  # beside the float32 rows, not replacing them (save_row's key)
        row["variant"] = a.peer_dtype
    return row | flatness(blocks[1:])


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       cwd=Path(__file__).parent).strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def save_row(row: dict) -> None:
    rows = json.loads(RESULTS.read_text()) if RESULTS.is_file() else []
    key = ("shape", "method", "tool", "nsamples", "seqlen", "stopped_after", "variant")
    rows = [r for r in rows if tuple(r.get(k) for k in key) != tuple(row.get(k) for k in key)] + [row]
    RESULTS.write_text(json.dumps(rows, indent=1) + "\n")


def table() -> str:
    rows = json.loads(RESULTS.read_text()) if RESULTS.is_file() else []
    g = 1 << 30
    m = 1 << 20
    lines = [f"{'shape':15} {'method':10} {'tool':17} {'calib':7} {'blocks':>6} {'cpu s':>6} {'cpu s/blk':>9} "
             f"{'peak GiB':>8} {'est GiB':>7} {'HWM last/first':>14} {'RSS MiB/blk':>11} {'thr':>3} commit"]
    for r in sorted(rows, key=lambda r: (r["shape"], r["method"], r["tool"], r.get("variant", ""))):
        est = (r.get("estimate") or {}).get("peak_bytes")
        tool = r["tool"] + (f" ({r['variant']})" if r.get("variant") else "")
        lines.append(f"{r['shape']:15} {r['method']:10} {tool:17} {r['nsamples']}x{r['seqlen']:<4} "
                     f"{r.get('blocks_run', 0):>6} {r['cpu_s']:>6.0f} {r.get('median_block_cpu_s', 0):>9.1f} "
                     f"{r['peak_rss'] / g:>8.2f} {(est or 0) / g:>7.2f} {r.get('depth_flatness', 0):>14.3f} "
                     f"{r.get('rss_growth_per_block', 0) / m:>11.1f} {r.get('threads', 2):>3} {r.get('commit', '?')}")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        raise SystemExit(child_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "--llmc-child":
        raise SystemExit(llmc_child(sys.argv[2:]))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="tinyllama-1.1b")
    p.add_argument("--methods", default="gptq")
    p.add_argument("--nsamples", type=int, default=16)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--blocks", type=int, default=0, help="stop each row after this many blocks (0 = all)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--peer-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the dtype llm-compressor loads the model in (methods: llmc); bfloat16 is the checkpoint's "
                        "own, for shapes whose float32 model does not fit the machine")
    p.add_argument("--check-load", action="store_true",
                   help="whole-model rows: load the written checkpoint back and run it (lowbit eval, 2 x 128 tokens)")
    p.add_argument("--keep-outputs", action="store_true", help="keep the written checkpoint (deleted by default)")
    p.add_argument("--variant", default="", help="a name for what differs from the plain row (kept beside it), e.g. "
                   "an allocator setting passed in the environment (MALLOC_* variables are recorded)")
    p.add_argument("--whole", action="store_true",
                   help="run the job without --offload-dir: the whole float model in memory (the path a block-by-block "
                        "row replaces)")
    p.add_argument("--table", action="store_true")
    p.add_argument("--peer-python", default=None, help="an interpreter importing llm-compressor (methods: llmc)")
    p.add_argument("--peer-path", default=None,
                   help="a folder put on the llm-compressor child's path (installed with pip --target --no-deps, as "
                        "benchmarks/bigmodel.py's --peer-path), with this interpreter when --peer-python is not given")
    a = p.parse_args()
    if not a.table:
        for shape in a.shapes.split(","):
            for method in a.methods.split(","):
                row = run_llmc(shape, a) if method == "llmc" else run_lowbit(shape, method, a)
                save_row(row)
                print(json.dumps({k: v for k, v in row.items() if k != "per_block"}), flush=True)
    print(table())


if __name__ == "__main__":
    main()
