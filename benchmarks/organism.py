"""A model organism for training studies: a small Llama pre-trained here on the Python stdlib.

The bundled model is a Q4_1 GGUF dequantized, and its corpus is ~0.5 MB, so long QAT
runs on it memorise the text (issue 25). This builds a float model that is worth
studying instead: seeded, reproducible on one machine, minutes on 2 cores.

1. Corpus: every ``*.py`` file of the running interpreter's standard library
   (``sysconfig`` path ``stdlib``: sources, tests, and ``pydoc_data/topics.py``, the
   reference documentation), ~30 MB, one document per file in sorted path order,
   UTF-8 files only, written to ``corpus.jsonl`` as ``{"text", "path"}`` records. lowbit's
   own split rule applies: even lines train, odd lines evaluate, so ``--data corpus.jsonl``
   gives every lowbit command the same disjoint splits (no file is in both).
2. Tokenizer: byte-level BPE (``tokenizers``), ``--vocab`` tokens, trained on the
   training split only.
3. Model: a Llama (RMSNorm, RoPE, SwiGLU, grouped-query attention, tied embeddings, as
   SmolLM2) of ``--layers`` x ``--hidden``, initialised from ``--seed`` and pre-trained
   with lowbit's training loop (AdamW, warm-up + cosine) on non-overlapping windows of
   the training split, less than one epoch, with the eval loss logged along the way.
   ``--arch qwen3moe``: the same attention, embeddings and schedule with a Qwen3-MoE
   feed-forward instead (transformers' ``Qwen3MoeForCausalLM``: ``--experts`` experts of
   ``--moe-intermediate``, top-``--top-k`` softmax routing with the top-k weights
   renormalised as Qwen3 does), trained with Switch's load-balancing loss taken per
   layer (``--aux-loss-coef``; transformers' pools the layers); the tokens each expert receives are logged at every
   eval and recorded after training (an expert no token reaches is a poor organism for
   studying expert quantization). Its folder, corpus and tokenizer: see 4.
4. Output (``--out``, default ``~/.cache/lowbit/organism``, ``organism-moe`` for the MoE):
   ``model/`` (config.json + model.safetensors + tokenizer: ``lowbit.models.load_model(path)``
   loads it), ``corpus.jsonl``, ``train/`` (metrics.jsonl, checkpoint: an interrupted build
   resumes); ``benchmarks/results/organism.json`` (``organism_moe.json``: settings, sizes,
   hashes, parameters by kind, the curves) and ``organism.png`` (training and eval loss).
   ``--share DIR`` (the MoE's default: the dense organism's folder) takes ``corpus.jsonl``
   and ``tokenizer/`` from another organism when it has them, so both models read the same
   tokens; otherwise they are built here, the same way.

    nice -n 10 python -m benchmarks.organism            # ~10 minutes on 2 free cores
    nice -n 10 python -m benchmarks.organism --arch qwen3moe

The corpus depends on the Python version (its sha256 is recorded); the weights are
bit-identical between runs on one machine and thread count, not across CPUs (GEMM
kernels round differently).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
import time
from pathlib import Path

from benchmarks.common import machine, result_path, save_results

DEFAULT_OUT = Path.home() / ".cache" / "lowbit" / "organism"
DEFAULT_OUT_MOE = Path.home() / ".cache" / "lowbit" / "organism-moe"
EOS = "<|endoftext|>"
ARCHS = ("llama", "qwen3moe")
MOE_ARGS = ("experts", "top_k", "moe_intermediate", "aux_loss_coef")


# ------------------------------------------------------------------ corpus
def stdlib_files(root: Path) -> list[Path]:
    """The stdlib's ``*.py`` files in sorted relative-path order, third-party packages excluded."""
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = [p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts) and p.is_file()]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def source_files(sources: str) -> list[tuple[str, Path, Path]]:
    """(record path prefix, root, file) of every file of the named sources, in a fixed order.

    ``stdlib``: the interpreter's standard library (paths recorded relative to it);
    ``site``: the installed third-party packages (``purelib``), e.g. for a larger model on a
    GPU machine whose site-packages hold torch and transformers (prefix ``site-packages/``).
    """
    out = []
    for name in sources.split(","):
        if name == "stdlib":
            root, prefix, skip = Path(sysconfig.get_paths()["stdlib"]), "", True
        elif name == "site":
            root, prefix, skip = Path(sysconfig.get_paths()["purelib"]), "site-packages/", False
        else:
            raise SystemExit(f"unknown --sources entry {name!r}; use stdlib and/or site")
        files = stdlib_files(root) if skip else sorted(
            (p for p in root.rglob("*.py") if "__pycache__" not in p.parts and p.is_file()),
            key=lambda p: p.relative_to(root).as_posix())
        out += [(prefix, root, f) for f in files]
    return out


