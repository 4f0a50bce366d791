"""`lowbit quantize`: load, (evaluate FP), quantize, evaluate, save."""

from __future__ import annotations

import argparse

from lowbit.api.export import TARGETS as EXPORT_TARGETS
from lowbit.cli import common
from lowbit.cli.common import UNSET

MIXED_FLAGS = ("avg_bits", "options", "delta_mode", "tie_qkv", "count_scales")
CALIB_FLAGS = ("nsamples", "seqlen")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize", help="post-training quantization of a model",
                       description="Quantize MODEL with a scheme (or a plan, or a mixed-precision budget), report "
                                   "FP vs quantized perplexity, and save a lowbit checkpoint to --out.")
    common.add_model(p)
    p.add_argument("--scheme", default=UNSET, help="scheme name, e.g. w4g128, w2g64, nvfp4-46, mxfp4, "
                   "q4_k (llama.cpp K-quants q2_k..q6_k), or a llama.cpp file-type mix (q4_k_m, q3_k_m, "
                   "q2_k_s, gguf:q2_k, ...: per-layer K types as llama.cpp picks them); default w4g128")
    p.add_argument("--plan", metavar="FILE", default=None, help="a plan JSON (layer -> scheme) instead of --scheme")
    from lowbit.api.quantize import method_flags, method_names

    p.add_argument("--method", default="rtn", help=f"{' | '.join(method_names())} (default rtn)")
    p.add_argument("--lm-head", action="store_true", help="also quantize the lm_head (kept 16-bit by default)")
    common.add_keep(p)
    p.add_argument("--export-to", choices=EXPORT_TARGETS, default=None,
                   help="the export the checkpoint is for: a plan it cannot hold (e.g. w4g128 on rows of 576 "
                        "columns for compressed-tensors) is refused before quantizing. Without it, each export "
                        "that cannot hold the plan is named in a warning. With --stream, --out is written in that "
                        "format directly (compressed-tensors shard by shard; gguf tensor by tensor, --out FILE.gguf)")
    p.add_argument("--kv", metavar="SCHEME", default=None,
                   help="also quantize the KV cache (keys after RoPE, values): fp8 / int8 (static per-layer scales "
                        "calibrated on the calibration split; fp8 is what vLLM's kv_cache_dtype=fp8 loads), "
                        "fp8-head / int8-head (per KV head), fp8-token / int8-token (dynamic), int4 (groups of 32 "
                        "along head_dim), nvfp4, mxfp4; add -rot to rotate keys and values by a Hadamard per head "
                        "(QuaRot; for 4-bit KV). Options: int4:block=64, fp8:scale=rowmax (FP8 scales mapping the mean "
                        "over calibration rows of each row's abs-max to 448, the default of -rot and centered caches; "
                        "fp8 / fp8-head default to scale=headroom: to 256, leaving E4M3's top binade for the larger "
                        "values of long sequences), fp8:scale=amax (the largest abs-max), "
                        "fp8:scale=attn (searched by the attention output's error), fp8:center (any scheme: a calibrated "
                        "per-head, per-channel mean subtracted before quantizing and added back; exact in function, "
                        "lowbit-only: vLLM's cache holds no offset), fp8:center=rope (the keys' mean taken before "
                        "RoPE and turned to each position: what long contexts need; lowbit-only). Several, with "
                        "--kv-bits: the candidates of a "
                        "per-layer choice")
    p.add_argument("--kv-bits", metavar="B", type=float, default=None,
                   help="mixed-precision KV cache: each layer gets one of the --kv schemes (e.g. --kv fp8,int8,int4), "
                        "chosen by DeltaLoss's KV term on the calibration split so that the cache averages at most B "
                        "bits per key / value element, run-time scales included (rtn and other whole-model methods; "
                        "native checkpoint: vLLM's kv_cache_scheme is one for all layers)")
    st = p.add_argument_group("streaming (data-free, for models bigger than memory)")
    st.add_argument("--stream", action="store_true",
                    help="quantize MODEL (an HF folder: float, FP8, gpt-oss MXFP4 or compressed-tensors "
                         "safetensors; or a .gguf file, dequantized per tensor) tensor by tensor "
                         "without building the model: peak memory is about the largest tensor plus one output "
                         "shard; resumable per shard; the same checkpoint rtn writes (its search on the weights "
                         "alone, or --no-search). No calibration data, no perplexity")
    st.add_argument("--shard-mb", type=common.positive("--shard-mb"), default=UNSET,
                    help="with --stream: MiB of output per shard (256)")
    r = p.add_argument_group("float pre-steps (any method; they keep the float model's function)")
    r.add_argument("--rotate", action="store_true",
                   help="rotate the residual stream by a randomized Hadamard matrix fused into the weights (norm "
                        "scales folded first; a tied lm_head is untied); llama-style blocks only")
    r.add_argument("--rotate-keep", metavar="auto|N", default=UNSET,
                   help="with --rotate: channels left out of the rotation. auto = the channels some RMSNorm "
                        "switches off (scale < 2%% of its median: the 'massive' channels of SmolLM2 and many LLMs, "
                        "whose quantization error a rotation would otherwise spread), N = the N quietest; "
                        "default 0 = rotate every channel")
    r.add_argument("--rotate-online", metavar="LAYERS", default=UNSET,
                   help="rotate these Linears' inputs by a Hadamard at run time, their weights rotated to match "
                        "(comma-separated names in every block, e.g. down_proj: QuaRot's rotation for activation "
                        "quantization, with or without --rotate). Kept by lowbit's native format; the "
                        "compressed-tensors and GGUF exports refuse such a model")
    r.add_argument("--awq", action="store_true",
                   help="AWQ: search activation-aware per-channel scales on the calibration data and fold them into "
                        "the preceding norm / Linear before the method quantizes")
    g = p.add_argument_group("method settings (each applies to the methods named)")
    for spec in method_flags():  # generated from each method's settings dataclass
        _add_method_flag(g, spec)
    g.add_argument("--cache-device", choices=("device", "cpu", "disk"), default=None,
                   help="gptq, signround, signround2, rtn with data and --offload-dir (and --awq): where the cached "
                        "activations live: device "
                        "(default) or cpu "
                        "(host memory streamed per mini-batch: the most memory-lean mode for large models on "
                        "small GPUs) or disk (memory-mapped files in --offload-dir, for calibration sets whose "
                        "activations memory cannot hold; chosen by itself, with a warning, when only they do not fit)")
    g.add_argument("--workdir", default=None,
                   help="gptq, signround, signround2, rtn with data or --rotate and --offload-dir (and --awq): "
                        "folder for per-block results (resume)")
    from lowbit.api.quantize import memory_help

    g.add_argument("--offload-dir", default=None,
                   help="gptq, signround, signround2, rtn with calibration data (its importance search) or with "
                        "--rotate / --rotate-online (data-free: the walk only rotates and rounds each block) (and "
                        "--awq): keep blocks on disk, one block's weights in memory. "
                        "On a safetensors folder the model is built on meta and each block read from the checkpoint "
                        "when its turn comes (--rotate and --awq are applied to it then, the tables rotated once); "
                        "with --no-eval each finished block is written here and freed too, so "
                        "the quantized blocks do not pile up in memory. " + memory_help().replace("%", "%%"))
    m = p.add_argument_group("mixed precision (any method)")
    m.add_argument("--avg-bits", type=float, default=UNSET, help="average bits per weight budget")
    m.add_argument("--options", default=UNSET, help="comma-separated candidate schemes, e.g. w2g64,w4g128")
    m.add_argument("--delta-mode", choices=("abs", "signed"), default=UNSET, help="DeltaLoss score (abs)")
    m.add_argument("--tie-qkv", action="store_true", default=UNSET, help="q/k/v of a block share one scheme")
    m.add_argument("--ignore-scale-bits", dest="count_scales", action="store_false", default=UNSET,
                   help="the budget counts element bits only")
    c = p.add_argument_group("calibration (when the method or the mixed plan uses data)")
    c.add_argument("--nsamples", type=common.positive("--nsamples"), default=UNSET, help="calibration samples (32)")
    c.add_argument("--seqlen", type=common.positive("--seqlen"), default=UNSET,
                   help="calibration tokens per sample (256)")
    c.add_argument("--seed", type=int, default=UNSET,
                   help="where calibration samples start, and the tuning seed of signround methods (0)")
    common.add_device(p, "block tuning (one block at a time) and the whole-model passes (evaluation, RTN, "
                         "DeltaLoss)")
    common.add_data(p)
    common.add_eval(p)
    common.add_out(p)
    common.add_json(p)
    p.set_defaults(func=run)


