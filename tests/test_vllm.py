"""vLLM's CPU build loads lowbit's compressed-tensors exports of a tiny Llama and computes lowbit's logits.

vLLM lives in an environment of its own (`make vllm-setup`; run these tests with
``.venv-vllm/bin/python -m pytest tests/test_vllm.py``): elsewhere they are skipped, with
that reason. Each export is served by vLLM in a fresh process (one engine per process),
which returns the full log-softmax over the 256-token vocabulary at every prompt position
(``prompt_logprobs``); lowbit's own model gives the reference. vLLM computes in bf16 (its
INT4 CPU kernel needs it; on AMX processors it also quantizes that kernel's activations to
int8 by default), so they agree to that rounding, not bit for bit: a wrong zero point,
scale, packing order or layout moves log-probabilities by whole units.
"""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

vllm = pytest.importorskip("vllm", reason="vLLM is not installed in this environment: make vllm-setup, then run "
                                          "these tests with .venv-vllm/bin/python -m pytest tests/test_vllm.py")
pytest.importorskip("compressed_tensors")

from lowbit.files import compressed_tensors as ct  # noqa: E402
from lowbit.plans.plan import Plan  # noqa: E402
from lowbit.ptq.rtn import rtn_quantize  # noqa: E402

VOCAB = 256
# vLLM's CPU wheel carries two builds and loads _C_AVX512 or _C_AVX2 by this test (vllm/platforms/cpu.py); the
# AVX2 one has no INT4 kernels (no ``cpu_gemm_wna16``, no WNA16 MoE backend) and a less exact INT8 GEMM
AVX512 = torch.cpu._is_avx512_supported()
NO_INT4 = pytest.mark.skipif(not AVX512, reason="vLLM CPU's INT4 kernels (cpu_gemm_wna16, its WNA16 MoE backend) are "
                             "only in its AVX-512 build and this CPU has no AVX-512: vLLM refuses the export "
                             "(benchmarks/results/engines.md, 'CPUs without AVX-512')")
# its INT4 MoE backends are narrower still: CPUExpertsInt4 needs AMX (experts/cpu_moe.py, _supports_current_device)
# and ZentorchExpertsInt4 needs AMD's zentorch plugin; an AVX-512 CPU with neither (an AMD EPYC here) is refused
AMX = torch.cpu._is_amx_tile_supported()
NO_INT4_MOE = pytest.mark.skipif(
    not AMX and importlib.util.find_spec("zentorch") is None,
    reason="vLLM CPU's INT4 MoE backends need AMX (CPUExpertsInt4) or AMD's zentorch plugin (ZentorchExpertsInt4); this "
           "CPU has no AMX and zentorch is not installed: vLLM refuses the export with 'No WNA16 MoE backend supports the "
           "deployment configuration' (benchmarks/results/engines.md)")
SERVE = textwrap.dedent("""
    import json, sys
    from vllm import LLM, SamplingParams
    path, ids = sys.argv[1], json.loads(sys.argv[2])
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256, max_logprobs=256,
              enforce_eager=True, enable_prefix_caching=False, seed=0)
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=256,
                                                                   temperature=0), use_tqdm=False)
    rows = [None if d is None else {int(t): lp.logprob for t, lp in d.items()} for d in out[0].prompt_logprobs]
    print("ROWS " + json.dumps(rows))
""")


def tiny() -> LlamaForCausalLM:
    """A model vLLM's CPU attention takes (head size 64); float weights on the bf16 grid, as vLLM holds them."""
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    return model


