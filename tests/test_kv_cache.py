"""KV-cache quantization: formats against independent references, every attention variant, the checkpoint,
the exports, the rotation."""

import json

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from lowbit.errors import CheckpointError, ConfigError, LowbitError, ModelError, SchemeError
from lowbit.formats.kv import KVScheme, kv_scale, qdq_kv
from lowbit.nn import QuantLinear, set_module
from lowbit.nn.kv_quant import (
    OFFSETS,
    SCALES,
    STATE,
    attention_modules,
    calibrate_kv,
    fold_value_rotation,
    install_kv,
    kv_scheme_of,
    remove_kv,
    set_scales,
)

IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))


def tiny(seed: int = 0, **kw) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, **kw)  # GQA: 2 query heads per KV head, head_dim 32
    return LlamaForCausalLM(cfg).eval()


def keys(x: torch.Tensor) -> torch.Tensor:
    """Keys-like [b, h, t, d] with an outlier channel (what post-RoPE keys look like)."""
    x = x.clone()
    x[..., 3] *= 20
    return x


def fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448, 448).to(torch.float8_e4m3fn).float()


# ------------------------------------------------------------------ formats vs references
@pytest.mark.parametrize("name", ["fp8", "fp8-head"])
def test_fp8_static_equals_torch_float8_cast(name):
    s = KVScheme.parse(name)
    x = keys(torch.randn(2, 3, 7, 32))
    amax = x.abs().amax(dim=(0, 2, 3)) if s.per_head else x.abs().amax().reshape(1)
    scale = kv_scale(amax * 0.7, s)  # some values beyond the calibrated range: they saturate at 448
    sc = scale.reshape(1, -1, 1, 1) if s.per_head else scale
    assert torch.equal(qdq_kv(x, s, scale), fp8(x / sc) * sc)


def test_int8_static_and_dynamic_token_references():
    x = keys(torch.randn(2, 3, 5, 32))
    s = KVScheme.parse("int8-head")
    scale = kv_scale(x.abs().amax(dim=(0, 2, 3)), s).reshape(1, -1, 1, 1)
    assert torch.equal(qdq_kv(x, s, scale.reshape(-1)), (x / scale).round().clamp(-128, 127) * scale)
    tok = (x.abs().amax(-1, keepdim=True) / 448)
    assert torch.allclose(qdq_kv(x, KVScheme.parse("fp8-token")), fp8(x / tok) * tok, rtol=0, atol=1e-6)


def _vllm_per_token_head(x, qmax, integer):
    """vLLM 0.32's per-token-head cache write (v1/attention/ops/triton_reshape_and_cache_flash.py), in torch: scale =
    max(abs-max of the token's head / qmax, 1e-6); INT8 rounds halves away from zero, then clamps to [-128, 127]."""
    scale = (x.abs().amax(-1, keepdim=True) / qmax).clamp_min(1e-6)
    q = x / scale
    q = torch.where(q >= 0, q + 0.5, q - 0.5).trunc().clamp(-128, 127) if integer else fp8(q)
    return q * scale


def test_token_schemes_are_what_vllms_per_token_head_cache_dtypes_store():
    from lowbit.files.kv_export import kv_refusal, vllm_cache_dtype

    x = keys(torch.randn(2, 3, 7, 64))
    assert torch.allclose(qdq_kv(x, KVScheme.parse("fp8-token")), _vllm_per_token_head(x, 448, False), rtol=0,
                          atol=1e-6)
    assert torch.allclose(qdq_kv(x, KVScheme.parse("int8-token")), _vllm_per_token_head(x, 127, True), rtol=0,
                          atol=1e-6)  # random floats hit no exact half, where the two roundings differ
    assert [vllm_cache_dtype(KVScheme.parse(n)) for n in ("int8-token", "fp8-token", "fp8", "int4", "int8-token-rot")] \
        == ["int8_per_token_head", "fp8_per_token_head", None, None, None]
    assert "kv_cache_dtype=int8_per_token_head" in kv_refusal("compressed-tensors", KVScheme.parse("int8-token"))


def test_int4_groups_along_head_dim_reference():
    x = keys(torch.randn(2, 3, 5, 64))
    g = x.reshape(2, 3, 5, 2, 32)
    s = g.abs().amax(-1, keepdim=True) / 7
    ref = ((g / s).round().clamp(-8, 7) * s).reshape(x.shape)
    assert torch.allclose(qdq_kv(x, KVScheme.parse("int4")), ref, rtol=0, atol=1e-6)
    ref64 = x / (x.abs().amax(-1, keepdim=True) / 7)
    assert not torch.allclose(qdq_kv(x, KVScheme.parse("int4:block=64")), ref)
    assert torch.allclose(qdq_kv(x, KVScheme.parse("int4:block=64")),
                          ref64.round().clamp(-8, 7) * (x.abs().amax(-1, keepdim=True) / 7), atol=1e-6)


def test_nvfp4_blocks_of_16_along_head_dim():
    from lowbit.formats.inputs import InputScheme, qdq_input

    x = keys(torch.randn(1, 2, 4, 32))
    s = KVScheme.parse("nvfp4")
    scale = kv_scale(x.abs().amax().reshape(1), s)
    out = qdq_kv(x, s, scale)
    # the tensor scale's abs-max is the stored scale times 6 (amax / 6 * 6 is not always amax in float32)
    assert torch.equal(out, qdq_input(x, InputScheme.parse("nvfp4"), scale.reshape(()) * 6))
    assert out.reshape(-1, 16).unique(dim=-1).shape[-1] <= 16 and not torch.equal(out, x)


@pytest.mark.parametrize("name", ["fp8", "fp8-head", "fp8-token", "int8", "int8-head", "int8-token", "int4",
                                  "int4:block=16", "nvfp4", "nvfp4:rule=4over6", "mxfp4", "int4-rot", "fp8-rot",
                                  "int4-rot:block=16", "fp8:center", "int4-rot:block=16,center",
                                  "fp8:scale=attn,center", "fp8-token:center", "fp8:center=rope",
                                  "fp8-rot:center=rope", "int4:center=rope", "fp8-head:scale=amax,center=rope"])
def test_names_round_trip(name):
    s = KVScheme.parse(name)
    assert KVScheme.parse(s.name) == s and s.name == name
    assert KVScheme.from_dict(json.loads(json.dumps(s.to_dict()))) == s


def test_bad_names_and_bytes_per_token():
    with pytest.raises(SchemeError, match="unknown KV cache scheme 'fp7'.*fp8"):
        KVScheme.parse("fp7")
    with pytest.raises(SchemeError, match="per-head KV scales are static"):
        KVScheme(KVScheme.parse("fp8-token").elements, per_head=True)
    # SmolLM2-135M: 30 layers, 3 KV heads of 64: 16-bit = 23040 bytes a token
    assert KVScheme.parse("fp8").bytes_per_token(30, 3, 64) == 11520
    assert KVScheme.parse("int4").bytes_per_token(30, 3, 64) == 30 * 3 * 2 * (32 + 2 * 4)
    assert KVScheme.parse("nvfp4").bytes_per_token(30, 3, 64) == 30 * 3 * 2 * (32 + 4)


# ------------------------------------------------------------------ in the model's forward
def _cache_keys(model, ids) -> list[torch.Tensor]:
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    return [layer.keys.clone() for layer in cache.layers]


def test_cache_holds_the_fp8_keys_and_both_cache_modes_agree():
    model = tiny()
    float_keys = _cache_keys(model, IDS)
    calibrate_kv(model, IDS, KVScheme.parse("fp8:scale=amax"))
    attn = model.model.layers[0].self_attn
    k0 = _cache_keys(model, IDS)[0]
    assert torch.equal(k0, fp8(float_keys[0] / attn.k_scale) * attn.k_scale)  # layer 0 sees float inputs
    assert float(attn.k_scale) == float(float_keys[0].abs().amax() / 448)
    with torch.no_grad():
        a = model(input_ids=IDS, use_cache=False).logits
        b = model(input_ids=IDS, use_cache=True).logits
    assert torch.equal(a, b)
    remove_kv(model)
    assert not hasattr(attn, "k_scale") and not hasattr(attn, STATE)
    assert torch.equal(_cache_keys(model, IDS)[0], float_keys[0])


