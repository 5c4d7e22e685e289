"""The one-process group a run gets without torchrun (torchtune_grpo/runtime/collectives.py, ``init_process_group``):
its store is in memory, so no port is picked, and a port taken by another process (another job's store, as
happens when two runs start side by side) cannot stop it or mix it with that job."""

import os
import socket

import torch
import torch.distributed as dist

from torchtune_grpo.runtime.collectives import init_process_group


def test_one_process_group_needs_no_port(monkeypatch):
    assert not dist.is_initialized()  # a test that left its group would make this one meaningless
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        # A MASTER_PORT someone else listens on: a group that opened its store there would fail to bind it.
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(taken.getsockname()[1]))
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            monkeypatch.delenv(name, raising=False)
        init_process_group("cpu")
        try:
            assert (dist.get_rank(), dist.get_world_size()) == (0, 1)
            assert os.environ["WORLD_SIZE"] == "1"
            value = torch.tensor([2.0])
            dist.all_reduce(value)
            assert value.item() == 2.0
        finally:
            dist.destroy_process_group()