def served_logprobs(path, ids: list[int]) -> torch.Tensor:
    """``[len(ids) - 1, vocab]`` log-probabilities vLLM gives each next token of ``ids``."""
    # vLLM's defaults: on AMX processors its INT4 kernel quantizes activations to int8 (VLLM_CPU_INT4_W4A8=1);
    # with 0 its W4A16 kernel died with SIGILL on these small shapes here (it serves the bundled model's)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    r = subprocess.run([sys.executable, "-c", SERVE, str(path), json.dumps(ids)], capture_output=True, text=True,
                       env=env, timeout=900)
    line = [s for s in r.stdout.splitlines() if s.startswith("ROWS ")]
    assert r.returncode == 0 and line, f"vLLM failed to serve {path}:\n{r.stderr[-3000:]}"
    rows = json.loads(line[-1][5:])[1:]
    lp = torch.full((len(rows), VOCAB), float("nan"))
    for i, row in enumerate(rows):
        for tok, v in row.items():
            lp[i, int(tok)] = v
    return lp


@pytest.mark.parametrize("recipe", [pytest.param("w4g64", marks=NO_INT4), "w8a8-int8"])
def test_vllm_serves_lowbit_export_with_lowbits_logits(tmp_path, recipe):
    model = tiny()
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    rtn_quantize(model, Plan.uniform(names, recipe), search=False, progress=False)
    # vLLM's AVX2 build computes INT8 GEMMs less exactly (measured mean / max 0.022 / 0.11 and the same argmax at
    # 84 % of positions, on an AMD EPYC without AVX-512, against 0.01 / 0.15 / 90 % bounds met on AVX-512; the bundled
    # model's W8A8 perplexity through it is +3.7 %, engines.md): looser bounds there, still far below a layout
    # error's whole units (and its argmax agreement of a few per cent)
    bounds = {} if AVX512 or recipe != "w8a8-int8" else {"mean": 0.05, "most": 0.3, "agree": 0.7}
    served_like_lowbit(model, tmp_path / "ct", recipe, **bounds)


def served_like_lowbit(model, out, label: str, mean: float = 0.01, most: float = 0.15, agree: float = 0.9) -> None:
    """Export ``model``, serve it, and compare vLLM's log-probabilities with lowbit's own (mean / max bounds, the
    share of positions with the same most likely token)."""
    ct.export(model, None, out)
    ids = torch.randint(0, VOCAB, (96,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = torch.log_softmax(model(ids[None]).logits[0, :-1].float(), -1)
    got = served_logprobs(out, ids.tolist())
    assert not got.isnan().any(), "vLLM returned fewer log-probabilities than the vocabulary"
    diff = (got - want).abs()
    print(f"{label}: |vLLM - lowbit| log-prob mean {float(diff.mean()):.2e}, max {float(diff.max()):.2e}")
    assert float(diff.mean()) < mean and float(diff.max()) < most, (float(diff.mean()), float(diff.max()))
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > agree


def tiny_moe(arch: str = "qwen3_moe"):
    """A MoE model vLLM's CPU kernels take (head size 64, hidden and expert width multiples of 128, 8 experts, top-2)."""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  vocab_size=VOCAB, max_position_embeddings=256, tie_word_embeddings=False, num_experts_per_tok=2)
    build = {
        "qwen3_moe": lambda: tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
            **common, intermediate_size=512, moe_intermediate_size=128, num_experts=8, norm_topk_prob=True)),
        "qwen2_moe": lambda: tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
            **common, intermediate_size=512, moe_intermediate_size=128, shared_expert_intermediate_size=256,
            num_experts=8)),
        "mixtral": lambda: tf.MixtralForCausalLM(tf.MixtralConfig(**common, intermediate_size=128,
                                                                  num_local_experts=8)),
        "olmoe": lambda: tf.OlmoeForCausalLM(tf.OlmoeConfig(**common, intermediate_size=128, num_experts=8,
                                                            pad_token_id=0, eos_token_id=1)),
    }
    model = build[arch]().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((p * 4 if p.dim() == 3 else p).bfloat16().float())  # experts at the scale of the attention
    return model


