"""Two gloo processes on CPU reproduce the single-process loss curve (same global batch).

A tiny pure-torch language model keeps the spawned processes quick to start; its hidden
layer is a 2-bit QAT layer under WinQ (re-init + noise), so the check also covers noise
that must be drawn identically on every rank.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lowbit.train import TrainConfig, train


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.head = nn.Linear(2 * dim, vocab)

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.head(torch.tanh(self.up(self.embed(input_ids)))))


def _setup() -> tuple[nn.Module, torch.Tensor]:
    from lowbit.qat import StretchedElastic, to_qat

    torch.manual_seed(0)
    data = torch.randint(0, 64, (12, 16), generator=torch.Generator().manual_seed(1))
    model = TinyLM()
    to_qat(model, StretchedElastic(), names=["up"])
    return model, data


def _callbacks() -> list:
    from lowbit.qat import WinQCallback, WinQConfig

    return [WinQCallback(WinQConfig(every=2, sigma_w=1e-2, sigma_a=1e-2))]


def _config(parallel: str = "ddp") -> TrainConfig:
    return TrainConfig(steps=6, batch_size=4, grad_accum=2, lr=1e-2, warmup=1, parallel=parallel, progress=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(rank: int, world: int, port: int, parallel: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from lowbit.train.distributed import init_from_env

    init_from_env()
    model, data = _setup()
    r = train(model, data, _config(parallel), callbacks=_callbacks())
    if rank == 0:
        torch.save(r.losses, out)
    _finish_rank()


def _finish_rank() -> None:
    """Leave a spawned rank after its work succeeded: both ranks meet before gloo is torn down, and the process
    ends without the interpreter's teardown, where gloo's threads have aborted a rank now and then ("terminate called
    without an active exception", SIGABRT, in fresh-clone runs) after every result was written."""
    dist.monitored_barrier(timeout=timedelta(seconds=120))
    dist.destroy_process_group()
    os._exit(0)


@pytest.mark.parametrize("parallel", ["ddp"])
def test_two_processes_match_one(tmp_path, parallel):
    model, data = _setup()
    single = train(model, data, _config(), callbacks=_callbacks()).losses
    out = str(tmp_path / "losses.pt")
    mp.spawn(_run, args=(2, _free_port(), parallel, out), nprocs=2, join=True)
    assert torch.load(out) == pytest.approx(single, abs=1e-5)
    assert single[-1] < single[0]