def build_corpus(out: Path, sources: str = "stdlib", max_mb: float = 0.0) -> dict:
    """Write ``corpus.jsonl`` (one record per UTF-8 source file, up to ``max_mb``) unless it is there."""
    from lowbit.io import atomic_write_text

    path = out / "corpus.jsonl"
    if not path.is_file():
        lines, skipped, size = [], 0, 0
        for prefix, root, f in source_files(sources):
            try:
                text = f.read_bytes().decode("utf-8").replace("\r\n", "\n")
            except UnicodeDecodeError:
                skipped += 1  # a few tests are deliberately in other encodings
                continue
            if text.strip():
                lines.append(json.dumps({"text": text, "path": prefix + f.relative_to(root).as_posix()}))
                size += len(lines[-1]) + 1
            if max_mb and size > max_mb * 1e6:
                break
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, "\n".join(lines) + "\n")
        (out / "corpus_skipped.txt").write_text(str(skipped))
    data = path.read_bytes()
    n = data.count(b"\n")
    return {"path": str(path), "sources": sources, "stdlib": sysconfig.get_paths()["stdlib"],
            "python": sys.version.split()[0], "documents": n, "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "skipped_non_utf8": int((out / "corpus_skipped.txt").read_text() or 0)
            if (out / "corpus_skipped.txt").is_file() else None}


# --------------------------------------------------------------- tokenizer
def train_tokenizer(corpus: Path, vocab: int):
    """Byte-level BPE trained on the training split (even lines) only."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from lowbit.data.sources import split_texts

    docs = split_texts(corpus, "calib")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS,
                                   model_max_length=1 << 20)


# ------------------------------------------------------------------- model
def llama_config(args, vocab: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads, max_position_embeddings=args.max_positions,
                       tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=10000.0,
                       bos_token_id=0, eos_token_id=0, pad_token_id=0)


def qwen3moe_config(args, vocab: int):
    """A Qwen3-MoE of the Llama organism's attention and embeddings (head_dim = hidden / heads, no
    q/k bias, tied embeddings) with a routed feed-forward in every layer and no shared expert."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                          moe_intermediate_size=args.moe_intermediate, num_experts=args.experts,
                          num_experts_per_tok=args.top_k, norm_topk_prob=True, decoder_sparse_step=1,
                          num_hidden_layers=args.layers, num_attention_heads=args.heads,
                          num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                          max_position_embeddings=args.max_positions, tie_word_embeddings=True,
                          rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                          router_aux_loss_coef=args.aux_loss_coef, output_router_logits=False,
                          bos_token_id=0, eos_token_id=0, pad_token_id=0)


def build_model(args, vocab: int):
    """The organism's float model, initialised from the current torch seed."""
    if args.arch == "qwen3moe":
        from transformers import Qwen3MoeForCausalLM

        return Qwen3MoeForCausalLM(qwen3moe_config(args, vocab))
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(llama_config(args, vocab))


def balance_loss(router_logits, top_k: int):
    """Switch's load-balancing loss per layer, averaged over layers (1.0 when every expert gets its fair
    share): the number of experts x sum over experts of (share of the layer's top-k assignments x mean
    router probability). transformers' ``aux_loss`` pools every layer's assignments into one histogram,
    so one layer's starved expert hides behind another layer's busy expert of the same index; here each
    layer answers for itself."""
    import torch

    total = 0.0
    for logits in router_logits:
        probs = logits.float().softmax(dim=-1)
        picked = probs.topk(top_k, dim=-1).indices.reshape(-1)
        share = torch.bincount(picked, minlength=probs.shape[-1]).float() / picked.numel()
        total = total + probs.shape[-1] * (share * probs.mean(dim=0)).sum()
    return total / len(router_logits)


