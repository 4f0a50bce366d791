"""How much memory and disk a quantize run takes, from the model's config alone: told before, refused up front.

A block-wise run on a lazily loaded model (``--offload-dir``: the model built on meta, each
decoder block read from the checkpoint when its turn comes, written out and released after)
holds, at its peak, the parts below, none of which grows with the number of blocks (the walk hands
the allocator's freed pages back after each block, `lowbit.ptq.blockwise.release`; measured in
benchmarks/results/bigmodel_calib.md):

- ``runtime``: the interpreter with torch and transformers (measured: ~0.4 GiB);
- ``outside``: the tensors outside the decoder blocks (embeddings, the lm_head when it is not
  tied to them, the final norm), loaded once in the checkpoint's dtype (``torch_dtype`` of its
  config: a bf16 / fp16 checkpoint's tables stay 16-bit, `lowbit.models.narrow_tables`), the
  lm_head in float32 when it is quantized (it is widened before it is rounded);
- ``block``: one decoder block's float32 weights;
- ``caches``: the cached block inputs, ``nsamples x seqlen x hidden`` each, one for GPTQ
  (the quantized chain alone), two for the methods that also track the float outputs;
- ``forward``: one chunk of samples through a block (the MLP's widest activations,
  attention's queries, keys and values);
- ``method``: the method's own state on the block: GPTQ's Hessian of the widest Linear input
  with the copies its factorization makes (~16 bytes per entry), SignRound's rounding and scale parameters with their
  optimizer moments and gradients, the dequantized weights kept for the backward, and the
  backward pass of a mini-batch;
- ``save``: the checkpoint's tensors outside the blocks in their stored width while writing
  (after the walk: the peak is the larger of the two).

RTN with calibration data (its importance search, static input scales) walks the blocks the
same way (the float chain: two caches; its method state is one Linear's rounding). The
pre-steps run per block on such a run (`lowbit.ptq.block_prep`): ``--rotate`` widens the
embedding to float32 and turns it before the walk, then holds it in fp16 (the values the run
ends with) and the lm_head (a tied one untied: a table of its own) in the checkpoint's dtype
while the blocks are turned as they are read, and widens, turns and narrows the head after the
last block (``turn``: a table in float32 beside its fp16 copy and the chunks being turned);
``--awq`` adds its own chain of inputs (two more caches) and its
search's state on the block (the float64 ``X^T X`` of the inputs of o_proj and down_proj, and
the scaled, rounded copies of a group's weights), which is not held at once with the method's.
RTN without data walks the blocks only with ``--rotate`` (`lowbit.ptq.blockwise.rounding`):
no caches, no forward (a 16-token probe through block 0), the rotation's parts and one Linear's
rounding on one block.

--avg-bits on such a run scores its options block by block first (`lowbit.ptq.streamed_deltaloss`):
``deltaloss`` (one block's backward, or the lm_head's on a chunk of samples) and
``deltaloss_caches`` (every block's stored input), a phase of its own before the walk.

Any other run (RTN without data nor rotation, which rounds the whole model at once, a run without
``--offload-dir``) holds the whole float model instead (``whole``), and a run that evaluates
perplexities holds the quantized model (about a byte per weight) at the end. Disk: the output checkpoint, and with
``--offload-dir`` the finished blocks kept there until the output is written (the same bytes).

The figures are upper-side estimates for CPU runs (a GPU holds ``block``, ``caches`` with
--cache-device device, ``forward`` and ``method`` in its own memory instead); the
measurements beside them are in benchmarks/results/bigmodel_calib.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowbit.errors import ConfigError

GiB = 1 << 30
RUNTIME_BYTES = int(0.45 * GiB)  # python + torch + transformers imported, measured on this project's CPU wheel
CHUNK = 8  # samples per block forward (PipelineOptions.chunk)
WEIGHT_BITS = 4.25  # a 4-bit grouped scheme with fp16 scales per 128 (the default w4g128), for the output's size


@dataclass(frozen=True)
class Shape:
    """The sizes of a decoder-only model that memory depends on (a llama-style block; experts counted whole)."""

    layers: int
    hidden: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool = False
    experts: int = 1  # routed experts per block (1 = dense)
    table_bytes: int = 4  # bytes per entry of the tables outside the blocks as a lazy load holds them

    @classmethod
    def from_config(cls, config: Any) -> Shape:
        """From an HF config (attributes or a dict); a config without these sizes is refused by name."""
        get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        need = ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads")
        missing = [k for k in need if get(k) is None]
        if missing:
            raise ConfigError(f"the model's config has no {missing[0]}; lowbit cannot estimate its memory")
        hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
        experts = int(get("num_local_experts") or get("n_routed_experts") or get("num_experts") or 1)
        inter = get("moe_intermediate_size") if experts > 1 and get("moe_intermediate_size") else None
        inter = int(inter or get("intermediate_size") or 4 * hidden)
        return cls(layers=int(get("num_hidden_layers")), hidden=hidden, intermediate=inter,
                   vocab=int(get("vocab_size")), heads=heads, kv_heads=int(get("num_key_value_heads") or heads),
                   head_dim=int(get("head_dim") or hidden // heads), tied=bool(get("tie_word_embeddings", False)),
                   experts=experts, table_bytes=_stored_bytes(get("torch_dtype") or get("dtype")))

    @property
    def attention_params(self) -> int:
        q = self.hidden * self.heads * self.head_dim
        return 2 * q + 2 * self.hidden * self.kv_heads * self.head_dim

    @property
    def mlp_params(self) -> int:
        return 3 * self.hidden * self.intermediate * self.experts

    @property
    def block_params(self) -> int:
        """The matmul weights of one decoder block (norms are negligible)."""
        return self.attention_params + self.mlp_params

    @property
    def outside_params(self) -> int:
        """Embeddings, the lm_head unless tied to them, the final norm."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.block_params + self.outside_params

    @property
    def widest_input(self) -> int:
        """The widest Linear input of a block (GPTQ's largest Hessian is this square)."""
        return max(self.hidden, self.intermediate, self.heads * self.head_dim)