def test_generation_stores_quantized_keys_step_by_step():
    model = tiny()
    calibrate_kv(model, IDS, KVScheme.parse("int8-head"))
    out = model.generate(IDS[:1, :8], max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 12)


def _moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              head_dim=32, num_experts=4, num_experts_per_tok=2,
                                              vocab_size=256)).eval()


def _mistral_sliding():
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                                            sliding_window=8, vocab_size=256)).eval()


def _qwen2_sliding():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, use_sliding_window=True,
                                        sliding_window=8, max_window_layers=1, vocab_size=256)).eval()


def _gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    return Gemma3ForCausalLM(Gemma3TextConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                              sliding_window=8, vocab_size=256,
                                              layer_types=["sliding_attention", "full_attention"])).eval()


@pytest.mark.parametrize("make", [_moe, _mistral_sliding, _qwen2_sliding, _gemma3],
                         ids=["qwen3moe", "mistral-sw", "qwen2-sw", "gemma3"])
def test_every_attention_variant_is_instrumented(make):
    model = make()
    float_keys = _cache_keys(model, IDS)
    attns = calibrate_kv(model, IDS, KVScheme.parse("fp8-head"))
    assert len(attns) == model.config.num_hidden_layers
    assert all(getattr(a, STATE).calls > 0 for a in attns.values())
    a0 = attention_modules(model)["model.layers.0.self_attn"]
    assert a0.k_scale.shape == (model.config.num_key_value_heads,)
    sc = a0.k_scale.reshape(1, -1, 1, 1)
    assert torch.equal(_cache_keys(model, IDS)[0], fp8(float_keys[0] / sc) * sc)
    with torch.no_grad():
        assert torch.equal(model(input_ids=IDS, use_cache=False).logits, model(input_ids=IDS, use_cache=True).logits)
    model.generate(IDS[:1, :10], max_new_tokens=3, do_sample=False)  # past the window, step by step


def test_per_head_scales_must_match_the_head_count():
    model = tiny()
    calibrate_kv(model, IDS, KVScheme.parse("fp8-head"))
    attn = model.model.layers[0].self_attn
    with pytest.raises(ConfigError, match="holds 3 values.*2 KV heads needs 2"):
        set_scales(attn, torch.ones(3), torch.ones(3))
    install_kv(model, KVScheme.parse("fp8-head"))
    attn.k_scale = torch.ones(3)
    with pytest.raises(ConfigError, match="per-head KV scales hold 3 heads but the keys / values have 2"):
        model(input_ids=IDS, use_cache=False)


def test_architecture_it_cannot_instrument_is_refused_by_name(monkeypatch):
    from transformers.models.llama import modeling_llama

    with pytest.raises(ModelError, match="Linear: lowbit finds no attention module"):
        install_kv(torch.nn.Linear(2, 2), KVScheme.parse("fp8"))
    model = tiny()
    forward = modeling_llama.LlamaAttention.forward

    def no_cache(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kw):
        return forward(self, hidden_states, position_embeddings, attention_mask, None, **kw)

    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", no_cache)
    with pytest.raises(ModelError, match="LlamaAttention .* did not hand its keys and values to the cache"):
        calibrate_kv(model, IDS, KVScheme.parse("fp8-token"))
    with pytest.raises(SchemeError, match="input block 32 does not divide the 16"):
        install_kv(LlamaForCausalLM(LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1,
                                                vocab_size=64)), KVScheme.parse("int4"))


# ------------------------------------------------------------------ rotation
def test_rotation_alone_keeps_the_float_function(monkeypatch):
    from lowbit.nn import kv_quant

    model = tiny()
    with torch.no_grad():
        ref = model(input_ids=IDS).logits
        fold_value_rotation(model)
        assert torch.allclose(model(input_ids=IDS).logits, ref, atol=2e-5)
        monkeypatch.setattr(kv_quant, "qdq_kv", lambda x, s, scale=None: x)  # the rotation without any rounding
        install_kv(model, KVScheme.parse("int4-rot"), values_folded=True)
        assert torch.allclose(model(input_ids=IDS).logits, ref, atol=2e-5)
        install_kv(model, KVScheme.parse("int4-rot"), values_folded=False)  # values rotated online too
        assert torch.allclose(model(input_ids=IDS).logits, ref, atol=2e-5)


# ------------------------------------------------------------------ centering (:center)
@pytest.mark.parametrize("kv, folded", [("fp8:center", False), ("int4:center", False), ("nvfp4-rot:center", True),
                                        ("int8-rot:center", False)])
def test_centering_alone_keeps_the_float_function(monkeypatch, kv, folded):
    """With the rounding taken out, subtracting the calibrated offsets and adding them back leaves the model's
    logits as they were (to float32 rounding), rotated or not; the offsets are the calibration's means."""
    from lowbit.nn import kv_quant

    attn, float_keys = _centered_without_rounding(monkeypatch, tiny(), kv, folded, lambda m: _cache_keys(m, IDS))
    h = kv_quant.rotation_matrix(32) if "-rot" in kv else torch.eye(32)
    assert torch.allclose(attn.k_offset, (float_keys[0] @ h).mean(dim=(0, 2)), atol=1e-6)


def _centered_without_rounding(monkeypatch, model, kv: str, folded: bool, probe):
    """Calibrate ``kv`` on ``model`` (values rotated first when ``folded``) with the rounding taken out and check
    the logits are the float model's; returns the first attention and ``probe(model)`` taken before calibrating."""
    from lowbit.nn import kv_quant

    with torch.no_grad():
        if folded:
            fold_value_rotation(model)
        ref = model(input_ids=IDS).logits
        seen = probe(model)
    monkeypatch.setattr(kv_quant, "qdq_kv", lambda x, s, scale=None: x)
    calibrate_kv(model, IDS, KVScheme.parse(kv), values_folded=folded)
    with torch.no_grad():
        assert torch.allclose(model(input_ids=IDS).logits, ref, atol=2e-5)
    return model.model.layers[0].self_attn, seen


def test_centered_cache_holds_fp8_of_the_centered_keys_and_scores_move_by_a_constant_per_query():
    """fp8:center stores fp8((k - mu) / s): the cache's keys minus mu are that code times s. A kernel that keeps
    the offset out of the scores gets q . k_hat - q . mu: the same constant for every key of one query, so the same
    softmax. And on keys with a large, nearly constant channel, centering cuts FP8's score error."""
    model = tiny()
    float_keys = _cache_keys(model, IDS)
    calibrate_kv(model, IDS, KVScheme.parse("fp8:scale=amax,center"))
    attn = model.model.layers[0].self_attn
    k_hat = _cache_keys(model, IDS)[0]  # layer 0 sees float inputs
    mu, s = attn.k_offset.reshape(1, 2, 1, 32), attn.k_scale
    assert float(s) == float((float_keys[0] - mu).abs().amax() / 448)
    assert torch.equal(k_hat, fp8((float_keys[0] - mu) / s) * s + mu)
    stored = k_hat - mu
    q = torch.randn(2, 2, 24, 32)  # one query head per KV head is enough: GQA repeats the same keys
    with_mu, without = q @ k_hat.transpose(-1, -2), q @ stored.transpose(-1, -2)
    diff = with_mu - without
    assert torch.allclose(diff, (q * mu).sum(-1, keepdim=True).expand_as(diff), atol=1e-4)
    assert torch.allclose(diff, diff[..., :1].expand_as(diff), atol=1e-4)  # constant along the keys
    assert torch.allclose(with_mu.softmax(-1), without.softmax(-1), atol=1e-5)

    x = torch.randn(1, 2, 256, 32)
    x[..., 5] = x[..., 5] * 2 - 13  # the nearly constant channel of SmolLM2's post-RoPE keys (kv.md)
    plain, centered = KVScheme.parse("fp8"), KVScheme.parse("fp8:center")
    mu = x.mean(dim=(0, 2))
    err_plain = qdq_kv(x, plain, kv_scale(x.abs().amax(), plain)) - x
    err_centered = qdq_kv(x - mu[None, :, None], centered, kv_scale((x - mu[None, :, None]).abs().amax(), plain)) \
        + mu[None, :, None] - x
    qf = torch.randn(1, 2, 8, 32)
    assert (qf @ err_centered.transpose(-1, -2)).pow(2).mean() < 0.5 * (qf @ err_plain.transpose(-1, -2)).pow(2).mean()