def moe_loss(coef: float):
    """Next-token cross-entropy plus ``coef`` x `balance_loss`: without it a few experts take every token
    while the others stay at their initialisation."""
    import torch.nn.functional as F

    def loss(model, batch):
        out = model(input_ids=batch, output_router_logits=True)
        logits = out.logits[:, :-1]
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
        return ce + coef * balance_loss(out.router_logits, model.config.num_experts_per_tok)

    return loss


def expert_tokens(model, windows, batch: int = 16):
    """``[layers, experts]`` token counts the router sends to each expert over ``windows`` (each token
    counted once per expert of its top-k), from the router logits the model returns."""
    import torch

    k = model.config.num_experts_per_tok
    counts = None
    was = model.training
    model.eval()
    with torch.no_grad():
        for w in windows.split(batch):
            logits = model(input_ids=w, output_router_logits=True).router_logits
            top = torch.stack([g.topk(k, dim=-1).indices for g in logits])  # [L, tokens, k]
            c = torch.stack([torch.bincount(t.reshape(-1), minlength=model.config.num_experts) for t in top])
            counts = c if counts is None else counts + c
    model.train(was)
    return counts


def load_summary(counts) -> dict:
    """Balance of ``[layers, experts]`` token counts: each expert's share relative to a uniform router
    (1.0 = its fair share), the smallest and largest over all layers, and the experts no token reached."""
    share = counts.double() / counts.sum(dim=1, keepdim=True) * counts.shape[1]
    return {"min_share": round(float(share.min()), 4), "max_share": round(float(share.max()), 4),
            "experts_without_tokens": int((counts == 0).sum()),
            "experts_under_10pct_of_fair": int((share < 0.1).sum())}


def param_kinds(model) -> dict:
    """Parameters by kind (tied tensors once): embeddings, attention projections, dense MLPs, experts,
    routers and norms, plus the parameters one token's forward multiplies by (``active``: its top-k
    experts rather than all of them)."""
    kinds: dict[str, int] = {}
    for name, p in model.named_parameters():
        kind = ("norms" if "norm" in name else "embeddings" if "embed_tokens" in name or "lm_head" in name
                else "experts" if ".mlp.experts." in name else "router" if ".mlp.gate." in name
                else "attention" if ".self_attn." in name else "mlp" if ".mlp." in name else "other")
        kinds[kind] = kinds.get(kind, 0) + p.numel()
    total = sum(kinds.values())
    out = {"total": total, **kinds}
    experts = kinds.get("experts", 0)
    if experts:
        cfg = model.config
        out["active_per_token"] = total - experts + experts * cfg.num_experts_per_tok // cfg.num_experts
    out["shares"] = {k: round(v / total, 4) for k, v in kinds.items()}
    return out


def share_sources(out: Path, share: Path | None) -> dict:
    """Link ``corpus.jsonl`` and ``tokenizer/`` of the organism folder ``share`` into ``out`` when ``out``
    has neither yet, so two organisms read the same tokens; returns what was taken."""
    import shutil

    if share is None or share.resolve() == out.resolve():
        return {}
    taken = {}
    out.mkdir(parents=True, exist_ok=True)
    for name in ("corpus.jsonl", "corpus_skipped.txt"):
        if (share / name).is_file() and not (out / name).exists():
            shutil.copyfile(share / name, out / name)
            taken[name] = str(share / name)
    if (share / "tokenizer" / "tokenizer.json").is_file() and not (out / "tokenizer").exists():
        shutil.copytree(share / "tokenizer", out / "tokenizer")
        taken["tokenizer"] = str(share / "tokenizer")
    return taken


def spread_windows(tokens, seqlen: int, count: int):
    """``count`` windows of ``seqlen`` spread evenly over ``tokens [1, T]`` (the whole split, not its
    first files): ``[count, seqlen]``."""
    import torch

    ids = tokens.reshape(-1)
    n = len(ids) // seqlen
    pick = torch.linspace(0, n - 1, min(count, n)).round().long()
    return ids[: n * seqlen].reshape(n, seqlen)[pick]


def loss_of(model, windows, batch: int = 16) -> float:
    """Mean next-token cross-entropy (nats) over ``windows``."""
    import torch

    from lowbit.train.loop import causal_lm_loss

    was = model.training
    model.eval()
    with torch.no_grad():
        total = sum(causal_lm_loss(model, w).item() * len(w) for w in windows.split(batch))
    model.train(was)
    return total / len(windows)