def _add_method_flag(group: argparse._ArgumentGroup, spec) -> None:
    """One method-settings flag (`lowbit.api.quantize.FlagSpec`); absent from the namespace unless given."""
    name = common.flag(spec.name)
    kw: dict = {"default": UNSET, "help": spec.help.replace("%", "%%")}
    if spec.kind == "bool":
        kw["action"] = argparse.BooleanOptionalAction
    elif spec.choices:
        kw["choices"] = spec.choices
    elif spec.kind == "int":
        kw["type"] = {0: common.nonnegative(name), 1: common.positive(name)}.get(spec.minimum, int)
    elif spec.kind == "float":
        kw["type"] = float
    group.add_argument(name, **kw)


def method_flag_names() -> list[str]:
    """The settings fields (and ``preset``) the method-settings flags set."""
    from lowbit.api.quantize import method_flags

    return [spec.name for spec in method_flags()]


def build_job(args: argparse.Namespace):
    """The `QuantizeJob` the flags describe; a flag the chosen path cannot honour is an error."""
    from lowbit.api import Calibration, QuantizeJob
    from lowbit.api.quantize import make_settings, method_options
    from lowbit.errors import ConfigError

    opts = common.given(args, *method_flag_names())
    calib = common.given(args, *CALIB_FLAGS, "seed")
    if "seed" in calib and "seed" in method_options(args.method):
        opts["seed"] = calib["seed"]
    settings = make_settings(args.method, opts)
    mixed = _mixed(args)
    job = QuantizeJob(out=args.out, model=args.model, scheme=vars(args).get("scheme"), plan_file=args.plan,
                      lm_head=args.lm_head, method=args.method, settings=settings, mixed=mixed,
                      calib=Calibration(args.data, **calib), evaluation=common.evaluation(args, args.data),
                      device=args.device, workdir=args.workdir, offload_dir=args.offload_dir,
                      cache_device=args.cache_device, rotate=_rotation(args), awq=args.awq, force=args.force,
                      progress=not args.json, export_to=args.export_to, keep=common.keep(args),
                      kv=args.kv, kv_bits=args.kv_bits)
    if calib and not job.needs_calib:
        raise ConfigError(f"{', '.join(common.flag(k) for k in calib)} set the calibration data, which "
                          f"--method {args.method} {'with --no-search ' if args.method == 'rtn' else ''}does not "
                          "use; drop them (or use --search, --awq, --avg-bits, or a tuning method)")
    return job


