"""A .gguf file as a --stream source (`lowbit.models.gguf_source`): dequantized per tensor with gguf-py.

Reference: the in-model path on the same file (transformers' GGUF loader, which lowbit's
`load_model` uses, then RTN and `native.save`): the streamed checkpoint must hold the same
tensors byte for byte. The bundled model is a real Q4_1 GGUF (SmolLM2-135M, llama.cpp's
llama graph: q/k rows in interleaved rotary order on disk, tied embeddings).
"""

from __future__ import annotations

import json

import pytest
from conftest import skip_without_bundled
from test_stream import _same

from lowbit.api.stream import StreamJob, stream_quantize
from lowbit.errors import ModelError
from lowbit.files import native
from lowbit.models.accounting import gate
from lowbit.plans.plan import Plan
from lowbit.plans.source import build_plan, plan_source
from lowbit.ptq.conductor import PtqSpec, conduct
from lowbit.ptq.methods import RunContext


def test_streamed_gguf_source_is_the_in_model_quantization_of_the_loaded_file(tmp_path):
    skip_without_bundled()
    from lowbit.models.loading import bundled_gguf, load_model

    path = bundled_gguf()
    s = stream_quantize(StreamJob(model=path, out=tmp_path / "s", scheme="w4g64", search=False, progress=False))
    model = load_model(path).model.eval()
    plan = build_plan(model, plan_source("w4g64"))
    dropped = gate(model, list(plan))
    conduct(model, Plan({n: r for n, r in plan.items() if n not in dropped}), PtqSpec("rtn", {"search": False}),
            RunContext(progress=False))
    native.save(model, None, tmp_path / "ref")
    _same(tmp_path / "ref", tmp_path / "s")
    meta = json.loads((tmp_path / "s" / native.MANIFEST).read_text())["meta"]
    assert meta["source_kind"] == "gguf (streamed)" and meta["source"] == str(path)
    assert set(meta["source_precision"]) == {"gguf Q4_1", "gguf Q8_0", "gguf F32"}  # Q8_0: token_embd
    assert s["source_precision"] == meta["source_precision"]
    assert (tmp_path / "s" / "tokenizer.json").is_file() or (tmp_path / "s" / "tokenizer_config.json").is_file()


def test_a_truncated_gguf_source_is_one_error(tmp_path):
    skip_without_bundled()
    from lowbit.models.loading import bundled_gguf

    bad = tmp_path / "cut.gguf"
    bad.write_bytes(bundled_gguf().read_bytes()[: 10 << 20])
    with pytest.raises(ModelError, match="truncated"):
        stream_quantize(StreamJob(model=bad, out=tmp_path / "o", scheme="w4g64", progress=False))
    assert not (tmp_path / "o").exists()