# ------------------------------------------------------------------ pre-RoPE centering (:center=rope)
def _pre_rope_keys(model, ids, layer: int = 0) -> torch.Tensor:
    """Layer ``layer``'s keys before RoPE, ``[b, kv_heads, t, head_dim]``, as its k_proj outputs them (Llama has no
    key norm): an independent reference for the offset, which lowbit takes by unrotating the post-RoPE keys."""
    seen = []
    attn = model.model.layers[layer].self_attn
    h = attn.k_proj.register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    h.remove()
    b, t, _ = seen[0].shape
    return seen[0].reshape(b, t, -1, attn.head_dim).transpose(1, 2)


def _rope_of(model, ids, x: torch.Tensor) -> torch.Tensor:
    """``x [1 or b, heads, 1 or t, d]`` with transformers' own RoPE at positions 0..t-1 of ``ids``."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    pos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), pos)
    x = x.expand(ids.shape[0], -1, ids.shape[1], -1)
    return apply_rotary_pos_emb(x, x, cos, sin)[1]


@pytest.mark.parametrize("kv, folded", [("fp8:center=rope", False), ("fp8-rot:center=rope", True),
                                        ("int4:center=rope", False), ("fp8-head:center=rope", False)])
def test_pre_rope_centering_alone_keeps_the_float_function(monkeypatch, kv, folded):
    """With the rounding taken out, the pre-RoPE offset turned to each position, subtracted and added back, leaves
    the logits as they were; the offset is the mean of what k_proj outputs (the keys before RoPE)."""
    model = tiny(rope_theta=100.0)  # a fast RoPE: the pairs turn a lot over 24 positions
    attn, pre = _centered_without_rounding(monkeypatch, model, kv, folded, lambda m: _pre_rope_keys(m, IDS))
    assert torch.allclose(attn.k_offset, pre.mean(dim=(0, 2)), atol=1e-5)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)  # generation: the prompt, then one token at position 24
        model(input_ids=IDS, past_key_values=cache, use_cache=True)
        step = model(input_ids=IDS[:, :1], past_key_values=cache, use_cache=True).logits[:, -1]
    remove_kv(model)
    with torch.no_grad():
        plain = DynamicCache(config=model.config)
        model(input_ids=IDS, past_key_values=plain, use_cache=True)
        assert torch.allclose(step, model(input_ids=IDS[:, :1], past_key_values=plain, use_cache=True).logits[:, -1],
                              atol=2e-5)


def test_pre_rope_centered_cache_holds_fp8_of_the_keys_minus_the_turned_mean():
    """fp8:center=rope stores fp8((k_t - RoPE_t(m)) / s) with m the pre-RoPE mean and s the mean over calibration
    rows of each row's abs-max of k_t - RoPE_t(m), over 448 (rowmax, the default of centered caches); the cache
    reads that plus RoPE_t(m)."""
    model = tiny(rope_theta=100.0)
    float_keys = _cache_keys(model, IDS)[0]
    pre = _pre_rope_keys(model, IDS)
    calibrate_kv(model, IDS, KVScheme.parse("fp8:center=rope"))
    attn = model.model.layers[0].self_attn
    turned = _rope_of(model, IDS, pre.mean(dim=(0, 2)).reshape(1, 2, 1, 32))
    centered = float_keys - turned
    s = centered.abs().amax(dim=(1, 2, 3)).mean() / 448
    assert torch.allclose(attn.k_scale, s.reshape(1), rtol=1e-5)
    k_hat = _cache_keys(model, IDS)[0]  # layer 0 sees float inputs
    assert torch.allclose(k_hat, fp8((float_keys - turned) / attn.k_scale) * attn.k_scale + turned, atol=1e-5)


def test_pre_rope_centering_removes_a_constant_channel_that_the_cache_mean_cannot():
    """Keys whose one RoPE pair is a large constant before RoPE: after RoPE its mean over positions is ~0, so
    :center leaves it in place, while :center=rope takes it out and FP8's error on the scores falls."""
    from lowbit.nn.kv_quant import rope_turn

    g = torch.Generator().manual_seed(0)
    t, d = 512, 32
    pre = torch.randn(1, 1, t, d, generator=g)
    pre[..., 5], pre[..., 5 + d // 2] = pre[..., 5] * 0.5 - 13, pre[..., 5 + d // 2] * 0.5 + 6
    pos = torch.arange(t, dtype=torch.float32)
    inv = 100.0 ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = torch.cat([pos[:, None] * inv, pos[:, None] * inv], dim=-1)[None]  # [1, t, d]
    rope = (ang.cos(), ang.sin())
    k = rope_turn(pre, rope)
    s8 = KVScheme.parse("fp8")
    m_cache, m_pre = k.mean(dim=(0, 2), keepdim=True), pre.mean(dim=(0, 2), keepdim=True)
    errs = {}
    for name, off in (("plain", torch.zeros_like(k)), ("center", m_cache.expand_as(k)),
                      ("rope", rope_turn(m_pre, rope))):
        c = k - off
        errs[name] = qdq_kv(c, s8, kv_scale(c.abs().amax(), s8)) - c
    q = torch.randn(1, 1, 64, d, generator=g) + rope_turn(m_pre, rope)[:, :, :64] / 4  # queries reading the pair
    score_err = {n: (q @ e.transpose(-1, -2)).pow(2).mean() for n, e in errs.items()}
    assert score_err["rope"] < 0.25 * score_err["center"] and score_err["center"] > 0.5 * score_err["plain"]


def test_pre_rope_centering_refuses_partial_rope_and_needs_centering():
    with pytest.raises(SchemeError, match="center=rope.*centering"):
        KVScheme(KVScheme.parse("fp8").elements, prerope=True)
    with pytest.raises(SchemeError, match="unknown centering 'center=cache'"):
        KVScheme.parse("fp8:center=cache")
    assert "prerope" not in KVScheme.parse("fp8:center").to_dict()  # manifests of other schemes read as before
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    model = Phi3ForCausalLM(Phi3Config(hidden_size=128, intermediate_size=128, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                       partial_rotary_factor=0.5, pad_token_id=0)).eval()
    with pytest.raises(ModelError, match="applies RoPE to 16 of its 32 head channels.*:center for this model"):
        calibrate_kv(model, IDS, KVScheme.parse("fp8:center=rope"))
    calibrate_kv(model, IDS, KVScheme.parse("fp8:center"))  # the cache-frame mean needs no RoPE


def test_centering_needs_calibration_even_for_dynamic_scales():
    with pytest.raises(ConfigError, match="int4:center has static scales or centering offsets"):
        calibrate_kv(tiny(), None, KVScheme.parse("int4:center"))
    assert not KVScheme.parse("int4").needs_calibration and KVScheme.parse("int4:center").needs_calibration


def test_rotation_spreads_a_key_outlier_channel():
    from lowbit.nn.kv_quant import rotation_matrix

    x = keys(torch.randn(1, 2, 64, 32))
    h = rotation_matrix(32)
    s = KVScheme.parse("int4")
    plain = (qdq_kv(x, s) - x).pow(2).mean()
    rotated = (qdq_kv(x @ h, s) @ h.T - x).pow(2).mean()
    assert rotated < 0.5 * plain


def test_value_fold_refuses_quantized_v_proj():
    model = tiny()
    attn = model.model.layers[0].self_attn
    set_module(model, "model.layers.0.self_attn.v_proj", QuantLinear.from_linear(attn.v_proj, "w4g32"))
    with pytest.raises(ModelError, match="value rotation folds into float v_proj / o_proj"):
        fold_value_rotation(model)


# ------------------------------------------------------------------ checkpoint and exports
def _quantized(scheme: str = "w8", kv: str = "fp8"):
    model = tiny()
    for name, m in list(model.named_modules()):
        if isinstance(m, torch.nn.Linear) and ".layers." in name:
            set_module(model, name, QuantLinear.from_linear(m, scheme))
    calibrate_kv(model, IDS, KVScheme.parse(kv))
    return model


@pytest.mark.parametrize("kv", ["fp8-head", "nvfp4-rot", "fp8:center", "int4:center", "fp8:center=rope"])
def test_native_checkpoint_keeps_scales_and_scheme(tmp_path, kv):
    from lowbit.files.native import load, read_manifest, save

    model = _quantized(kv=kv)
    save(model, None, tmp_path / "q")
    entry = read_manifest(tmp_path / "q")["kv_cache"]
    assert KVScheme.from_dict(entry["scheme"]) == KVScheme.parse(kv) and len(entry["layers"]) == 2
    from lowbit.files.inspect import inspect

    assert inspect(tmp_path / "q")["kv_cache"] == kv
    back, _ = load(tmp_path / "q")
    centered = kv.endswith((":center", ":center=rope"))
    bufs = [*(SCALES if not kv.startswith("int4") else ()), *(OFFSETS if centered else ())]
    for name, attn in attention_modules(model).items():
        for buf in bufs:
            assert torch.equal(getattr(attention_modules(back)[name], buf), getattr(attn, buf))
        if centered:
            assert attn.k_offset.shape == (2, 32) and attn.k_offset.abs().amax() > 0
    with torch.no_grad():
        assert torch.equal(back(input_ids=IDS).logits, model(input_ids=IDS).logits)


def test_native_checkpoint_with_edited_kv_entry_is_refused(tmp_path):
    from lowbit.files.native import MANIFEST, SEAL, load, read_manifest, save

    save(_quantized(kv="fp8-head"), None, tmp_path / "q")
    m = read_manifest(tmp_path / "q")
    m["kv_cache"]["layers"] = m["kv_cache"]["layers"][:1]
    SEAL.write(tmp_path / "q", m, indent=1)
    with pytest.raises(CheckpointError, match="kv_cache entry names other attention layers"):
        load(tmp_path / "q")
    assert (tmp_path / "q" / MANIFEST).is_file()


def test_compressed_tensors_export_and_transformers_readback(tmp_path):
    pytest.importorskip("compressed_tensors")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    from lowbit.files import compressed_tensors as ct

    model = _quantized(kv="fp8-head")
    assert kv_scheme_of(model).rule == "headroom"  # the default rule's scales are what the export carries
    ct.export(model, None, tmp_path / "ct")
    cfg = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert cfg["kv_cache_scheme"] == {**cfg["kv_cache_scheme"], "num_bits": 8, "type": "float",
                                      "strategy": "attn_head", "dynamic": False, "symmetric": True}
    tensors = load_file(tmp_path / "ct" / "model.safetensors")
    from lowbit.files.inspect import inspect

    assert inspect(tmp_path / "ct")["kv_cache"] == "fp8-head (kv_cache_scheme)"
    assert tensors["model.layers.1.self_attn.k_scale"].shape == (2, 1, 1)
    assert tensors["model.layers.1.self_attn.v_scale"].dtype == torch.float32
    assert torch.equal(tensors["model.layers.1.self_attn.k_scale"].reshape(-1), model.model.layers[1].self_attn.k_scale)
    # transformers 5.25 + compressed-tensors 0.20.1 load the weights but not the KV scheme: compressed-tensors
    # looks for a `past_key_values` argument, which transformers renamed `cache`, so it reports k_scale /
    # v_scale as unexpected and runs float keys and values. Its logits are lowbit's model without the KV scheme.
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ct", dtype=torch.float32,
                                                  quantization_config=CompressedTensorsConfig(run_compressed=False))
    assert not hasattr(loaded.model.layers[1].self_attn, "k_scale")
    with torch.no_grad():
        theirs, ours = loaded(input_ids=IDS).logits, model(input_ids=IDS).logits
        remove_kv(model)
        assert torch.equal(theirs, model(input_ids=IDS).logits) and not torch.equal(theirs, ours)
    # the exported k_scale / v_scale are headroom's: per KV head, the mean over calibration rows of each row's
    # abs-max over 256 (brute force on the float keys and values calibration saw)
    for layer, (k, v) in enumerate(_layer_values(model, IDS)):
        for short, x in (("k", k), ("v", v)):
            want = torch.tensor([[float(x[r, h].abs().max()) for h in range(x.shape[1])]
                                 for r in range(x.shape[0])]).mean(dim=0) / 256
            got = tensors[f"model.layers.{layer}.self_attn.{short}_scale"].reshape(-1)
            assert torch.allclose(got, want, rtol=1e-5, atol=0), (layer, short)