WALK = ("block", "caches", "forward", "method")  # held while a block is worked on, gone when the output is written
APART = ("save", "turn")  # held at other times than the walk: writing the output, rotating the tables before it
DELTALOSS = ("deltaloss", "deltaloss_caches")  # --avg-bits' streamed DeltaLoss passes: one phase before the walk


@dataclass(frozen=True)
class Estimate:
    """Bytes a run holds (``parts``: the walk's parts and the save's are not held at once) and writes to disk
    (``disk`` by folder)."""

    parts: dict[str, int]
    disk: dict[str, int] = field(default_factory=dict)
    flat: bool = True  # whether the peak is independent of the model's depth

    @property
    def peak(self) -> int:
        """The parts held throughout, plus the largest of the walk's (the block and its work), the save's and the
        rotation's turning of the tables before the walk."""
        walk = sum(v for k, v in self.parts.items() if k in WALK)
        held = sum(v for k, v in self.parts.items() if k not in WALK and k not in APART and k not in DELTALOSS)
        scoring = sum(self.parts.get(k, 0) for k in DELTALOSS)
        return held + max(walk, scoring, *(self.parts.get(k, 0) for k in APART))

    def to_dict(self) -> dict[str, Any]:
        return {"peak_bytes": self.peak, "parts": dict(self.parts), "disk": dict(self.disk), "flat_in_depth": self.flat}

    def describe(self) -> str:
        """One line: the peak and its largest parts, in GiB."""
        parts = sorted(self.parts.items(), key=lambda kv: -kv[1])
        body = ", ".join(f"{k} {v / GiB:.2f}" for k, v in parts if v >= GiB // 100)
        return f"~{self.peak / GiB:.1f} GiB ({body} GiB)"


TRACKS_FP = {"signround": True, "signround2": True, "gptq": False, "rtn": True}  # a second cache besides X_q
# (RTN block by block carries the float chain: X_fp and the block's float outputs)


def estimate(shape: Shape, method: str, nsamples: int, seqlen: int, *, lazy: bool = True, search: bool = False,
             evaluate: bool = False, batch_size: int = 8, lm_head: bool = False,
             weight_bits: float = WEIGHT_BITS, rotate: bool = False, awq: bool = False,
             deltaloss: tuple[int, int, bool] | None = None) -> Estimate:
    """The memory and disk of quantizing ``shape`` with ``method`` on ``nsamples x seqlen`` calibration tokens.

    lazy: block-wise from the checkpoint (``--offload-dir``), else the whole float model is
    loaded. search: GPTQ's importance-weighted scale search (another cache for the float
    chain's statistics). evaluate: perplexity passes (the quantized model held whole).
    rotate / awq: the pre-steps (per block on a lazy run, see the module doc). deltaloss: (samples, seqlen,
    lm_head planned) of --avg-bits' DeltaLoss passes, block by block on a lazy run (`_deltaloss_parts`), else on
    the whole model (`_deltaloss_whole`).
    """
    f32 = 4
    s = shape
    tokens = nsamples * seqlen
    # RTN walks the blocks with data, or without it to rotate them (no caches then: nsamples 0)
    blockwise = method in TRACKS_FP and (method != "rtn" or nsamples > 0 or rotate)
    out_bytes = int(s.layers * s.block_params * weight_bits / 8) + _outside_stored(s, lm_head, weight_bits)
    disk = {"out": out_bytes}
    if not (lazy and blockwise):
        parts = {"runtime": RUNTIME_BYTES, "whole": s.params * f32}
        if blockwise and method != "rtn":  # RTN on a model in memory: one calibration pass, no walk
            parts |= _block_parts(s, method, tokens, seqlen, search, batch_size)
        elif nsamples:  # RTN's importance: the sums of squares of every Linear input
            parts["forward"] = _forward(s, seqlen)
        if deltaloss is not None:  # --avg-bits on the model in memory: DeltaLoss back-propagates all of it
            parts["deltaloss"] = _deltaloss_whole(s, *deltaloss)
        parts["save"] = out_bytes
        return Estimate(parts, disk, flat=False)
    turn = 0
    if rotate:  # the embedding widened to float32 and turned before the walk, held in fp16 once block 0's inputs are
        # captured; the lm_head (a tied one untied into a copy) kept in the stored dtype through the walk, widened,
        # turned and narrowed to fp16 after it (`lowbit.ptq.block_prep.LazyRotation.narrow`: the fp16 values the run
        # ends with; a table beyond fp16's range would stay float32, 2 bytes per entry more than counted here)
        table = s.vocab * s.hidden
        outside = table * 2 + table * (4 if lm_head else s.table_bytes) + 4 * s.hidden
        # apart from the walk: a table in float32 beside its fp16 copy or its stored one (the embedding before the
        # walk, the head after it: 4 bytes per entry above the 2 held), or in float32 alone while its chunks are
        # turned, with a float32 chunk of rows being folded or cast (measured at 3B: 3.41 GiB, without that chunk
        # 3.40 was counted; bigmodel_calib.md)
        turn = max(table * 4, table * 2 + _turn(s)) + _ROWS * s.hidden * 4
        s = dataclasses.replace(s, tied=False)
    else:
        outside = _outside_held(s, lm_head)
    parts = {"runtime": RUNTIME_BYTES, "outside": outside, "block": s.block_params * f32}
    parts |= _block_parts(s, method, tokens, seqlen, search, batch_size)
    if awq:  # its own chain (the block's inputs and float outputs); its search and the method's are not at once
        parts["caches"] += 2 * tokens * s.hidden * f32
        parts["method"] = max(parts["method"], _awq_state(s))
    if turn:
        parts["turn"] = turn
    if deltaloss is not None:
        parts |= _deltaloss_parts(s, *deltaloss)
    if evaluate:  # the quantized blocks stay in memory to be evaluated: a byte per weight (codes) plus scales
        parts["quantized"] = int(s.layers * s.block_params * 1.07)
        parts["save"] = out_bytes
        return Estimate(parts, disk, flat=False)
    parts["save"] = _outside_stored(s, lm_head, weight_bits)
    disk["offload"] = out_bytes - parts["save"]  # the finished blocks, moved into the output at the end
    return Estimate(parts, disk)


def _block_parts(s: Shape, method: str, tokens: int, seqlen: int, search: bool, batch_size: int) -> dict[str, int]:
    f32 = 4
    caches = 1 + int(TRACKS_FP.get(method, False) or search)
    parts = {"caches": caches * tokens * s.hidden * f32, "forward": _forward(s, seqlen)}
    if method == "rtn":  # one Linear rounded at a time: its weights, the search's candidates and the codes (8 fp32
        # copies of the widest: 4 were 6 % under the measured 1.1B peak; 6 were 4.6 % under the 8B data-free rotated
        # row, whose high-water mark crept up 6 % over 32 blocks with the free chunks glibc keeps, bigmodel_calib.md)
        parts["method"] = 8 * s.intermediate * s.experts * s.hidden * f32
    elif method == "gptq":
        # the widest input's Hessian: summed in float64 beside one batch's float32 product (12 bytes per entry),
        # then held in float32 while its factor is built in place beside it (at most 3 more float32 copies:
        # 16 bytes per entry at the peak, `lowbit.ptq.gptq.inverse_factor`); the widest group of Linears
        # sharing an input (gate + up) stacked in float32, with its dequantized copy and the error rows
        n = s.widest_input
        group = 2 * s.intermediate * s.experts * s.hidden
        parts["method"] = 16 * n * n + 4 * group * f32
    else:  # SignRound: V, scale / min parameters, Adam's two moments and the gradients, per block weight, and the
        # dequantized weights the forward keeps for the backward (without them the estimate was 8 % under the
        # measured high-water mark at 1.1B, 13 % with the per-block growth since fixed: bigmodel_calib.md)
        per_weight = 5 * f32
        backward = batch_size * seqlen * (4 * s.intermediate + 8 * s.hidden) * f32 * 2
        parts["method"] = s.block_params * per_weight + backward
    return parts


_ROWS = 8192  # rows of a table turned, folded or cast at a time (`lowbit.ptq.rotation`)


def _deltaloss_parts(s: Shape, nsamples: int, seqlen: int, lm_head: bool) -> dict[str, int]:
    """--avg-bits' DeltaLoss passes block by block (`lowbit.ptq.streamed_deltaloss`), before the walk and not at
    once with it: the stored input of every block and the last one's output with one gradient cache (``layers + 2``
    caches of ``nsamples x seqlen x hidden`` in float32, moved to disk with the walk's caches), and at a time
    either one block's backward (its float32 weights, their quantized copy, the originals kept to score against,
    the gradients, and a chunk of 4 samples' saved activations and their gradients) or the head's (the final
    hidden states, the logits of a chunk with their float copy, log-softmax and gradients in float32, and the head's
    weight widened for the call from the stored table with its bf16 autocast copy, the one saved for the backward;
    a planned lm_head's weights 3 more times). The head's part was 20 % under the measured peak at the 3B shape
    (128k vocabulary, 3 logits copies and no weight copy counted); this upper side is 17 % over it there."""
    f32, chunk = 4, 4
    block = 4 * s.block_params * f32 + 2 * _saved_activations(s, chunk, seqlen)
    table, logits = s.vocab * s.hidden, chunk * seqlen * s.vocab * f32
    # the forward's moment (the float32 widening and the bf16 copy at once) or the backward's (the kept copy, four
    # logits-sized tensors); upper side for fp32 and bf16 passes alike
    head = max(6 * table + logits, 4 * table + 4 * logits) + (3 * table * f32 if lm_head else 0)
    return {"deltaloss": max(block, head), "deltaloss_caches": (s.layers + 2) * nsamples * seqlen * s.hidden * f32}


def _deltaloss_whole(s: Shape, nsamples: int, seqlen: int, lm_head: bool) -> int:
    """--avg-bits' DeltaLoss on the whole model in memory (`lowbit.ptq.sensitivity.delta_loss`), beside the float
    model: every planned weight's original and gradient in float32 and its bf16 copy under autocast, with 2 bytes
    more for the quantized and scored temporaries and the allocator's slack (12 bytes per weight: 10 were 2 % under
    the measured peak at the 1.1B width, 4 blocks; this phase was not estimated at all before, 53 % under:
    bigmodel_calib.md), every block's saved activations of a chunk of 4 samples at once, and the head's logits."""
    f32, chunk = 4, 4
    planned = s.layers * s.block_params + (s.vocab * s.hidden if lm_head else 0)
    return 12 * planned + s.layers * _saved_activations(s, chunk, seqlen) + 3 * chunk * seqlen * s.vocab * f32


def _saved_activations(s: Shape, chunk: int, seqlen: int) -> int:
    """What one block's forward keeps for its backward on a chunk of samples, in float32: the MLP's three
    intermediate-wide tensors (of at most 2 experts per token), six hidden-wide ones and the attention's
    query / key / value / output widths."""
    attention = 2 * s.heads * s.head_dim + 2 * s.kv_heads * s.head_dim
    return chunk * seqlen * (3 * s.intermediate * min(s.experts, 2) + 6 * s.hidden + attention) * 4


def _turn(s: Shape) -> int:
    """Rotating the tables (`lowbit.ptq.rotation.rotate_tables`): a chunk of 8192 rows in float64, turned, and
    its float32 copy, ~4 float64 copies of the chunk at once (the Walsh-Hadamard steps')."""
    return _ROWS * s.hidden * 8 * 4


def _awq_state(s: Shape) -> int:
    """AWQ's search on one block: the float64 ``X^T X`` of down_proj's (the widest) input with its float32 copy,
    and a group's weights (gate + up) in float32 with their scaled and rounded copies (`lowbit.ptq.awq`)."""
    n = s.intermediate * s.experts
    return 12 * n * n + 4 * 2 * n * s.hidden * 4


def _forward(s: Shape, seqlen: int) -> int:
    """One chunk through one block: the MLP's widest activations and attention's queries, keys, values and output
    (float32; the CPU's fused attention kernel never stores the score matrix)."""
    attention = 2 * s.heads * s.head_dim + 2 * s.kv_heads * s.head_dim
    return CHUNK * seqlen * (3 * s.intermediate + 2 * s.hidden + attention) * 4


def _stored_bytes(dtype: Any) -> int:
    """Bytes per entry of a checkpoint whose config says ``torch_dtype: dtype`` (float32 where it says nothing)."""
    return 2 if str(dtype).removeprefix("torch.") in ("bfloat16", "float16") else 4


_HEADER_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def with_stored_dtype(config: dict[str, Any], folder: Path) -> dict[str, Any]:
    """``config`` with ``torch_dtype`` taken from the safetensors headers in ``folder`` where it names none (the
    dtype of the largest tensor: the embedding table); headers only, no data is read."""
    if config.get("torch_dtype") or config.get("dtype"):
        return config
    from lowbit.errors import ModelError
    from lowbit.models.hf_folder import read_headers, weight_files

    try:
        headers = read_headers(folder, weight_files(folder))
    except ModelError:  # an unreadable folder is refused by name when it is loaded
        return config
    if not headers:
        return config
    dtype, _, _ = max(headers.values(), key=lambda h: _numel(h[1]))
    return config | {"torch_dtype": _HEADER_DTYPES.get(dtype, "float32")}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _outside_held(s: Shape, lm_head: bool) -> int:
    """The tensors outside the blocks as a lazy load holds them: the tables in the checkpoint's dtype (a quantized
    lm_head in float32: widened to be rounded), the final norm in float32."""
    emb = s.vocab * s.hidden
    head = 0 if s.tied else emb * (4 if lm_head else s.table_bytes)
    return emb * s.table_bytes + head + 4 * s.hidden


def _outside_stored(s: Shape, lm_head: bool, weight_bits: float) -> int:
    """The stored bytes of the tensors outside the blocks: fp16 embeddings, the lm_head quantized or fp16."""
    head = 0 if s.tied else s.vocab * s.hidden * (weight_bits / 8 if lm_head else 2)
    return int(s.vocab * s.hidden * 2 + head + 2 * s.hidden)


def caches_on_disk(est: Estimate) -> Estimate:
    """``est`` with the activation caches in files in the offload folder (``--cache-device disk``)."""
    parts = dict(est.parts)
    caches = parts.pop("caches", 0) + parts.pop("deltaloss_caches", 0)
    disk = dict(est.disk)
    disk["offload"] = disk.get("offload", 0) + caches
    return Estimate(parts, disk, est.flat)


# ----------------------------------------------------------------------------------------------- machine


def mem_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The kernel's MemAvailable (bytes), None where there is no /proc/meminfo."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def refusal(est: Estimate, available: int | None, free_disk: dict[str, int | None],
            margin: float = 1.1, whole_by: str | None = None, fix: str | None = None) -> str | None:
    """Why the machine cannot run it (with the numbers), or None when it can.

    available: free memory (MemAvailable); free_disk: folder role ("out", "offload") -> free bytes.
    whole_by: the flag that makes the run load the whole model although --offload-dir was given.
    fix: what to do instead, where the caller knows better than the parts tell (`ROTATE_FIX`).
    """
    if available is not None and est.peak * margin > available:
        fix = fix if fix is not None else _memory_fix(est, whole_by)
        caches = est.parts.get("caches", 0) + est.parts.get("deltaloss_caches", 0)
        if caches >= GiB // 10 and whole_by is None:
            fix += f" (--cache-device disk moves the {caches / GiB:.2f} GiB of activation caches to disk)"
        return (f"this run needs about {est.describe()} of memory and {available / GiB:.1f} GiB is available "
                f"(MemAvailable); {fix}")
    for role, need in est.disk.items():
        free = free_disk.get(role)
        if free is not None and need > free:
            flag = "--out" if role == "out" else "--offload-dir"
            return (f"{flag} needs about {need / GiB:.2f} GiB of disk ({'the quantized checkpoint' if role == 'out' else 'the finished blocks until the output is written'}) "
                    f"and its device has {free / GiB:.2f} GiB free; free some space or choose another {flag}")
    return None


