"""Data-parallel SignRound under torch.distributed: two gloo processes give one process's result.

Each rank embeds and propagates its half of the calibration samples (outputs all-gathered),
runs its half of every tuning mini-batch, and sums losses and gradients over the ranks
before the sign step; the codes must equal a single process's. A world size that does not
divide the samples (or the mini-batch) is one clear error before any work.
"""

from __future__ import annotations

import copy
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ptq_helpers import calib, tiny_model, uniform
from test_train_distributed import _finish_rank

from lowbit.errors import ConfigError
from lowbit.nn import quant_layers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tune(model, v2: bool, workdir: str | None = None):
    from lowbit.ptq.signround import make_config, signround_quantize

    cfg = make_config(iters=6, batch_size=4, v2=v2, tune_dtype="fp32", cache_dtype="fp32")
    return signround_quantize(model, uniform(model, "w2g32" if v2 else "w4g32a"), cfg, calib(), progress=False,
                              workdir=workdir)


def _rank(rank: int, world: int, port: int, v2: bool, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        m = tiny_model(layers=2)
        infos = _tune(m, v2, workdir=out + ".work")
        codes = {n: q.codes for n, q in quant_layers(m).items()}
        torch.save({"codes": codes, "infos": infos}, f"{out}.{rank}")
    except BaseException:
        dist.destroy_process_group()
        raise
    _finish_rank()


@pytest.mark.parametrize("v2", [True, False])
def test_two_processes_tune_as_one(tmp_path, v2):
    torch.set_num_threads(1)
    single = tiny_model(layers=2)
    ref = _tune(single, v2)
    out = str(tmp_path / "r")
    mp.spawn(_rank, args=(2, _free_port(), v2, out), nprocs=2, join=True)
    ref_codes = {n: q.codes for n, q in quant_layers(single).items()}
    for rank in range(2):
        got = torch.load(f"{out}.{rank}")
        assert got["codes"].keys() == ref_codes.keys()
        for n, c in ref_codes.items():
            assert torch.equal(got["codes"][n], c), n
        for a, b in zip(got["infos"], ref, strict=True):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
            assert a["rtn_loss"] == pytest.approx(b["rtn_loss"], rel=1e-5)
    # only rank 0 wrote the work folder, and it holds every block
    assert sorted(p.name for p in (tmp_path / "r.work").glob("block_*.safetensors")) == [
        "block_0000.safetensors", "block_0001.safetensors"]


def test_filtered_loss_parts_add_up_to_the_whole(monkeypatch):
    """The ranks' parts of the filtered MSE sum to the one-process loss, dropping the same k errors."""
    from lowbit.ptq import signround
    from lowbit.ptq.blockwise import Shard

    g = torch.Generator().manual_seed(0)
    pred, ref = torch.randn(4, 16, 8, generator=g), torch.randn(4, 16, 8, generator=g)
    whole = signround.filtered_mse(pred, ref, 0.05)
    halves = [(pred[:2], ref[:2]), (pred[2:], ref[2:])]

    def fake_gather(parts, vals):  # both ranks' top-k values, as all_gather would deliver them
        for r, (p, q) in enumerate(halves):
            parts[r].copy_((p - q).reshape(-1).pow(2).topk(len(vals), sorted=False).values)

    monkeypatch.setattr(dist, "all_gather", fake_gather)
    total = sum(signround.filtered_mse_shard(p, q, 0.05, Shard(r, 2)) for r, (p, q) in enumerate(halves))
    assert total.item() == pytest.approx(whole.item(), rel=1e-6)


@pytest.mark.parametrize("nsamples,batch,msg", [(7, 4, "do not split over 2"), (8, 3, "mini-batch of 3")])
def test_a_world_that_does_not_divide_is_one_error_before_any_work(monkeypatch, nsamples, batch, msg):
    from lowbit.ptq.blockwise import Shard, loop, shards
    from lowbit.ptq.signround import make_config, signround_quantize

    monkeypatch.setattr(shards, "current_shard", lambda: Shard(0, 2))
    monkeypatch.setattr(loop, "capture_inputs", lambda *a, **k: pytest.fail("work started"))
    m = tiny_model(layers=1)
    before = copy.deepcopy(m.state_dict())
    with pytest.raises(ConfigError, match=msg):
        signround_quantize(m, uniform(m, "w4g32"), make_config(iters=2, batch_size=batch), calib(nsamples),
                           progress=False)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())


def _awq(model, workdir: str | None = None):
    from lowbit.ptq.awq import AWQSettings, awq_scale

    return awq_scale(model, uniform(model, "w3g32"), calib(), AWQSettings(grid=4, inputs="quantized"), progress=False,
                     workdir=workdir)


def _awq_rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        m = tiny_model(layers=2)
        info = _awq(m, workdir=out + ".work")
        torch.save({"state": m.state_dict(), "info": info}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_awq_two_processes_scale_as_one(tmp_path):
    """AWQ on the engine under torchrun: each rank propagates half the samples, statistics are summed over
    the ranks, and every rank folds the scales one process folds (rank 0 alone writes the work folder)."""
    torch.set_num_threads(1)
    single = tiny_model(layers=2)
    ref = _awq(single)
    out = str(tmp_path / "r")
    mp.spawn(_awq_rank, args=(2, _free_port(), out), nprocs=2, join=True)
    got = [torch.load(f"{out}.{r}") for r in range(2)]
    for k, v in single.state_dict().items():
        assert torch.equal(got[0]["state"][k], got[1]["state"][k]), k  # the ranks agree exactly
        torch.testing.assert_close(got[0]["state"][k], v, rtol=1e-5, atol=1e-6)
    assert got[0]["info"]["scaled"] == ref["scaled"]
    assert got[0]["info"]["mean_error_ratio"] == pytest.approx(ref["mean_error_ratio"], rel=1e-4)
    assert sorted(p.name for p in (tmp_path / "r.work" / "awq").glob("block_*.safetensors")) == [
        "block_0000.safetensors", "block_0001.safetensors"]