@pytest.mark.parametrize("kv", ["int8", "fp8-token", "int4", "fp8-rot", "fp8:center", "fp8-head:center",
                                "fp8-token:center", "fp8:center=rope"])
def test_compressed_tensors_refuses_kv_vllm_cannot_read(tmp_path, kv):
    pytest.importorskip("compressed_tensors")
    from lowbit.files import compressed_tensors as ct

    with pytest.raises(LowbitError, match="vLLM"):
        ct.export(_quantized(kv=kv), None, tmp_path / "ct")
    assert not (tmp_path / "ct").exists()


def test_export_job_gguf_needs_drop_kv(tmp_path):
    from lowbit import api
    from lowbit.files.native import save

    save(_quantized("w4g32", kv="fp8"), None, tmp_path / "q")
    with pytest.raises(ConfigError, match="GGUF has no KV-cache format.*--drop-kv"):
        api.export(api.ExportJob(tmp_path / "q", "gguf", tmp_path / "m.gguf"))
    assert not (tmp_path / "m.gguf").exists()
    with pytest.raises(ConfigError, match="--drop-kv applies to --to gguf only"):
        api.ExportJob(tmp_path / "q", "compressed-tensors", tmp_path / "ct", drop_kv=True)
    with pytest.raises(ConfigError, match="vLLM reads"):
        save(_quantized("w8", kv="int8"), None, tmp_path / "q8")
        api.export(api.ExportJob(tmp_path / "q8", "compressed-tensors", tmp_path / "ct"))
    assert not (tmp_path / "ct").exists()


def test_export_gguf_with_drop_kv_writes_the_weights_and_says_so(tmp_path, tiny_tokenizer):
    from lowbit import api
    from lowbit.files.native import save

    model = _quantized("w4g32", kv="fp8")
    save(model, tiny_tokenizer, tmp_path / "q")
    r = api.export(api.ExportJob(tmp_path / "q", "gguf", tmp_path / "m.gguf", drop_kv=True))
    assert (tmp_path / "m.gguf").is_file() and r["kv_cache"].startswith("dropped: the file holds the weights only")
    remove_kv(model)
    save(model, tiny_tokenizer, tmp_path / "plain")
    with pytest.raises(ConfigError, match="has no KV-cache scheme to drop"):
        api.export(api.ExportJob(tmp_path / "plain", "gguf", tmp_path / "p.gguf", drop_kv=True))


@pytest.mark.parametrize("kv, to, why", [("int4", "compressed-tensors", "vLLM reads"),
                                         ("fp8", "gguf", "GGUF has no KV-cache format"),
                                         ("fp8:center", "compressed-tensors", "fp8:center stores keys and values "
                                          "minus a calibrated offset .* no offset")])
def test_quantize_job_refuses_a_kv_export_before_loading(tmp_path, kv, to, why):
    from lowbit.api import QuantizeJob

    with pytest.raises(ConfigError, match=f"--export-to {to}: .*{why}"):
        QuantizeJob(out=tmp_path / "q", model=str(tmp_path / "nowhere"), kv=kv, export_to=to)
    with pytest.raises(SchemeError, match="unknown KV cache scheme"):
        QuantizeJob(out=tmp_path / "q", kv="int3")


