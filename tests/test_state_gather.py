"""The gathers of FSDP2-sharded weights (torchtune_grpo/runtime/sharding.py, ``gather_full_tensor``): on two gloo
processes, every tensor of a model whose first dimensions do not divide by two (so the second rank's piece is
shorter, or empty) comes back equal to the unsharded model's, bit for bit (copies only): the checkpoint's on rank 0
(the other rank gets nothing), and the weight syncs' (``full_weights``, the LoRA sync's ``base_weights``) on both."""

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn


def _model() -> nn.Module:
    torch.manual_seed(0)
    # Rows 7 and 3 (uneven over 2 ranks), 1 (the second rank's piece empty), a buffer that is not sharded.
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3), nn.Linear(3, 1))
    model.register_buffer("scale", torch.arange(4.0))
    return model


def _rank(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from torchtune_grpo.generation import full_weights
    from torchtune_grpo.generation._lora_sync import base_weights
    from torchtune_grpo.runtime.sharding import gather_full_state_dict

    # A file store: no port to pick, so none another test's process can take in between.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        model = _model()
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        cpu = torch.device("cpu")
        gathered = {"checkpoint": gather_full_state_dict(model, rank == 0),
                    "some_keys": gather_full_state_dict(model, rank == 0, keys={"1.weight", "scale"}),
                    "weight_sync": dict(full_weights(model, cpu)),
                    "lora_sync": dict(base_weights(model, cpu, torch.float32))}
        torch.save(gathered, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_gather_the_unsharded_weights(tmp_path):
    out = str(tmp_path / "state")
    mp.start_processes(_rank, args=(str(tmp_path / "store"), out), nprocs=2, start_method="spawn")
    expected = _model().state_dict()
    for rank in (0, 1):
        got = torch.load(f"{out}.{rank}")
        kinds = ("checkpoint", "weight_sync", "lora_sync") if rank == 0 else ("weight_sync", "lora_sync")
        for kind in kinds:
            assert got[kind].keys() == expected.keys(), (rank, kind)
            for name, value in expected.items():
                assert got[kind][name].device.type == "cpu" and torch.equal(got[kind][name], value), (rank, kind, name)
        if rank == 0:  # only the keys asked for (a LoRA checkpoint of the adapters only)
            assert got["some_keys"].keys() == {"1.weight", "scale"}
            assert all(torch.equal(got["some_keys"][name], expected[name]) for name in ("1.weight", "scale"))
        else:
            assert got["checkpoint"] == got["some_keys"] == {}


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