@NO_INT4
@NO_INT4_MOE
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe", "olmoe"])
def test_vllm_serves_lowbit_moe_export_with_lowbits_logits(tmp_path, arch):
    """Per-expert W4 g128 experts (vLLM's CompressedTensorsWNA16MoEMethod, CPUExpertsInt4 on AMX: int8 activations);
    Mixtral's under ``block_sparse_moe.experts.{e}.w1/w3/w2``, Qwen2-MoE's shared expert as Linears, its gate 16-bit."""
    from lowbit.plans.plan import Plan as P
    from lowbit.plans.source import build_plan
    from lowbit.ptq import quantize_model

    model = tiny_moe(arch)
    plan = build_plan(model, "w4g128")
    keep = {n for n in plan.layers if n.endswith("shared_expert_gate")}  # 16-bit, as the command line plans it
    quantize_model(model, P({n: r for n, r in plan.layers.items() if n not in keep}), "rtn", {"search": False},
                   progress=False)
    # looser than the dense bounds: int8 activations in the experts can flip a near-tied top-2 routing, which moves a
    # few positions by up to about one nat (measured mean / max: qwen3_moe 0.012 / 0.70, mixtral 0.013 / 1.09, olmoe
    # 0.015 / 1.06, qwen2_moe 0.007 / 0.04; the float qwen3_moe 0.0025 / 0.015; same argmax: mixtral 88 %, the others
    # above 90 %). A layout error is far outside: gate and up swapped gave mean 0.28 and the same argmax at 7 %
    served_like_lowbit(model, tmp_path / "ct", f"{arch} w4g128", mean=0.03, most=2.0, agree=0.8)


@pytest.mark.skipif(not AVX512, reason="vLLM CPU's FP8 KV cache write is only in its AVX-512 build (cpu_attn.py "
                    "_get_attn_isa refuses FP8 KV without AVX-512 or AMX) and this CPU has no AVX-512")
def test_vllm_cpu_fp8_cache_write_is_the_probes_truncating_cast():
    """vLLM CPU's compiled FP8 KV cache write (``cpu_attn_reshape_and_cache``, the VEC ISA) stores, byte for byte, what
    `benchmarks.kv_vllm_probe` emulates: x / scale in float32, clamped to +-448, the E4M3 mantissa truncated. This is
    the evidence behind engines.md's explanation of vLLM's FP8-KV perplexity gap (its CUDA kernels and lowbit round to
    nearest). Scales are not powers of two; magnitudes span saturation (|x| / scale > 448) down to subnormals."""
    from vllm import _custom_ops as ops

    from benchmarks.kv_vllm_probe import _toward_zero

    n, heads, dim, block = 32, 2, 64, 32
    g = torch.Generator().manual_seed(0)
    spread = torch.logspace(-5, 1, n)[:, None, None]  # rows from deep subnormal to saturating
    key = (torch.randn(n, heads, dim, generator=g) * spread).to(torch.bfloat16)
    value = (torch.randn(n, heads, dim, generator=g) * spread).to(torch.bfloat16)
    for k_scale, v_scale in ((0.0123, 0.0071), (0.05, 0.3)):
        cache = torch.zeros(1, heads, 2 * block, dim, dtype=torch.uint8)  # one block, keys then values
        kc, vc = cache.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, kc, vc, torch.arange(n), "vec", k_scale=k_scale, v_scale=v_scale,
                                       kv_cache_dtype="fp8")
        # the VEC layout holds each block's keys transposed ([heads, dim, block]) and its values as [heads, block, dim]
        got_k = kc.contiguous().view(heads, dim, block).permute(2, 0, 1)[:n]
        got_v = vc.contiguous().view(heads, block, dim).permute(1, 0, 2)[:n]
        for got, x, s in ((got_k, key, k_scale), (got_v, value, v_scale)):
            y = (x.float() * (1.0 / s)).clamp(-448.0, 448.0)
            assert torch.equal(got, _toward_zero(y).view(torch.uint8)), "vLLM's cache bytes are not the truncated cast"
            nearest = y.to(torch.float8_e4m3fn).view(torch.uint8)
            assert (got != nearest).float().mean() > 0.3, "the inputs do not tell truncation from rounding to nearest"