def seen_unseen(model, rows, steps: int, batch: int, seed: int, count: int = 64) -> dict:
    """Loss on ``count`` training windows the run has trained on vs ``count`` it has not (the rest of the
    epoch's permutation): a gap means memorisation; equal losses mean the train/eval gap, if any, is a
    difference between the two splits' files."""
    import torch

    from lowbit.train.loop import batch_indices

    seen_n = steps * batch
    if seen_n >= len(rows):
        return {"note": "more than one epoch: every window was seen"}
    order = batch_indices(len(rows), len(rows), 0, seed)  # the first epoch's permutation, as the loop draws it
    pick = lambda idx: idx[torch.linspace(0, len(idx) - 1, count).round().long()]  # noqa: E731
    dev = next(model.parameters()).device
    return {"seen": loss_of(model, rows[pick(order[:seen_n])].to(dev)),
            "unseen": loss_of(model, rows[pick(order[seen_n:])].to(dev)), "windows": count}


def steps_within(budget_s: float, model, rows, args, overhead: float = 1.15) -> int:
    """The most steps of this batch that fit ``budget_s``: a copy of the model trains 8 steps and the
    last 5 are timed (the first ones include warm-up of kernels and allocators); ``overhead`` covers
    evals, checkpoints and diagnostics."""
    import copy

    import torch

    from lowbit.train.loop import causal_lm_loss

    m = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(m.parameters(), lr=args.lr)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    ctx = torch.autocast(dev.type, dtype=torch.bfloat16) if args.dtype == "bf16" else torch.autocast(dev.type, enabled=False)
    times = []
    for i in range(8):
        sync()
        t = time.perf_counter()
        with ctx:
            loss = causal_lm_loss(m, rows[i * args.batch_size:(i + 1) * args.batch_size].to(dev))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t)
    per = sorted(times[3:])[2]
    del m, opt
    steps = min(args.steps, max(int(budget_s / (per * overhead)), 48))
    print(json.dumps({"seconds_per_step": round(per, 4), "steps": steps}), flush=True)
    return steps


TOKENS = "tokens.safetensors"


def _token_key(organism: Path, corpus: Path) -> dict:
    from lowbit.io import sha256_file

    return {"corpus_sha256": sha256_file(corpus), "tokenizer_sha256": sha256_file(organism / "model" / "tokenizer.json")}


def save_tokens(organism: Path, corpus: Path, train_ids, eval_ids) -> None:
    """Both splits' token ids (as lowbit tokenizes them) beside the model, keyed by the corpus and
    tokenizer hashes, so studies skip the minutes of tokenization."""
    from safetensors.torch import save_file

    tmp = organism / f".{TOKENS}.tmp"
    save_file({"train": train_ids.reshape(-1).contiguous(), "eval": eval_ids.reshape(-1).contiguous()}, str(tmp),
              metadata=_token_key(organism, corpus))
    tmp.replace(organism / TOKENS)