def _memory_fix(est: Estimate, whole_by: str | None) -> str:
    """What to do about a run that does not fit, read from its parts."""
    if whole_by is not None:
        return f"{whole_by} needs the whole float model in memory: drop it to run block by block"
    if not est.flat:
        return "pass --offload-dir DIR (one block in memory) and --no-eval, or fewer --nsamples / a shorter --seqlen"
    if est.parts.get("method", 0) > est.parts.get("caches", 0) + est.parts.get("forward", 0):
        return (f"the method's work on one block ({est.parts['method'] / GiB:.2f} GiB) does not shrink with fewer "
                "samples: a machine with more memory, or a GPU (--device cuda) for the block's work")
    return "fewer --nsamples or a shorter --seqlen, or a machine with more memory"

ROTATE_FIX = ("RTN without data rotated block by block holds the tables (the embedding in float32) and one block, "
              "which no flag shrinks: drop --rotate / --rotate-online and pass --stream (one tensor at a time), or a "
              "machine with more memory")


def rotate_example(name: str = "8B (Llama-3.1)") -> str:
    """The --help text's example of data-free RTN rotated block by block: its peak beside --stream's."""
    s = Shape.from_config(EXAMPLES[name])
    return f"{name.split()[0]} ~{estimate(s, 'rtn', 0, 0, rotate=True).peak / GiB:.1f} GiB"