def _rotation(args: argparse.Namespace):
    """--rotate, --rotate-keep, --rotate-online: the rotation's settings (True = defaults, False = off)."""
    from lowbit.api.quantize import RotationSettings
    from lowbit.errors import ConfigError

    keep = vars(args).get("rotate_keep")
    online = vars(args).get("rotate_online")
    if keep is not None and not args.rotate:
        raise ConfigError("--rotate-keep sets which channels --rotate leaves alone; add --rotate or drop it")
    kw: dict = {}
    if keep is not None:
        if keep != "auto" and not keep.isdigit():
            raise ConfigError(f"--rotate-keep takes auto or a number of channels >= 0, got {keep!r}")
        kw["keep"] = None if keep == "auto" else int(keep)
    if online is not None:
        names = tuple(n.strip() for n in online.split(",") if n.strip())
        if not names:
            raise ConfigError("--rotate-online takes Linear names (comma-separated, e.g. down_proj)")
        kw.update(online=names, residual=args.rotate)
    return RotationSettings(**kw) if kw else args.rotate


def _mixed(args: argparse.Namespace):
    from lowbit.api.quantize import MixedSettings
    from lowbit.errors import ConfigError

    got = common.given(args, *MIXED_FLAGS)
    if not got:
        return None
    if "avg_bits" not in got or "options" not in got:
        extra = [common.flag(k) for k in got if k not in ("avg_bits", "options")]
        raise ConfigError("mixed precision needs both --avg-bits and --options (e.g. --avg-bits 3 --options "
                          f"w2g64,w4g128){'; ' + ', '.join(extra) + ' apply only to it' if extra else ''}")
    tune = vars(args).get("tune_dtype")
    return MixedSettings(**got, **({"dtype": tune} if tune is not None else {}))


# what --stream takes besides MODEL and --out; every other flag given with it is refused
STREAM_FLAGS = ("model", "out", "scheme", "plan", "lm_head", "keep", "force", "json", "no_eval", "search", "shard_mb",
                "method", "stream", "threads", "export_to")


def stream_job(args: argparse.Namespace):
    """The streamed job the flags describe; a flag that needs the model in memory or data is an error."""
    from lowbit.api.stream import StreamJob
    from lowbit.errors import ConfigError

    if args.method != "rtn":
        raise ConfigError(f"--stream is data-free round-to-nearest; --method {args.method} needs the model and "
                          "calibration data: drop --stream (with --offload-dir it keeps one block in memory)")
    defaults = {"plan": None, "lm_head": False, "keep": None, "force": False, "json": False, "no_eval": False,
                "rotate": False, "awq": False, "workdir": None, "offload_dir": None,
                "cache_device": None, "device": None, "data": None, "kv": None, "kv_bits": None}
    odd = [k for k, v in vars(args).items() if k not in STREAM_FLAGS and k not in ("func", "command")
           and (k not in defaults or v != defaults[k])]
    if odd and odd[0] in ("rotate", "rotate_online", "rotate_keep"):
        raise ConfigError(f"--stream does not rotate ({common.flag(odd[0])}); for data-free RTN with a rotation on a "
                          "model bigger than memory drop --stream and pass --offload-dir DIR --no-eval (one block in "
                          "memory, rotated and rounded as it is read)")
    if odd:
        raise ConfigError(f"{common.flag(odd[0])} does not apply to --stream (data-free, no model in memory, no "
                          "perplexity); drop it, or drop --stream")
    return StreamJob(model=args.model, out=args.out, scheme=vars(args).get("scheme"), plan_file=args.plan,
                     lm_head=args.lm_head, search=vars(args).get("search", True), keep=common.keep(args),
                     shard_mb=vars(args).get("shard_mb", 256), force=args.force, progress=not args.json,
                     export_to=args.export_to)


def run(args: argparse.Namespace) -> dict:
    from lowbit import api

    if args.stream:
        from lowbit.api.stream import stream_quantize

        return stream_quantize(stream_job(args))
    if vars(args).get("shard_mb") is not None:
        from lowbit.errors import ConfigError

        raise ConfigError("--shard-mb applies to --stream only; add --stream or drop it")
    return api.quantize(build_job(args))
