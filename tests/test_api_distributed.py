"""The jobs under torchrun: two gloo processes train / tune like one, and only rank 0 writes --out.

Each spawned process sets the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_*) and runs the api job itself: the job joins the process group, places the
model before the loop wraps it (DDP), and rank 0 alone evaluates and saves.
"""

from __future__ import annotations

import importlib
import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_train_distributed import _finish_rank

from lowbit.errors import ConfigError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from conftest import make_llama
    from test_qat_cli import WORDS, word_tokenizer

    d = tmp_path_factory.mktemp("dist")
    tok = word_tokenizer()
    make_llama(len(tok), layers=1).save_pretrained(d / "fp")
    tok.save_pretrained(d / "fp")
    g = torch.Generator().manual_seed(0)
    docs = [" ".join(WORDS[j] for j in torch.randint(0, 120, (200,), generator=g).tolist()) for _ in range(8)]
    (d / "corpus.txt").write_text("\n\n".join(docs))
    return d


def qat_job(d, out):
    from lowbit.api.qat import QatJob, TrainConfig

    train = TrainConfig(steps=4, batch_size=4, lr=1e-2, warmup=0, progress=False, out_dir=None)
    return QatJob(out=str(out), scheme="w2", train=train, method="ste", model=str(d / "fp"),
                  data=str(d / "corpus.txt"), seqlen=16, evaluation=None)


def finetune_job(d, out):
    from lowbit.api.finetune import FinetuneJob, TrainConfig, TrainingData, peft_config

    train = TrainConfig(steps=3, batch_size=4, lr=1e-2, warmup=0, progress=False)
    return FinetuneJob(str(d / "q"), str(out), peft_config("lora", rank=2), train,
                       data=TrainingData(str(d / "corpus.txt"), nsamples=8, seqlen=16), evaluation=None,
                       progress=False)


def quantize_job(d, out):
    from lowbit.api import Calibration, QuantizeJob

    return QuantizeJob(out=str(out), model=str(d / "fp"), scheme="w4g32", method="signround2",
                       settings={"iters": 3, "batch_size": 4, "tune_dtype": "fp32"},
                       calib=Calibration(str(d / "corpus.txt"), nsamples=4, seqlen=16), evaluation=None,
                       progress=False)


JOBS = {"qat": qat_job, "finetune": finetune_job, "quantize": quantize_job}


def _rank(rank: int, world: int, port: int, kind: str, d: str, out: str) -> None:
    from pathlib import Path

    from lowbit import api

    _env(rank, world, port)
    try:
        res = getattr(api, kind)(JOBS[kind](Path(d), out))
        Path(f"{out}.rank{rank}.json").write_text(json.dumps(res, default=str))
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    if dist.is_initialized():
        _finish_rank()


@pytest.mark.parametrize("kind", ["qat", "finetune", "quantize"])
def test_two_processes_run_the_job_as_one(tiny_dir, tmp_path, kind):
    from lowbit import api

    if kind == "finetune" and not (tiny_dir / "q").exists():
        api.quantize(api.QuantizeJob(out=str(tiny_dir / "q"), model=str(tiny_dir / "fp"), scheme="w4g32",
                                     evaluation=None, settings={"search": False}, progress=False))
    torch.set_num_threads(1)
    single = getattr(api, kind)(JOBS[kind](tiny_dir, tmp_path / "single"))
    out = str(tmp_path / "two")
    mp.spawn(_rank, args=(2, _free_port(), kind, str(tiny_dir), out), nprocs=2, join=True)
    r0 = json.loads((tmp_path / "two.rank0.json").read_text())
    r1 = json.loads((tmp_path / "two.rank1.json").read_text())
    assert r0["world"] == 2 and "out" in r0 and "out" not in r1
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("two")) == [
        "two", "two.rank0.json", "two.rank1.json"] + (["two.train"] if kind in ("qat", "finetune") else [])
    if kind == "qat":
        assert r0["final_loss"] == pytest.approx(single["final_loss"], rel=1e-4), (r0["final_loss"], single["final_loss"])
    elif kind == "finetune":
        assert r0["loss_last"] == pytest.approx(single["loss_last"], rel=1e-4), (r0["loss_last"], single["loss_last"])
    else:
        from lowbit.files.native import load

        a, _ = load(tmp_path / "two")
        b, _ = load(tmp_path / "single")
        for (n, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
            assert torch.equal(x, y), n


@pytest.mark.parametrize("world,extra,msg", [(3, {}, "--nsamples 4 does not split over the 3"),
                                             (2, {"batch_size": 3}, "mini-batch of 3"),
                                             (2, {"method": "rtn"}, "does not run data-parallel")])
def test_torchrun_worlds_that_cannot_split_fail_before_any_work(tiny_dir, tmp_path, monkeypatch, world, extra,
                                                                msg):
    from lowbit import api
    q = importlib.import_module("lowbit.api.quantize")

    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setattr("lowbit.models.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    job = quantize_job(tiny_dir, tmp_path / "o")
    if "method" in extra:
        job = api.QuantizeJob(out=str(tmp_path / "o"), model=str(tiny_dir / "fp"), method="rtn", evaluation=None)
    elif extra:
        job = api.QuantizeJob(out=str(tmp_path / "o"), model=str(tiny_dir / "fp"), method="signround2",
                              settings={"iters": 1, **extra}, calib=job.calib, evaluation=None)
    with pytest.raises(ConfigError, match=msg):
        q.quantize(job)
    assert not (tmp_path / "o").exists()


def test_a_model_too_large_for_the_device_fails_before_any_work(tiny_dir, tmp_path, monkeypatch):
    """Whole-model passes that cannot fit the GPU: one error naming --no-eval / --device cpu, no tuning."""
    q = importlib.import_module("lowbit.api.quantize")
    from lowbit.models import placement

    real_free = placement.free_bytes
    monkeypatch.setattr(q, "job_device", lambda _d: torch.device("cuda", 0))
    monkeypatch.setattr(placement, "free_bytes", lambda _d: 2**20)  # 1 MiB free
    monkeypatch.setattr("lowbit.ptq.quantize_model", lambda *a, **k: pytest.fail("tuning started"))
    with pytest.raises(ConfigError, match="--no-eval.*--device cpu"):
        q.quantize(quantize_job(tiny_dir, tmp_path / "o").__class__(
            out=str(tmp_path / "o"), model=str(tiny_dir / "fp"), scheme="w4g32", method="signround2"))
    assert not (tmp_path / "o").exists()
    monkeypatch.setattr(placement, "free_bytes", real_free)
    placement.check_fits(10**12, torch.device("cpu"), "x")  # host memory is not checked
    monkeypatch.setattr(placement, "free_bytes", lambda _d: 2**40)
    placement.check_fits(10**9, torch.device("cuda", 0), "x")  # fits: no error