def help_table(nsamples: int = 128, seqlen: int = 2048) -> str:
    """The --help text's examples: peak memory of GPTQ / SignRoundV2 block by block at common shapes."""
    rows = []
    for name, cfg in EXAMPLES.items():
        s = Shape.from_config(cfg)
        g = estimate(s, "gptq", nsamples, seqlen).peak / GiB
        r = estimate(s, "signround2", nsamples, seqlen).peak / GiB
        rows.append(f"{name} gptq ~{g:.0f} GiB, signround2 ~{r:.0f} GiB")
    return "; ".join(rows)


EXAMPLES = {  # public configs' sizes and dtype
    "1.1B (TinyLlama)": dict(num_hidden_layers=22, hidden_size=2048, intermediate_size=5632, vocab_size=32000,
                             num_attention_heads=32, num_key_value_heads=4,
                             torch_dtype="bfloat16"),
    "8B (Llama-3.1)": dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, vocab_size=128256,
                           num_attention_heads=32, num_key_value_heads=8,
                           torch_dtype="bfloat16"),
    "70B (Llama-3.1)": dict(num_hidden_layers=80, hidden_size=8192, intermediate_size=28672, vocab_size=128256,
                            num_attention_heads=64, num_key_value_heads=8,
                            torch_dtype="bfloat16"),
}
