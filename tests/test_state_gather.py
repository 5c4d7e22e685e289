"""The checkpoint's gather of FSDP2-sharded weights (torchtune_grpo/runtime/sharding.py, ``gather_full_state_dict``):
on two gloo processes, every tensor of a model whose first dimensions do not divide by two (so the second rank's
piece is shorter, or empty) comes back on rank 0 equal to the unsharded model's, bit for bit (copies only), and the
other rank gets nothing."""

import os
import sys

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from tests.conftest import free_port


def _model() -> nn.Module:
    torch.manual_seed(0)
    # Rows 7 and 3 (uneven over 2 ranks), 1 (the second rank's piece empty), a buffer that is not sharded.
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3), nn.Linear(3, 1))
    model.register_buffer("scale", torch.arange(4.0))
    return model


def _rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from torchtune_grpo.runtime.sharding import gather_full_state_dict

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = _model()
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        state = gather_full_state_dict(model, rank == 0)
        torch.save(state, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_gather_the_unsharded_weights(tmp_path):
    out = str(tmp_path / "state")
    mp.start_processes(_rank, args=(free_port(), out), nprocs=2, start_method="spawn")
    expected = _model().state_dict()
    got = torch.load(f"{out}.0")
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name].device.type == "cpu" and torch.equal(got[name], value), name
    assert torch.load(f"{out}.1") == {}


def test_an_unsharded_nf4_weight_comes_back_dequantized():
    # As torchtune's gather: a QLoRA base weight kept out of FSDP2 is saved as its original dtype's values.
    from torchao.dtypes.nf4tensor import to_nf4

    from torchtune_grpo.runtime.sharding import gather_full_state_dict

    torch.manual_seed(0)
    module = nn.Module()
    module.register_buffer("weight", to_nf4(torch.randn(64, 256), 64, 256))
    got = gather_full_state_dict(module, True)["weight"]
    assert type(got) is torch.Tensor and torch.equal(got, module.weight.get_original_weight())
    assert gather_full_state_dict(module, False) == {}
