"""The one sealed-folder helper (`lowbit.files.sealed`): manifest read, checksum check, sealing.

The hostile suites check each kind of folder end to end; these check the helper itself,
and that every kind of folder lowbit seals goes through it.
"""

import hashlib
import json
from pathlib import Path

import pytest

from lowbit.errors import CheckpointError, ModelError
from lowbit.files.sealed import Seal, SealedFile, damage, digests

SEAL = Seal("test folder", "m.json", "lowbit-test", 3, fix="delete {folder} and rerun", origin="make one first")


def sealed(tmp_path: Path) -> Path:
    d = tmp_path / "f"
    d.mkdir()
    (d / "a.bin").write_bytes(b"alpha")
    (d / "b.bin").write_bytes(b"beta")
    SEAL.write(d, {"format": "lowbit-test", "version": 3, "files": digests(d)}, indent=1)
    return d


def test_digests_are_sha256_in_name_order(tmp_path):
    d = sealed(tmp_path)
    m = SEAL.read(d)
    assert list(m["files"]) == ["a.bin", "b.bin"]  # the manifest is written after them: not in its own list
    assert m["files"]["a.bin"] == hashlib.sha256(b"alpha").hexdigest()
    assert digests(d, ["b.bin"]) == {"b.bin": hashlib.sha256(b"beta").hexdigest()}
    assert (d / "m.json").read_text() == json.dumps(m, indent=1)
    assert sorted(p.name for p in d.iterdir()) == ["a.bin", "b.bin", "m.json"]  # no temporary left behind


def test_check_returns_the_verified_paths(tmp_path):
    d = sealed(tmp_path)
    assert SEAL.check(d, SEAL.read(d)["files"]) == {"a.bin": d / "a.bin", "b.bin": d / "b.bin"}


@pytest.mark.parametrize("edit,needle", [
    (lambda d: (d / "a.bin").write_bytes(b"alphA"), r"a.bin does not match its checksum \(truncated or corrupted"),
    (lambda d: (d / "a.bin").unlink(), r"a.bin is missing; the test folder is incomplete — delete .* and rerun"),
])
def test_a_damaged_or_missing_file_is_one_error_naming_the_fix(tmp_path, edit, needle):
    d = sealed(tmp_path)
    edit(d)
    with pytest.raises(CheckpointError, match=needle):
        SEAL.check(d, SEAL.read(d)["files"])
    assert damage(d, SEAL.read(d)["files"], "m.json") == "a.bin does not match its checksum"


@pytest.mark.parametrize("name", ["../outside.bin", "/etc/passwd", ".."])
def test_a_manifest_cannot_name_a_file_outside_its_folder(tmp_path, name):
    d = sealed(tmp_path)
    (tmp_path / "outside.bin").write_bytes(b"alpha")
    with pytest.raises(CheckpointError, match="not a plain file name"):
        SEAL.check(d, {name: hashlib.sha256(b"alpha").hexdigest()})
    assert damage(d, {name: "0"}, "m.json").startswith(f"{name}: ")


def test_a_missing_digest_never_passes(tmp_path):
    d = sealed(tmp_path)
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        SEAL.check(d, {"a.bin": None})


@pytest.mark.parametrize("text,needle", [
    (None, r"is not a lowbit test folder \(no m.json\); make one first"),
    ("{not json", r"not valid JSON.*the test folder is damaged or corrupted — delete .* and rerun"),
    ('{"format": "lowbit-test", "version": 4}', r"format 'lowbit-test' version 4; this lowbit reads 'lowbit-test' "
                                                r"version 3 — delete"),
    ("[1, 2]", r"format 'list' version None"),
])
def test_a_bad_manifest_is_one_error(tmp_path, text, needle):
    d = tmp_path / "f"
    d.mkdir()
    if text is not None:
        (d / "m.json").write_text(text)
    with pytest.raises(CheckpointError, match=needle):
        SEAL.read(d)


def test_the_error_class_is_the_kinds_own(tmp_path):
    seal = Seal("cache entry", "c.json", "x", 1, fix="rerun", error=ModelError)
    with pytest.raises(ModelError):
        seal.read(tmp_path)


def test_every_sealed_kind_uses_the_one_helper():
    """Native checkpoints, adapters and training checkpoints each declare their seal; no reader of its own."""
    from lowbit.files import native
    from lowbit.peft import store
    from lowbit.train import checkpoint

    seals = {m.__name__: m.SEAL for m in (native, store, checkpoint)}
    assert all(isinstance(s, Seal) for s in seals.values())
    assert [s.manifest for s in seals.values()] == ["lowbit.json", "adapter.json", "checkpoint.json"]
    src = Path(native.__file__).parents[1]
    for path in (src / "files" / "native.py", src / "peft" / "store.py", src / "train" / "checkpoint.py",
                 src / "files" / "gguf_read.py", src / "ptq" / "blockwise" / "store.py"):
        text = path.read_text()
        assert "does not match its checksum" not in text, path  # the checksum check lives in files/sealed.py
        assert "sha256_file(f)" not in text, path
    work = (src / "ptq" / "blockwise" / "store.py").read_text()  # the work folder's blocks: sealed files
    assert "sha256(data)" not in work and "checksum mismatch" not in work and "SealedFile" in work


def test_a_sealed_file_says_why_it_cannot_be_used(tmp_path):
    f = SealedFile(tmp_path / "block_0000.safetensors")
    assert f.read() == (None, "unverified (no block_0000.json: interrupted while saving, or an older lowbit)")
    f.write(b"payload")
    assert f.sidecar == tmp_path / "block_0000.json"
    assert json.loads(f.sidecar.read_text()) == {"sha256": hashlib.sha256(b"payload").hexdigest(), "bytes": 7}
    assert f.read() == (b"payload", None)
    f.path.write_bytes(b"payloaX")
    assert f.read() == (None, "corrupted (checksum mismatch)")
    f.path.write_bytes(b"pay")
    assert f.read() == (None, "truncated (3 of 7 bytes)")
    f.sidecar.write_text("{not json")
    assert f.read() == (None, "unverified (block_0000.json is damaged)")
    f.sidecar.write_text(json.dumps({"sha256": hashlib.sha256(b"pay").hexdigest()}))  # an older sidecar: no size
    assert f.read() == (b"pay", None)
