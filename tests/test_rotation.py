"""Hadamard rotation of the residual stream: the rotated float model computes what the original did."""

import copy

import pytest
import torch
from ptq_helpers import calib, uniform

from lowbit.errors import ConfigError, ModelError
from lowbit.models.structure import residual_map
from lowbit.ptq import quantize_model
from lowbit.ptq.rotation import Rotation, RotationSettings, rotate_model


def _randomize_norms(model):
    """Trained norms are not all ones: random scales make the folding step matter."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) * 1.5 + 0.25)
    return model


def llama(hidden=64, tie=True, heads=4, kv=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=heads,
                      num_key_value_heads=kv, vocab_size=256, tie_word_embeddings=tie)
    return _randomize_norms(LlamaForCausalLM(cfg).eval())


def qwen2(hidden=96):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=hidden, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False)
    m = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # q/k/v biases (zero at init) and an o_proj bias exercise the bias paths
        for name, p in m.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return _randomize_norms(m)


def qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=256, tie_word_embeddings=True)
    return _randomize_norms(Qwen3ForCausalLM(cfg).eval())


def same_function(a, b, tol=2e-6) -> float:
    ids = calib(3, 24, seed=7)
    with torch.no_grad():
        la, lb = a(ids).logits.double(), b(ids).logits.double()
    rel = float((la - lb).abs().max() / la.abs().max())
    assert rel < tol, rel
    return rel


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("kind", ["random", "hadamard", "haar"])
def test_rotated_llama_equals_the_float_model(tie, kind):
    m = llama(tie=tie)
    r = copy.deepcopy(m)
    info = rotate_model(r, RotationSettings(kind=kind))
    same_function(m, r)
    assert info["untied_head"] is tie and info["probe_rel_diff"] < 1e-5
    assert r.lm_head.weight is not r.model.embed_tokens.weight and r.config.tie_word_embeddings is False
    for name, p in r.named_parameters():
        if "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
    # it did rotate: no weight of a reader is left as it was (up to the folded norm scale)
    assert not torch.allclose(r.model.layers[0].self_attn.q_proj.weight, m.model.layers[0].self_attn.q_proj.weight)


@pytest.mark.parametrize("make", [qwen2, qwen3], ids=["qwen2-width96-bias", "qwen3-qknorm-tied"])
def test_rotated_qwen_equals_the_float_model(make):
    m = make()
    r = copy.deepcopy(m)
    rotate_model(r)
    same_function(m, r)


def test_rotation_matrix_is_orthogonal_for_non_power_of_two_widths():
    for n in (12, 96, 576):
        rot = Rotation.make(n, RotationSettings(seed=1))
        eye = torch.eye(n, dtype=torch.float64)
        r = rot.rows(eye)  # rows of I times R = R
        assert torch.allclose(r @ r.T, eye, atol=1e-12)
        assert torch.allclose(rot.columns(eye), r.T, atol=1e-12)  # R^T W with W = I


def test_haar_rotation_is_a_seeded_dense_orthogonal_matrix():
    """kind="haar": any width (92 has no Hadamard construction), orthogonal, the seed picks it, dense
    (no row has a zero); a given matrix is checked before it turns anything."""
    from lowbit.ptq.rotation import haar_orthogonal

    eye = torch.eye(92, dtype=torch.float64)
    rot = Rotation.make(92, RotationSettings(kind="haar", seed=3))
    r = rot.rows(eye)
    assert torch.allclose(r @ r.T, eye, atol=1e-12) and torch.allclose(rot.columns(eye), r.T, atol=1e-12)
    assert torch.equal(r, haar_orthogonal(92, 3)) and not torch.allclose(r, haar_orthogonal(92, 4))
    assert bool((r != 0).all()) and float(r.abs().max()) < 0.6  # spread: no channel maps onto one
    # the sign fix makes Q Haar-distributed: the mean of a diagonal entry over draws is ~0, not biased positive
    assert abs(float(torch.stack([haar_orthogonal(8, s).diagonal() for s in range(200)]).mean())) < 0.05
    with pytest.raises(ConfigError, match="not orthogonal"):
        Rotation.dense(4, torch.ones(4, 4))
    with pytest.raises(ConfigError, match="needs an 3 x 3 matrix"):
        Rotation.dense(4, torch.eye(4), kept=[0])
    kept = Rotation.dense(4, torch.eye(3), kept=[2])
    assert kept.kept == [2] and kept.mixed.tolist() == [0, 1, 3]


def test_haar_rotation_of_a_width_without_hadamard_keeps_the_function():
    m = llama(hidden=92, heads=2, kv=2)
    r = copy.deepcopy(m)
    info = rotate_model(r, RotationSettings(kind="haar"))
    assert info["rotated_width"] == 92 and "hadamard_m" not in info
    same_function(m, r)


def test_norms_that_cannot_be_folded_are_named():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, GemmaConfig, GemmaForCausalLM

    cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, vocab_size=256)
    gemma = GemmaForCausalLM(GemmaConfig(**cfg)).eval()
    before = copy.deepcopy(gemma.state_dict())
    with pytest.raises(ModelError, match=r"GemmaDecoderLayer block 0's input_layernorm \(GemmaRMSNorm\) does not "
                                         r"compute x / rms\(x\) \* weight"):
        rotate_model(gemma)
    assert all(torch.equal(before[k], v) for k, v in gemma.state_dict().items())  # refused before touching it
    gemma3 = Gemma3ForCausalLM(Gemma3TextConfig(**cfg)).eval()
    with pytest.raises(ModelError, match="Gemma3DecoderLayer blocks also normalize at pre_feedforward_layernorm, "
                                         "post_feedforward_layernorm"):
        residual_map(gemma3)


def test_width_without_hadamard_construction_is_refused():
    m = llama(hidden=92, heads=2, kv=2)  # 92 = 4 * 23: no Hadamard matrix of order 92 / 46 / 23 lowbit can build
    with pytest.raises(ModelError, match="no Hadamard construction for the model width 92"):
        rotate_model(m)


def test_quantized_model_is_not_rotated():
    m = llama()
    quantize_model(m, uniform(m, "w4g32"), "rtn", {"search": False}, progress=False)
    with pytest.raises(ConfigError, match="rotate the float model before quantizing"):
        rotate_model(m)


def test_rotated_quantized_checkpoint_round_trips(tmp_path, tiny_tokenizer):
    """A tied model comes back untied from its checkpoint, with the same logits."""
    from lowbit.files.native import load, save

    m = llama(tie=True)
    quantize_model(m, uniform(m, "w4g32"), "rtn", {"search": False}, rotate=RotationSettings(), progress=False)
    save(m, tiny_tokenizer, tmp_path / "q")
    back, _ = load(tmp_path / "q")
    assert back.lm_head.weight is not back.model.embed_tokens.weight
    ids = calib(2, 16, seed=9)
    with torch.no_grad():
        assert torch.equal(m(ids).logits, back(ids).logits)


def test_rotation_spreads_an_outlier_channel():
    """What the rotation is for: one heavy channel of the stream spreads over all of them."""
    m = llama(tie=False)
    with torch.no_grad():
        for block in m.model.layers:
            block.mlp.up_proj.weight[:, 5] *= 30
    r = copy.deepcopy(m)
    rotate_model(r)

    def kurtosis(w):
        w = w.detach()
        return float(((w - w.mean()) ** 4).mean() / w.var() ** 2)

    assert kurtosis(r.model.layers[0].mlp.up_proj.weight) < kurtosis(m.model.layers[0].mlp.up_proj.weight) / 5


def test_finetune_rebuilds_the_rotated_float_weights_and_refuses_awq(tiny_hf_dir, tmp_path):
    """An error-initialised adapter (QWHA, LoftQ) needs the float weights that were quantized: the rotation
    is data-free, so the base model is rotated again and checked against the checkpoint's digest; AWQ's
    scales came from calibration data and cannot be redone, so such adapters are refused up front."""
    from lowbit.api import QuantizeJob, quantize
    from lowbit.api.finetune import base_weights, check_prestep
    from lowbit.files.native import load, read_manifest

    quantize(QuantizeJob(out=tmp_path / "q", model=str(tiny_hf_dir), scheme="w4g32", method="rtn",
                         settings={"search": False}, rotate=True, evaluation=None, progress=False))
    manifest = read_manifest(tmp_path / "q")
    names = list(manifest["layers"])
    weights, info = base_weights(manifest, names, None)
    assert info["base_verified"] is True
    q, _ = load(tmp_path / "q")
    for n in names[:3]:  # the rebuilt float weight is what the stored codes were rounded from
        err = (weights[n] - q.get_submodule(n).weight).abs().max()
        assert err <= q.get_submodule(n).scales.abs().max()
    manifest["meta"]["awq"] = {"grid": 20}
    with pytest.raises(ConfigError, match="quantized after AWQ scaling"):
        check_prestep(manifest, "qwha")
    check_prestep(manifest, "lora")


def test_rotated_tied_model_exports_to_gguf_and_compressed_tensors(tmp_path):
    """A fused rotation is plain weights: both engine formats hold it, the untied head included."""
    pytest.importorskip("gguf")
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    from lowbit.files import compressed_tensors as ct
    from lowbit.files import gguf_export as ge

    m = llama(tie=True)
    quantize_model(m, uniform(m, "w4g32"), "rtn", {"search": False}, rotate=RotationSettings(), progress=False)
    ids = calib(2, 16, seed=9)
    with torch.no_grad():
        ref = m(ids).logits
    ge.export(m, None, tmp_path / "m.gguf", embeddings="f16")  # the tables as the model holds them (16-bit)
    g = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32)
    ct.export(m, None, tmp_path / "ct")
    c = ct.load_decompressed(tmp_path / "ct")
    for loaded in (g, c):
        assert loaded.config.tie_word_embeddings is False
        with torch.no_grad():
            assert torch.equal(loaded(ids).logits, ref)


def test_channels_a_norm_switches_off_stay_out_of_the_rotation():
    """keep=None leaves the 'massive' channels an RMSNorm multiplies by ~0 where they are; the function holds."""
    m = llama()
    with torch.no_grad():
        m.model.layers[1].post_attention_layernorm.weight[[5, 17]] = 1e-4  # switched off before the MLP
    ref = copy.deepcopy(m)
    emb = m.model.embed_tokens.weight.detach().clone()
    info = rotate_model(m, RotationSettings(keep=None))
    # 64 - 2 = 62 has no Hadamard construction: the next quietest channels join until the rest has one
    assert {5, 17} <= set(info["kept_channels"]) and factor_ok(info["rotated_width"])
    kept = info["kept_channels"]
    assert torch.equal(m.model.embed_tokens.weight[:, kept], emb[:, kept])  # identity on the kept channels
    assert not torch.allclose(m.model.embed_tokens.weight[:, 0], emb[:, 0])  # the others turn
    same_function(ref, m)
    assert {5, 17} <= set(rotate_model(copy.deepcopy(ref), RotationSettings(keep=32))["kept_channels"])
    with pytest.raises(ModelError, match="--rotate-keep"):  # 61 rotated channels: no Hadamard of that order
        rotate_model(copy.deepcopy(ref), RotationSettings(keep=3))
    none = rotate_model(copy.deepcopy(ref), RotationSettings(keep=0))
    assert none["kept_channels"] == [] and none["rotated_width"] == 64
    dense = copy.deepcopy(ref)  # a dense rotation needs no Hadamard width: exactly the switched-off channels
    assert rotate_model(dense, RotationSettings(kind="haar", keep=None))["kept_channels"] == [5, 17]
    same_function(ref, dense)


def factor_ok(n: int) -> bool:
    from lowbit.transforms.hadamard import factor

    return factor(n) is not None


def test_rotate_keep_flag(tmp_path, capsys):
    from lowbit.cli import main

    base = ["quantize", "--scheme", "w4g32", "--no-eval", "--out", str(tmp_path / "q")]
    assert main([*base, "--rotate-keep", "auto"]) == 2
    assert "--rotate-keep sets which channels --rotate leaves alone" in capsys.readouterr().err
    assert main([*base, "--rotate", "--rotate-keep", "some"]) == 2
    assert "--rotate-keep takes auto or a number" in capsys.readouterr().err