def load_tokens(organism: Path, corpus: Path):
    """([1, T] train ids, [1, T] eval ids) saved by `save_tokens` for this corpus and tokenizer, else None."""
    from safetensors import safe_open

    path = organism / TOKENS
    if not path.is_file() or not (organism / "model" / "tokenizer.json").is_file() or not corpus.is_file():
        return None
    with safe_open(str(path), "pt") as f:
        if f.metadata() != _token_key(organism, corpus):
            return None
        return f.get_tensor("train").unsqueeze(0), f.get_tensor("eval").unsqueeze(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="llama", choices=ARCHS, help="llama (dense) or qwen3moe (routed experts)")
    p.add_argument("--out", default=None, help=f"default {DEFAULT_OUT} ({DEFAULT_OUT_MOE.name} for qwen3moe)")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=384)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--max-positions", type=int, default=1024)
    p.add_argument("--experts", type=int, default=16, help="qwen3moe: routed experts per layer")
    p.add_argument("--top-k", type=int, default=2, help="qwen3moe: experts per token")
    p.add_argument("--moe-intermediate", type=int, default=128, help="qwen3moe: each expert's intermediate size")
    p.add_argument("--aux-loss-coef", type=float, default=0.05,
                   help="qwen3moe: weight of the per-layer load-balancing loss averaged over layers (Switch's 0.01 "
                        "summed over 4 layers is 0.04 here); 0.01 left experts without tokens after 200 steps")
    p.add_argument("--share", default=None,
                   help="take corpus.jsonl and tokenizer/ from this organism folder when it has them "
                        f"(qwen3moe default: {DEFAULT_OUT}); 'none' builds them here")
    p.add_argument("--seqlen", type=int, default=128)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-windows", type=int, default=64, help="windows of --seqlen for the logged losses")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sources", default="stdlib", help="stdlib and/or site (installed packages' sources)")
    p.add_argument("--max-mb", type=float, default=0.0, help="cap the corpus at this many MB (0 = all)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", help="fp32 | bf16 (autocast)")
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="lower --steps so the whole build (corpus, tokenizer, pre-training) fits this many "
                        "seconds; the steps are timed first")
    p.add_argument("--checkpoint-every", type=int, default=250, help="an interrupted build resumes from these")
    p.add_argument("--results", default=None,
                   help="results name under benchmarks/results, or a path (default organism / organism_moe)")
    p.add_argument("--threads", type=int, default=1, help="1: on a shared machine more threads spin and stall")
    args = p.parse_args()
    moe = args.arch == "qwen3moe"
    if moe and not (0 < args.top_k <= args.experts):
        p.error(f"--top-k {args.top_k} must be between 1 and --experts {args.experts}")
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    args.out = args.out or str(DEFAULT_OUT_MOE if moe else DEFAULT_OUT)
    args.results = args.results or ("organism_moe" if moe else "organism")
    share = DEFAULT_OUT if args.share is None and moe else None
    if args.share not in (None, "none"):
        share = Path(args.share).expanduser()

    import torch

    from lowbit.data import eval_tokens
    from lowbit.data.batches import tokenize_split, training_windows
    from lowbit.eval import perplexity
    from lowbit.train import TrainConfig, train
    from lowbit.train.loop import causal_lm_loss

    torch.set_num_threads(args.threads)
    out = Path(args.out).expanduser()
    t0 = time.perf_counter()
    shared = share_sources(out, share)
    corpus = build_corpus(out, args.sources, args.max_mb)
    data = Path(corpus["path"])
    tok_dir = out / "tokenizer"
    if not (tok_dir / "tokenizer.json").is_file():
        train_tokenizer(data, args.vocab).save_pretrained(tok_dir)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    t_tok = time.perf_counter()
    rows = training_windows(tok, data, args.seqlen, "calib")
    ev = eval_tokens(tok, data)
    train_tokens = tokenize_split(tok, data, "calib").shape[1]
    torch.manual_seed(args.seed)
    model = build_model(args, len(tok)).to(args.device)
    if args.budget_s:  # what is left of the budget after the corpus, tokenizer and tokens, less the final eval
        args.steps = steps_within(args.budget_s - (time.perf_counter() - t0) - 20, model, rows, args)
    seen = args.steps * args.batch_size
    if seen > len(rows):
        raise SystemExit(f"{args.steps} x {args.batch_size} windows is more than one epoch ({len(rows)} windows); "
                         "lower --steps or --batch-size")
    ev_win = spread_windows(ev, args.seqlen, args.eval_windows).to(args.device)
    tr_win = spread_windows(rows.reshape(1, -1), args.seqlen, args.eval_windows).to(args.device)
    print(json.dumps({"corpus_mb": round(corpus["bytes"] / 1e6, 1), "train_tokens": train_tokens,
                      "eval_tokens": ev.shape[1], "train_windows": len(rows),
                      "chars_per_token": round(corpus["bytes"] / (train_tokens + ev.shape[1]), 2),
                      "tokenize_s": round(time.perf_counter() - t_tok, 1)}), flush=True)

    n_params = sum(p.numel() for p in model.parameters())
    decoder = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n)
    kinds = param_kinds(model)
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, min_lr=args.min_lr,
                      warmup=min(args.warmup, args.steps // 10), weight_decay=args.weight_decay, seed=args.seed,
                      eval_every=args.eval_every, checkpoint_every=args.checkpoint_every, out_dir=str(out / "train"), progress=True,
                      dtype=args.dtype)

    def eval_fn(m) -> dict:
        logged = {"eval_loss": loss_of(m, ev_win), "train_window_loss": loss_of(m, tr_win)}
        return {**logged, **load_summary(expert_tokens(m, ev_win))} if moe else logged

    free = ("out", "threads", "results", "budget_s", "sources", "max_mb", "device", "dtype", "checkpoint_every",
            "share") + (() if moe else ("arch",) + MOE_ARGS)  # the dense run keeps its checkpoint identity
    extra = {"organism": {k: v for k, v in vars(args).items() if k not in free}, "dtype": args.dtype,
             "corpus_sha256": corpus["sha256"]}
    r = train(model, rows, cfg, eval_fn=eval_fn, extra=extra,
              loss_fn=moe_loss(args.aux_loss_coef) if moe else causal_lm_loss)
    model.eval()
    ppl_spread = perplexity(model, spread_windows(ev, 256, 256).reshape(1, -1).to(args.device), seqlen=256, windows=None,
                            progress=False)
    memo = seen_unseen(model, rows, args.steps, args.batch_size, args.seed)
    load = None
    if moe:  # tokens per expert after training, on 256 x 256 tokens of each split
        load = {split: {"tokens_per_expert": c.tolist(), **load_summary(c)} for split, c in
                (("eval", expert_tokens(model, spread_windows(ev, 256, 256).to(args.device))),
                 ("train", expert_tokens(model, spread_windows(rows.reshape(1, -1), 256, 256).to(args.device))))}
    folder = out / "model"
    model.to("cpu").save_pretrained(folder)
    tok.save_pretrained(folder)
    from lowbit.io import sha256_file

    result = {
        "settings": vars(args), "machine": machine(), "corpus": corpus,
        "tokens": {"train": train_tokens, "eval": int(ev.shape[1]), "train_windows": len(rows),
                   "pretrain_windows_seen": seen, "epochs": round(seen / len(rows), 3)},
        "params": {"total": n_params, "decoder_layers": decoder, "embedding_tied": n_params - decoder,
                   "by_kind": kinds},
        "shared_from": shared, "tokenizer_sha256": sha256_file(folder / "tokenizer.json"),
        "expert_load": load,
        "final": {"train_loss_smoothed_50": sum(r.losses[-50:]) / 50, "eval": r.evals[-1],
                  "train_windows_seen_vs_unseen": memo,
                  "eval_ppl_spread_256x256": ppl_spread.ppl},
        "curve": {"losses": [round(x, 4) for x in r.losses], "evals": r.evals},
        "model": str(folder), "model_sha256": sha256_file(folder / "model.safetensors"),
        "sizes_mb": {"corpus": round(corpus["bytes"] / 2**20, 1),
                     "model": round(sum(f.stat().st_size for f in folder.iterdir()) / 2**20, 1)},
        "seconds": round(time.perf_counter() - t0, 1), "train_seconds": r.seconds,
        "resumed_from": r.resumed_from,
    }
    save_tokens(out, data, tokenize_split(tok, data, "calib"), ev)
    save_results(args.results, result)
    plot(result, result_path(args.results).with_suffix(".png"))
    print(json.dumps({k: result[k] for k in ("params", "final", "seconds", "sizes_mb")}))
    if load:
        print(json.dumps({split: {k: v for k, v in s.items() if k != "tokens_per_expert"} for split, s in load.items()}))


def plot(result: dict, path: Path) -> None:
    """Training loss (raw, smoothed) and the logged eval / train-window losses against steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lowbit.train.metrics import smooth

    losses = result["curve"]["losses"]
    evals = result["curve"]["evals"]
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = range(1, len(losses) + 1)
    ax.plot(steps, losses, color="C0", alpha=0.25, linewidth=0.8)
    ax.plot(steps, smooth(losses, 50), color="C0", label="train batch loss (mean of 50)")
    ax.plot([e["step"] for e in evals], [e["eval_loss"] for e in evals], "o-", color="C1", ms=3,
            label="eval split (odd files)")
    ax.plot([e["step"] for e in evals], [e["train_window_loss"] for e in evals], "s--", color="C2", ms=3,
            label="train split (same number of windows)")
    ax.set_ylim(top=min(max(losses), 8.0))
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    arch = result["settings"].get("arch", "llama")
    ax.set_title(f"organism pre-training (Python stdlib, {arch})")
    ax.legend()
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    main()