def _kv_job(tmp_path, model_dir, kv, out="a", evaluation=None):
    from lowbit.api import QuantizeJob
    from lowbit.api.common import Calibration

    return QuantizeJob(out=tmp_path / out, model=str(model_dir), scheme="w4g32", method="gptq", kv=kv,
                       calib=Calibration(nsamples=4, seqlen=32), evaluation=evaluation, workdir=str(tmp_path / "wd"),
                       progress=False, force=True)


@pytest.mark.parametrize("kv", ["fp8", "int4-rot:block=16"])
def test_kv_with_workdir_resumes_to_the_same_checkpoint(tmp_path, tiny_hf_dir, kv):
    """--kv with --workdir: the work folder records the KV scheme the blocks were tuned under (and, through the
    model's fingerprint, its calibrated scales and the value rotation), so an interrupted run resumes to the same
    bytes; the last block's result deleted stands for a run killed before it was saved."""
    from safetensors.torch import load_file

    from lowbit.api.quantize import quantize

    quantize(_kv_job(tmp_path, tiny_hf_dir, kv))
    run = json.loads((tmp_path / "wd" / "run.json").read_text())
    assert run["kv_cache"] == {"scheme": KVScheme.parse(kv).to_dict(), "values_folded": "-rot" in kv}
    blocks = sorted((tmp_path / "wd").glob("block_*.safetensors"))
    assert len(blocks) == 2
    blocks[-1].unlink()
    quantize(_kv_job(tmp_path, tiny_hf_dir, kv, out="b"))
    a, b = (load_file(str(next((tmp_path / n).glob("*.safetensors")))) for n in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(k.endswith("self_attn.k_scale") for k in a) == (kv == "fp8")


def test_kv_workdir_with_another_kv_scheme_is_refused_before_the_float_pass(tmp_path, tiny_hf_dir, monkeypatch):
    from lowbit.api.common import Evaluation
    from lowbit.api.quantize import quantize

    quantize(_kv_job(tmp_path, tiny_hf_dir, "fp8"))
    monkeypatch.setattr(Evaluation, "perplexity", lambda *a, **k: pytest.fail("evaluated before refusing"))
    for other in ("int8", None):
        with pytest.raises(ConfigError, match=r"holds a run with different settings \(kv_cache"):
            quantize(_kv_job(tmp_path, tiny_hf_dir, other, out="b", evaluation=Evaluation(seqlen=32, windows=1)))


def test_quantize_cli_kv_end_to_end(tmp_path, tiny_hf_dir, capsys):
    from lowbit.cli import main
    from lowbit.files.native import load, read_manifest

    rc = main(["quantize", str(tiny_hf_dir), "--scheme", "w4g32", "--kv", "int8-head", "--out",
               str(tmp_path / "q"), "--nsamples", "2", "--seqlen", "32", "--windows", "1", "--eval-seqlen", "64",
               "--json"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["kv_cache"]["scheme"] == "int8-head"
    assert summary["kv_cache"]["bytes_per_token"] == summary["kv_cache"]["bytes_per_token_16bit"] / 2
    assert read_manifest(tmp_path / "q")["kv_cache"]["scheme"]["per_head"] is True
    model, _ = load(tmp_path / "q")
    assert attention_modules(model)["model.layers.0.self_attn"].k_scale.shape == (2,)
    assert main(["eval", str(tmp_path / "q"), "--windows", "1", "--eval-seqlen", "64", "--json"]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    assert evaluated["kv_cache"] == "int8-head" and evaluated["ppl"] == pytest.approx(summary["ppl_q"], rel=1e-5)


def test_transformers_loader_of_lowbit_checkpoints_refuses_a_kv_scheme(tmp_path):
    from transformers import AutoModelForCausalLM

    import lowbit  # noqa: F401  (registers the loader)
    from lowbit.files.native import save

    save(_quantized("w8", kv="fp8"), None, tmp_path / "q")
    with pytest.raises(CheckpointError, match="quantizes the KV cache, which transformers' loader"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "q")


def test_block_tuning_runs_with_the_quantized_cache_and_float_targets(monkeypatch):
    import copy

    from lowbit.nn import quant_layers
    from lowbit.nn.kv_quant import kv_paused
    from lowbit.plans.plan import Plan
    from lowbit.ptq import quantize_model
    from lowbit.ptq.blockwise import tune

    model = tiny()
    plain = copy.deepcopy(model)
    with torch.no_grad():
        ref = model(input_ids=IDS).logits
    install_kv(model, KVScheme.parse("int4"))
    with torch.no_grad(), kv_paused(model):
        assert torch.equal(model(input_ids=IDS).logits, ref)
    paused_in_targets = []
    real = tune.map_block

    def spy(block, *a, **kw):
        state = getattr(block.self_attn, STATE, None)
        if state is not None:
            paused_in_targets.append(state.paused)
        return real(block, *a, **kw)

    monkeypatch.setattr(tune, "map_block", spy)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    calib = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(2))
    settings = {"iters": 2, "batch_size": 2}
    quantize_model(model, Plan.uniform(names, "w2g32"), "signround", settings, calib=calib, progress=False)
    quantize_model(plain, Plan.uniform(names, "w2g32"), "signround", settings, calib=calib, progress=False)
    assert True in paused_in_targets and False in paused_in_targets  # FP targets float, the tuned chain quantized
    ours, theirs = quant_layers(model), quant_layers(plain)
    assert not torch.equal(ours["model.layers.1.self_attn.q_proj"].qweight.codes,
                           theirs["model.layers.1.self_attn.q_proj"].qweight.codes)


# ------------------------------------------------------------------ DeltaLoss over KV choices, a cache per layer
def test_kv_delta_loss_is_the_first_order_loss_change_of_each_layers_cache(monkeypatch):
    """The signed KV term of the last layer equals the loss's derivative along its quantization error (central
    differences on a float64 model; earlier layers' nudges re-round the later caches, which a first-order term
    does not see), the abs term bounds it in every layer, and coarser KV scores higher."""
    import lowbit.nn.kv_quant as kvq
    from lowbit.ptq.sensitivity import kv_delta_loss

    model = tiny(3).double()
    ids = IDS[:1]
    signed = kv_delta_loss(model, ["int4"], ids, mode="signed", progress=False)["int4"]
    absolute = kv_delta_loss(model, ["int4", "int8-token"], ids, progress=False)
    assert not any(hasattr(a, STATE) for a in attention_modules(model).values())  # left as it was
    for name in signed:
        assert absolute["int4"][name] >= abs(signed[name])
        assert absolute["int4"][name] > absolute["int8-token"][name] > 0
    real = kvq.qdq_kv
    layer, name = len(signed) - 1, sorted(signed)[-1]
    calls = []

    def nudged(x, s, scale=None, eps=0.0, layer=layer):
        q = real(x, s, scale)
        calls.append(1)
        return q + eps * (q - x) if (len(calls) - 1) // 2 == layer else q

    losses = []
    for eps in (0.05, -0.05):
        calls.clear()
        monkeypatch.setattr(kvq, "qdq_kv", lambda x, s, scale=None, eps=eps: nudged(x, s, scale, eps))
        install_kv(model, KVScheme.parse("int4"))
        with torch.no_grad():
            logits = model(input_ids=ids).logits.double()
        losses.append(float(torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])))
        remove_kv(model)
    monkeypatch.setattr(kvq, "qdq_kv", real)
    fd = (losses[0] - losses[1]) / 0.1
    assert signed[name] == pytest.approx(fd, rel=0.02)


def test_allocate_kv_is_the_exact_knapsack():
    import itertools
    import random

    from lowbit.ptq.mixed import allocate_kv, kv_bits

    rng = random.Random(0)
    shapes = {f"l{i}": (2, 32) for i in range(5)}
    opts = ["fp8", "int4", "nvfp4"]
    scores = {o: {n: rng.random() * (1 if o == "fp8" else 5) for n in shapes} for o in opts}
    elements = 5 * 2 * 2 * 32
    for budget in (5.0, 6.0, 7.0, 8.0):
        best = min((sum(scores[o][n] for n, o in zip(shapes, pick, strict=True)), pick)
                   for pick in itertools.product(opts, repeat=5)
                   if sum(kv_bits(KVScheme.parse(o), 2, 32) for o in pick) <= budget * elements)
        got = allocate_kv(scores, shapes, budget)
        assert sum(scores[got[n]][n] for n in shapes) == pytest.approx(best[0])
    with pytest.raises(ConfigError, match="need at least 4.50 bits per cached element"):
        allocate_kv(scores, shapes, 4.0)


def test_a_cache_per_layer_installs_saves_loads_and_refuses_vllm(tmp_path):
    """A per-layer KV choice (what the KV DeltaLoss allocation gives): each attention quantizes with its own
    scheme, the native checkpoint keeps the choice, compressed-tensors (one kv_cache_dtype) refuses it."""
    from lowbit.files.native import load, read_manifest, save
    from lowbit.ptq.mixed import mixed_kv

    model = tiny()
    for name, m in list(model.named_modules()):
        if isinstance(m, torch.nn.Linear) and ".layers." in name:
            set_module(model, name, QuantLinear.from_linear(m, "w8"))
    names = sorted(attention_modules(model))
    with pytest.raises(ConfigError, match="must name every attention"):
        install_kv(model, {names[0]: KVScheme.parse("fp8")})
    choice = {names[0]: KVScheme.parse("fp8"), names[1]: KVScheme.parse("int4")}
    calibrate_kv(model, IDS, choice)
    k = torch.randn(1, 2, 5, 32)
    attns = attention_modules(model)
    assert torch.equal(kvq_of(attns[names[0]], k), qdq_kv(k, KVScheme.parse("fp8"), attns[names[0]].k_scale))
    assert torch.equal(kvq_of(attns[names[1]], k), qdq_kv(k, KVScheme.parse("int4")))
    save(model, None, tmp_path / "q")
    entry = read_manifest(tmp_path / "q")["kv_cache"]
    assert {n: KVScheme.from_dict(d).name for n, d in entry["per_layer"].items()} == {n: s.name for n, s in
                                                                                      choice.items()}
    back, _ = load(tmp_path / "q")
    with torch.no_grad():
        assert torch.equal(back(input_ids=IDS).logits, model(input_ids=IDS).logits)
    from lowbit.api.export import ExportJob, export

    with pytest.raises(ConfigError, match="a scheme per layer .* one for all layers"):
        export(ExportJob(checkpoint=str(tmp_path / "q"), out=tmp_path / "ct", to="compressed-tensors"))
    assert not (tmp_path / "ct").exists()
    remove_kv(model)
    picked = mixed_kv(model, ["int8", "int4"], 6.5, IDS, nsamples=2, progress=False)
    assert sorted(s.name for s in picked.values()) == ["int4", "int8"]  # 8 and 5 bits: room for one 8-bit layer


def kvq_of(attn, k):
    from lowbit.nn.kv_quant import quantize_kv

    return quantize_kv(attn, k, k)[0]


# ------------------------------------------------------------------ FP8 scale search (scale=attn)
def _attention_inputs(model):
    """Every attention's post-RoPE queries, keys and values on IDS (one batch), captured beside the forward."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    got = {}

    def grab(module, args, kwargs):
        h = kwargs.get("hidden_states", args[0] if args else None)
        cos, sin = kwargs["position_embeddings"]
        shape = (*h.shape[:-1], -1, module.head_dim)
        q, k, v = (p(h).view(shape).transpose(1, 2) for p in (module.q_proj, module.k_proj, module.v_proj))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        got[module.layer_idx] = (q.detach(), k.detach(), v.detach())

    handles = [a.register_forward_pre_hook(grab, with_kwargs=True) for a in attention_modules(model).values()]
    with torch.no_grad():
        model(input_ids=IDS)
    for h in handles:
        h.remove()
    return got


def _attention_output(attn, q, k, v):
    """Causal softmax attention with GQA, then o_proj: written out, no transformers attention function."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    t = q.shape[2]
    s = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    o = (s.softmax(-1) @ v).transpose(1, 2).reshape(q.shape[0], t, -1)
    return attn.o_proj(o)


def _trial_error(attn, q, k, v, out, which, sc, shape):
    """The attention output's squared error with the keys (or the values) in FP8 at scale ``sc``, the other float."""
    x = k if which == "k" else v
    xq = fp8(x / sc.reshape(shape)) * sc.reshape(shape)
    o = _attention_output(attn, q, xq, v) if which == "k" else _attention_output(attn, q, k, xq)
    return float((o - out).pow(2).sum())


@pytest.mark.parametrize("name", ["fp8", "fp8-head"])
def test_fp8_scale_search_picks_the_least_attention_output_error(name):
    """scale=attn (not the default): each static FP8 key scale is amax / 448 * 2^(j/16), j = -16..15, with the least error of the
    attention's output (values float), each value scale likewise (keys float) — brute force over the 32 candidates
    with torch's float8 cast and an attention written out here; never worse than amax / 448 (j = 0)."""
    model, amax_model = tiny(4), tiny(4)
    calibrate_kv(amax_model, IDS, KVScheme.parse(name + ":scale=amax"))  # the base the search multiplies
    inputs = _attention_inputs(model)
    s = KVScheme.parse(name + ":scale=attn")
    assert s.name == name + ":scale=attn" and not KVScheme.parse(name).search and s.rule == "amax"
    calibrate_kv(model, IDS, s)
    shape = (1, -1, 1, 1) if s.per_head else ()
    factors = 2 ** (torch.arange(-16, 16) / 16)
    chosen = []
    with torch.no_grad():
        for (n, attn), ref in zip(attention_modules(model).items(), attention_modules(amax_model).values(),
                                  strict=True):
            q, k, v = inputs[attn.layer_idx]
            out = _attention_output(attn, q, k, v)
            for which, base in (("k", ref.k_scale), ("v", ref.v_scale)):
                errs = torch.tensor([_trial_error(attn, q, k, v, out, which, base * f, shape) for f in factors])
                best = factors[errs.argmin()]
                got = getattr(attn, f"{which}_scale")
                assert torch.allclose(got, base * best, rtol=1e-6), (n, which)
                assert _trial_error(attn, q, k, v, out, which, got, shape) <= \
                    _trial_error(attn, q, k, v, out, which, base, shape) + 1e-12
                chosen.append(float(best))
    assert set(chosen) != {1.0}  # the search moved some scale off amax / 448


# ------------------------------------------------------------------ mixed KV from the CLI (--kv A,B --kv-bits)
def test_quantize_cli_kv_bits_chooses_a_scheme_per_layer(tmp_path, tiny_hf_dir, capsys):
    """--kv int8,int4:block=16 --kv-bits 7 on two attentions of 2 KV heads x 16 (int8: 8 bits an element, int4 in
    blocks of 16 with fp32 scales: 6): the budget holds one int8 layer; the checkpoint keeps each layer's scheme and
    `lowbit eval` measures it."""
    from lowbit.cli import main
    from lowbit.files.native import load, read_manifest

    rc = main(["quantize", str(tiny_hf_dir), "--scheme", "w4g32", "--kv", "int8,int4:block=16", "--kv-bits", "7", "--out",
               str(tmp_path / "q"), "--nsamples", "2", "--seqlen", "32", "--windows", "1", "--eval-seqlen", "64",
               "--json"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    kv = summary["kv_cache"]
    assert kv["counts"] == {"int8": 1, "int4:block=16": 1} and kv["scheme"] == "per layer"
    assert kv["bytes_per_token"] == 2 * 2 * 16 * 1 + 2 * 2 * (16 // 2 + 4)  # the int8 layer + the int4 layer
    entry = read_manifest(tmp_path / "q")["kv_cache"]
    assert {n: KVScheme.from_dict(d).name for n, d in entry["per_layer"].items()} == kv["per_layer"]
    model, _ = load(tmp_path / "q")
    assert {n: getattr(a, STATE).scheme.name for n, a in attention_modules(model).items()} == kv["per_layer"]
    assert main(["eval", str(tmp_path / "q"), "--windows", "1", "--eval-seqlen", "64", "--json"]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    assert evaluated["kv_cache"] == kv["counts"] and evaluated["ppl"] == pytest.approx(summary["ppl_q"], rel=1e-5)


@pytest.mark.parametrize("argv, why", [
    (["--kv-bits", "6"], "list them in --kv"),
    (["--kv", "fp8", "--kv-bits", "6"], "list them in --kv"),
    (["--kv", "fp8,int4"], "add --kv-bits"),
    (["--kv", "fp8,int4", "--kv-bits", "6", "--method", "gptq"], "after --method gptq has tuned"),
    (["--kv", "fp8,int4", "--kv-bits", "6", "--export-to", "compressed-tensors"], "a scheme per layer"),
    (["--kv", "int4,int4-rot", "--kv-bits", "6"], "some schemes rotate"),
    (["--kv", "fp8,int4", "--kv-bits", "6", "--stream"], "--kv does not apply to --stream"),
])
def test_kv_bits_flags_the_path_cannot_honour_are_refused(tmp_path, capsys, argv, why):
    from lowbit.cli import main

    rc = main(["quantize", str(tmp_path / "nowhere"), "--out", str(tmp_path / "q"), *argv])
    assert rc == 2 and why in capsys.readouterr().err
    assert not (tmp_path / "q").exists()


def test_kv_options_parse_scheme_options_after_commas():
    from lowbit.formats.kv import parse_kv_options

    assert [s.name for s in parse_kv_options("fp8,int4:block=16,bits=4,int8,fp8")] == ["fp8", "int4:block=16", "int8"]
    with pytest.raises(SchemeError, match="empty scheme"):
        parse_kv_options("fp8,,int8")


# ------------------------------------------------------------------ the row rule of static scales (scale=rowmax)
ROWS = torch.randint(0, 256, (5, 24), generator=torch.Generator().manual_seed(7))


def _layer_values(model, ids):
    """Every layer's float post-RoPE keys and values on ``ids`` ``[rows, kv_heads, tokens, head_dim]``, from a
    DynamicCache (calibration sees float inputs at every layer, so these are what it observes)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


@pytest.mark.parametrize("name", ["fp8", "fp8-head", "int8", "fp8:center", "fp8-head:center"])
def test_rowmax_scale_is_the_mean_over_rows_of_each_rows_abs_max(name):
    """scale=rowmax: each static scale is the mean over calibration rows of that row's abs-max (per KV head for
    per-head schemes; around the calibrated mean for centered ones) over qmax, brute force with explicit loops over
    rows; rows seen in one batch or in separate forwards give the same scales; and the rule differs from amax
    (the rows' maxima differ), which stays reachable as scale=amax."""
    s = KVScheme.parse(name.replace(":", ":scale=rowmax,") if ":" in name else name + ":scale=rowmax")
    assert s.rule == "rowmax" and KVScheme.parse(s.name) == s
    qmax = s.elements.qmax
    model = tiny(3)
    truth = _layer_values(model, ROWS)
    calibrate_kv(model, ROWS, s)
    split = tiny(3)
    calibrate_kv(split, [r[None] for r in ROWS], s)  # one row per forward: the rows merge across batches
    amax_model = tiny(3)
    calibrate_kv(amax_model, ROWS, KVScheme.parse(name.replace(":", ":scale=amax,") if ":" in name
                                                  else name + ":scale=amax"))
    differs = False
    for (k, v), attn, attn2, ref in zip(truth, attention_modules(model).values(), attention_modules(split).values(),
                                        attention_modules(amax_model).values(), strict=True):
        for short, x in (("k", k), ("v", v)):
            if s.center:
                mu = x.mean(dim=(0, 2))  # [kv_heads, head_dim] over every row and token
                assert torch.allclose(getattr(attn, f"{short}_offset"), mu, atol=1e-5)
                x = x - mu[None, :, None, :]
            per_row = []
            for r in range(x.shape[0]):
                row = x[r].abs()
                per_row.append([float(row[h].max()) for h in range(row.shape[0])] if s.per_head else [float(row.max())])
            want = torch.tensor(per_row).mean(dim=0) / qmax
            got = getattr(attn, f"{short}_scale")
            assert torch.allclose(got, want, rtol=1e-5, atol=0), (name, short)
            assert torch.allclose(getattr(attn2, f"{short}_scale"), got, rtol=1e-6)
            assert torch.allclose(getattr(ref, f"{short}_scale"), torch.tensor(per_row).amax(dim=0) / qmax, rtol=1e-5)
            assert bool((got <= getattr(ref, f"{short}_scale") * (1 + 1e-6)).all())  # a mean never exceeds the max
            differs |= not torch.allclose(got, getattr(ref, f"{short}_scale"), rtol=1e-3)
    assert differs


def test_scale_rules_parse_round_trip_and_are_refused_where_there_is_no_static_scale():
    for name in ("fp8:scale=rowmax", "fp8-head:scale=rowmax", "int8:scale=rowmax", "nvfp4:scale=rowmax",
                 "fp8-rot:scale=rowmax,center", "fp8:scale=attn"):
        s = KVScheme.parse(name)
        assert KVScheme.parse(s.name) == s and KVScheme.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    assert KVScheme.parse("fp8:scale=attn").rule == "amax"  # the search runs around amax / 448, as measured
    old = KVScheme.parse("fp8:scale=amax").to_dict()
    del old["rule"]  # a manifest from before the rule existed: its scales were calibrated by amax
    assert KVScheme.from_dict(old).rule == "amax"
    for bad in ("fp8-token:scale=rowmax", "int4:scale=rowmax", "int8-token:scale=rowmax"):
        with pytest.raises(SchemeError, match="scale=rowmax is a rule for calibrated static scales"):
            KVScheme.parse(bad)
    with pytest.raises(SchemeError, match="unknown KV scale rule 'median'"):
        KVScheme(KVScheme.parse("fp8").elements, rule="median")
    with pytest.raises(SchemeError, match="rule must be one of"):
        KVScheme.from_dict({**KVScheme.parse("fp8").to_dict(), "rule": 1})


def test_kv_benchmark_refuses_an_organism_folder_with_no_finished_organism(tmp_path):
    """benchmarks/kv.py --model organism-moe on a folder that holds no model and token ids: one clear error naming
    the command that builds it, before any work."""
    from benchmarks import kv

    with pytest.raises(SystemExit, match="holds no finished organism.*benchmarks.organism --arch qwen3moe"):
        kv.main(["--model", "organism-moe", "--organism", str(tmp_path), "--kv", "fp8", "--weights", "float"])


def test_kv_rows_of_another_cpu_are_other_rows():
    """kv.json keeps a row per CPU (GEMMs round differently), and a cost is taken against the float-KV row of the
    same CPU."""
    from benchmarks import kv

    base = {"model": "bundled", "weights": "float", "values_rotated": False, "seqlen": 2048, "windows": 3}
    a, b = ({**base, "kv": "none", "ppl": p, "machine": {"cpu": c}} for p, c in ((10.0, "A"), (11.0, "B")))
    rows = [a, b, {**base, "kv": "fp8", "ppl": 11.0, "machine": {"cpu": "A"}}]
    assert kv.row_key(a) != kv.row_key(b)
    assert kv.with_costs(rows)[2]["ppl_vs_float_kv"] == pytest.approx(0.1)


def test_kv_benchmark_reads_a_scheme_with_several_options_as_one():
    """benchmarks.kv --kv: an item with '=' and no ':' continues the scheme before it (a plain split on commas ran
    fp8:center=rope alone, then failed on scale=headroom); every name it gives parses to the scheme meant."""
    from benchmarks import kv

    names = kv.kv_names("none,fp8:center=rope,scale=headroom,fp8-rot:scale=rowmax,int4:block=64,bits=4,fp8")
    assert names == ["none", "fp8:center=rope,scale=headroom", "fp8-rot:scale=rowmax", "int4:block=64,bits=4", "fp8"]
    s = KVScheme.parse(names[1])
    assert s.prerope and s.rule == "headroom" and s != KVScheme.parse("fp8:center=rope")  # centered: rowmax default
    assert KVScheme.parse(names[3]).elements.group_size == 64


def test_fp8_defaults_to_headroom_other_static_formats_to_amax():
    """--kv fp8 / fp8-head calibrate by headroom, their -rot, :center and :center=rope forms by rowmax (headroom
    measured worse there); the other rules stay reachable under their own names, and a checkpoint's
    manifest that says rowmax stays rowmax; an fp8 preset whose options leave E4M3 falls back to rowmax; INT8 and
    NVFP4's static scales stay amax; dynamic formats have no rule to apply."""
    for name in ("fp8", "fp8-head", "fp8-rot", "fp8:center", "fp8:center=rope"):
        s = KVScheme.parse(name)
        default = "rowmax" if ("-rot" in name or "center" in name) else "headroom"  # rotated / centered: rowmax
        assert s.rule == default and s.name == name and "scale=" not in s.name
        for rule in {"rowmax", "amax", "headroom"} - {default}:
            old = KVScheme.parse(name.replace(":", f":scale={rule},") if ":" in name else f"{name}:scale={rule}")
            assert old.rule == rule and old != s and f"scale={rule}" in old.name and KVScheme.parse(old.name) == old
            assert KVScheme.from_dict(json.loads(json.dumps(old.to_dict()))) == old
    as_int = KVScheme.parse("fp8:elem=int")  # what it calibrated by before headroom was the default
    assert as_int.rule == "rowmax" and as_int.name == "int8:scale=rowmax" and KVScheme.parse(as_int.name) == as_int
    for name in ("int8", "int8-head", "nvfp4", "fp8-token", "int4"):
        assert KVScheme.parse(name).rule == "amax" and "scale=" not in KVScheme.parse(name).name
    model = tiny(3)
    truth = _layer_values(model, ROWS)
    calibrate_kv(model, ROWS, KVScheme.parse("fp8"))
    k0 = truth[0][0]
    assert torch.allclose(model.model.layers[0].self_attn.k_scale, k0.abs().amax(dim=(1, 2, 3)).mean() / 256,
                          rtol=1e-5)


def test_kl_meter_is_the_mean_kl_to_the_reference_rows_distribution_and_keeps_perplexity(tmp_path):
    """benchmarks/kv_kl.py: the reference row writes the float model's log-softmax, a later row's mean KL over the
    predicted positions equals ``F.kl_div`` on the two models' logits computed directly; perplexity beside the meter
    is bit for bit what it is without it; a reference of other windows or of none is refused."""
    import torch.nn.functional as F

    from benchmarks import kv_kl
    from lowbit.eval import perplexity

    ref_model, other = tiny(0), tiny(0)
    calibrate_kv(other, IDS, KVScheme.parse("fp8:scale=amax"))
    tokens = torch.randint(0, 256, (1, 3 * 20), generator=torch.Generator().manual_seed(3))
    fields = {"model": "tiny", "weights": "float", "seqlen": 20, "windows": 3, "cpu": "here"}
    with kv_kl.kl_meter(ref_model, tmp_path, fields, is_reference=True) as m:
        perplexity(ref_model, tokens, seqlen=20, windows=3, progress=False)
    assert m.window == 3
    plain = perplexity(other, tokens, seqlen=20, windows=3, progress=False)
    with kv_kl.kl_meter(other, tmp_path, fields, is_reference=False) as meter:
        metered = perplexity(other, tokens, seqlen=20, windows=3, progress=False)
    assert metered.ppl == plain.ppl
    win = tokens.reshape(3, 20)
    with torch.no_grad():
        lp = torch.log_softmax(ref_model(input_ids=win).logits[:, :-1].float(), -1)
        lq = torch.log_softmax(other(input_ids=win).logits[:, :-1].float(), -1)
    want = F.kl_div(lq.reshape(-1, 256), lp.reshape(-1, 256), log_target=True, reduction="sum") / (3 * 19)
    assert meter.count == 3 * 19 and meter.mean > 0
    assert meter.mean == pytest.approx(float(want), rel=1e-5)
    with pytest.raises(SystemExit, match="KL reference .* is of"):
        with kv_kl.kl_meter(other, tmp_path, fields | {"cpu": "elsewhere"}, is_reference=False):
            pass
    with pytest.raises(SystemExit, match="no KL reference"):
        with kv_kl.kl_meter(other, tmp_path, fields | {"windows": 2}, is_reference=False):
            pass


def test_scale_file_takes_keys_and_values_from_the_rows_asked_and_the_factor():
    """benchmarks/kv_scalefile.py: keys of one kept row, values of another, times the factor; a row that is not
    there (other seed, other CPU) is one clear error."""
    from benchmarks import kv_scalefile

    base = {"weights": "float", "model": "bundled", "calib": "8x512", "machine": {"cpu": "here"}}
    rows = [base | {"kv": "fp8", "calib_seed": 0, "k_scales": {"a": 1.0, "b": 2.0}, "v_scales": {"a": 3.0, "b": 4.0}},
            base | {"kv": "fp8-llmc", "calib_seed": 0, "k_scales": {"a": 5.0, "b": 6.0},
                    "v_scales": {"a": 7.0, "b": 8.0}}]
    d = kv_scalefile.build(rows, "fp8-llmc", "fp8", 2.0, 0, "8x512", "bundled", "here")
    assert d["scales"] == {"a": [10.0, 6.0], "b": [12.0, 8.0]} and d["calib_seed"] == 0
    with pytest.raises(SystemExit, match="no float-weights row of 'fp8'.*seed 1"):
        kv_scalefile.build(rows, "fp8", "fp8", 1.0, 1, "8x512", "bundled", "here")
    with pytest.raises(SystemExit, match="on this CPU"):
        kv_scalefile.build(rows, "fp8", "fp8", 1.0, 0, "8x512", "bundled", "elsewhere")


@pytest.mark.parametrize("name", ["fp8", "fp8-head", "fp8:center"])
def test_headroom_scale_maps_the_typical_rows_abs_max_to_256(name):
    """scale=headroom: each static E4M3 scale is the mean over calibration rows of that row's abs-max (per KV head
    for per-head schemes, around the mean for centered ones) over 256, brute force with explicit loops over rows;
    the largest calibration values fit unclipped up to 1.75 x that mean; the name round-trips."""
    s = KVScheme.parse(name.replace(":", ":scale=headroom,") if ":" in name else name + ":scale=headroom")
    assert s.rule == "headroom" and KVScheme.parse(s.name) == s
    assert (s == KVScheme.parse(name)) == (not s.center)  # the default of uncentered fp8 / fp8-head only
    assert KVScheme.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    model = tiny(3)
    truth = _layer_values(model, ROWS)
    calibrate_kv(model, ROWS, s)
    for (k, v), attn in zip(truth, attention_modules(model).values(), strict=True):
        for short, x in (("k", k), ("v", v)):
            if s.center:
                x = x - x.mean(dim=(0, 2))[None, :, None, :]
            per_row = [[float(x[r, h].abs().max()) for h in range(x.shape[1])] if s.per_head
                       else [float(x[r].abs().max())] for r in range(x.shape[0])]
            got = getattr(attn, f"{short}_scale")
            assert torch.allclose(got, torch.tensor(per_row).mean(dim=0) / 256, rtol=1e-5, atol=0), (name, short)
            assert bool((torch.tensor(per_row).mean(dim=0) < 448 * got).all())


def test_headroom_is_refused_where_precision_is_not_relative_or_scales_are_dynamic():
    for bad in ("int8:scale=headroom", "int8-head:scale=headroom", "nvfp4:scale=headroom"):
        with pytest.raises(SchemeError, match="scale=headroom leaves E4M3's top binade free"):
            KVScheme.parse(bad)
    with pytest.raises(SchemeError, match="scale=headroom is a rule for calibrated static scales"):
        KVScheme.parse("fp8-token:scale=headroom")
