"""The export registry (`lowbit.files.targets`): every target declares what it holds, every job asks it."""

import argparse

import pytest

from lowbit.errors import ConfigError, SchemeError
from lowbit.files import targets
from lowbit.files.specs import LayerSpec
from lowbit.formats import InputScheme, Scheme


def spec(scheme="w4g32", inp=None, shape=(64, 128), rotated=False):
    return LayerSpec("model.layers.0.mlp.up_proj", Scheme.parse(scheme), None if inp is None else InputScheme.parse(inp),
                     shape, rotated)


def test_every_target_is_registered_with_its_capabilities():
    assert list(targets.REGISTRY) == ["native", "transformers", "compressed-tensors", "gguf"]
    assert targets.TARGETS == ("compressed-tensors", "gguf")  # the ones `lowbit export` writes
    assert targets.REQUANT == ("gguf",)
    assert [n for n, t in targets.REGISTRY.items() if t.file_output] == ["gguf"]


def test_native_and_transformers_hold_what_the_others_refuse():
    hard = [spec("w4g48", "a8", rotated=True)]  # a partial group, quantized and rotated inputs
    why = targets.refusals(hard, "gpt2")
    assert list(why) == ["compressed-tensors", "gguf"]  # native / transformers hold every layer lowbit builds
    for name in ("native", "transformers"):
        targets.check(name, hard, "gpt2")


def test_check_raises_the_targets_own_refusal():
    with pytest.raises(SchemeError, match="GGUF cannot hold activation quantization"):
        targets.check("gguf", [spec(inp="a8")], "llama")
    targets.check("gguf", [spec("w4g32")], "llama")  # Q4_0, exact
    with pytest.raises(ValueError, match="unknown export target 'onnx'"):
        targets.check("onnx", [spec()])


def test_refusals_ask_every_registered_target(monkeypatch):
    def never(specs, model_type, allow_requant):
        raise SchemeError("toy format holds nothing")

    monkeypatch.setitem(targets.REGISTRY, "toy", targets.Target("toy", "nothing", never))
    assert targets.refusals([spec()], "llama") == {"toy": "toy format holds nothing"}


def test_the_command_line_choices_come_from_the_registry():
    from lowbit.cli import export, quantize

    for mod, flag in ((export, "--to"), (quantize, "--export-to")):
        sub = argparse.ArgumentParser().add_subparsers()
        mod.register(sub)
        action = next(a for p in sub.choices.values() for a in p._actions if flag in a.option_strings)
        assert tuple(action.choices) == targets.TARGETS


def test_an_export_job_is_checked_against_the_registry(tmp_path):
    from lowbit.api.export import ExportJob

    with pytest.raises(ConfigError, match="unknown export target 'native'"):
        ExportJob(tmp_path, "native", tmp_path / "o")
    with pytest.raises(ConfigError, match="--allow-requant applies to --to gguf only; compressed-tensors exports are "
                                          "always exact"):
        ExportJob(tmp_path, "compressed-tensors", tmp_path / "o", allow_requant=True)


def test_a_one_file_output_lowbit_wrote_is_known_by_its_target(tmp_path, monkeypatch):
    """`--force` over a one-file output asks the registry whose file it is: the GGUF marker lives with the GGUF
    writer alone, and the output guard (`api/outputs`) names no format."""
    from pathlib import Path

    from lowbit.api import outputs
    from lowbit.files import gguf_export
    from lowbit.io import OutputError

    assert targets.FILE_TARGETS == ("gguf",)
    (tmp_path / "m.gguf").write_bytes(b"GGUF not really")
    assert targets.written_by_lowbit(tmp_path / "m.gguf") is None
    with pytest.raises(OutputError, match=r"not a file lowbit exported \(gguf\)"):
        outputs.check_output(tmp_path / "m.gguf", True, file_output=True)
    monkeypatch.setattr(gguf_export, "written_by_lowbit", lambda p: Path(p) == tmp_path / "m.gguf")
    assert targets.written_by_lowbit(tmp_path / "m.gguf") == "gguf"
    assert outputs.check_output(tmp_path / "m.gguf", True, file_output=True) == (tmp_path / "m.gguf").resolve()
    text = Path(outputs.__file__).read_text()
    assert "gguf_export" not in text and "written_by" not in text.replace("targets.written_by_lowbit", "")
