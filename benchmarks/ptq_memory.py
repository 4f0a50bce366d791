"""Peak memory of block-wise SignRound: does it grow with one block, not with the model?

Builds a random Llama from a config (default ~1.1B parameters, TinyLlama-like shape:
hidden 2048, 22 layers, MLP 5632, vocab 32000), then runs signround2 W4g128 for a few
iterations with the FP block weights offloaded to disk (``offload_dir``), sampling the
process RSS every 20 ms. Reported, in MiB: the fp32 model, one block, the cached
activations, RSS after the model is built, and the peak RSS while each block is tuned
(block 0's window also covers writing the offload files). With offload the steady peak
minus the non-block weights (embeddings, lm_head) should be about one block plus
activations and tuning state, the same for 4 layers as for 22; without
(``--no-offload``) the whole model stays resident as well.

``--lazy`` is the path ``lowbit quantize --offload-dir`` takes on a safetensors folder: a
child process builds the random model and saves it, and this process loads it with
``lowbit.models.lazy`` (blocks stay in the file until reached), so the whole float model
is never in memory, not even before block 0.

    python -m benchmarks.ptq_memory                # ~1.1B, offloaded
    python -m benchmarks.ptq_memory --lazy         # ~1.1B, read from its checkpoint
    python -m benchmarks.ptq_memory --layers 4     # quick look
    python -m benchmarks.ptq_memory --layers 2 --hidden 256 --inter 512 --heads 4 --kv-heads 2 \
        --vocab 1000 --out /tmp/ptq_memory_smoke.json   # smoke (seconds)

The process re-executes itself once with ``MALLOC_MMAP_THRESHOLD_`` set (so freed tensors go
back to the OS and RSS can fall) and runs on one thread.

Writes benchmarks/results/ptq_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.common import emit, merge_row, out_path, run_child

MIB = 1024.0 * 1024.0


def rss_mib() -> float:
    """Current resident set size (from /proc, so it also falls when memory is returned)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / MIB


class Sampler:
    """Background thread recording the maximum RSS; `lap()` returns the peak since the last lap."""

    def __init__(self, every: float = 0.02) -> None:
        self.every, self.peak, self._stop = every, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_mib())
            time.sleep(self.every)

    def lap(self) -> float:
        peak, self.peak = max(self.peak, rss_mib()), rss_mib()
        return peak

    def __enter__(self) -> Sampler:
        self.peak = rss_mib()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_mib())


def build(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.inter, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                      max_position_embeddings=2048, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).float().eval()


def mode(args) -> str:
    return "lazy" if args.lazy else "memory" if args.no_offload else "offload"


def saved_then_lazy(args, folder: str):
    """Build + save in a child (its memory is not ours), then load with the blocks left on disk."""
    from lowbit.models.lazy import load_lazy

    shape = ["--hidden", str(args.hidden), "--inter", str(args.inter), "--layers", str(args.layers),
             "--heads", str(args.heads), "--kv-heads", str(args.kv_heads), "--vocab", str(args.vocab)]
    run_child("ptq_memory", [*shape, "--save-to", folder])
    return load_lazy(Path(folder))


def tensor_mib(tensors) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / MIB


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ptq_memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=5632)
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--nsamples", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=128)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--no-offload", action="store_true")
    p.add_argument("--lazy", action="store_true", help="load the blocks from a saved checkpoint when reached")
    p.add_argument("--save-to", default=None, help=argparse.SUPPRESS)  # the --lazy child: build, save, exit
    p.add_argument("--out", default=None, help="results file (default benchmarks/results/ptq_memory.json)")
    p.add_argument("--cache-dtype", default=None, help="bf16 | fp32 (omit on code from before issue 22)")
    p.add_argument("--label", default=None, help="kept in the row and its key (e.g. before / after)")
    return p


def key(r: dict) -> tuple:
    """A row's identity; rows from before --lazy existed record only ``offload``."""
    return (r["layers"], r["hidden"], r.get("mode", "offload" if r["offload"] else "memory"),
            r.get("label"), r.get("nsamples"), r.get("seqlen"))


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.save_to:
        build(args).save_pretrained(args.save_to)
        emit({"saved": args.save_to})
        return
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:  # return freed tensors to the OS, so RSS can fall
        argv = sys.argv[1:] if argv is None else argv
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks.ptq_memory", *argv],
                  {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"})

    import torch
    import transformers  # noqa: F401  (imported before the baseline RSS is read)

    from lowbit.models import decoder_blocks, linear_layers
    from lowbit.plans.plan import Plan
    from lowbit.ptq.blockwise import PipelineOptions, quantize_blockwise
    from lowbit.ptq.methods import RunContext
    from lowbit.ptq.signround import SignRoundSettings, SignRoundTuner

    torch.set_num_threads(1)
    base = rss_mib()  # the interpreter with torch + transformers imported, before any model
    ckpt = tempfile.TemporaryDirectory() if args.lazy else None
    model = saved_then_lazy(args, ckpt.name) if ckpt else build(args)
    blocks = decoder_blocks(model)
    model_mib = tensor_mib(model.state_dict().values())
    block_mib = tensor_mib(blocks[0].state_dict().values())
    calib = torch.randint(0, args.vocab, (args.nsamples, args.seqlen), generator=torch.Generator().manual_seed(0))
    act_mib = args.nsamples * args.seqlen * args.hidden * 4 / MIB
    plan = Plan.uniform(linear_layers(model, include_lm_head=False), "w4g128")
    extra = {"cache_dtype": args.cache_dtype} if args.cache_dtype else {}  # absent before issue 22
    cfg = SignRoundSettings(iters=args.iters, v2=True, batch_size=min(args.nsamples, 8), **extra)
    before = rss_mib()
    laps: list[float] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, Sampler() as s:
        opts = PipelineOptions(chunk=min(args.nsamples, 8),
                               **({"cache_dtype": cfg.storage_dtype("cpu")} if args.cache_dtype else {}))
        ctx = RunContext(calib=calib, offload_dir=None if args.no_offload or args.lazy else tmp)
        quantize_blockwise(model, plan, SignRoundTuner(cfg), {"method": "signround2"}, ctx, opts,
                           on_block=lambda i: laps.append(s.lap()))
    seconds = time.perf_counter() - t0
    if ckpt:
        ckpt.cleanup()
    steady = max(laps[1:]) if len(laps) > 1 else laps[0]  # block 0's lap also covers the offload set-up
    rest_mib = model_mib - block_mib * len(blocks)  # embeddings, lm_head, final norm
    row = {"params_m": round(sum(t.numel() for t in model.state_dict().values()) / 1e6, 1),
           "layers": args.layers, "hidden": args.hidden, "offload": not args.no_offload,
           "mode": mode(args),
           "model_fp32_mib": round(model_mib), "block_fp32_mib": round(block_mib),
           "non_block_fp32_mib": round(rest_mib), "activations_mib": round(act_mib, 1),
           "rss_after_build_mib": round(before), "peak_rss_per_block_mib": [round(v) for v in laps],
           "steady_peak_rss_mib": round(steady), "rss_process_base_mib": round(base),
           "steady_peak_minus_base_and_non_block_mib": round(steady - base - rest_mib),
           "iters": args.iters, "nsamples": args.nsamples, "seqlen": args.seqlen, "seconds": round(seconds, 1),
           "cache_dtype": args.cache_dtype, "label": args.label}
    print(json.dumps(row, indent=1))
    merge_row(out_path(args.out, "ptq_memory.json"), row, key)


if __name__ == "__main__":
    main()
