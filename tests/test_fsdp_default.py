"""Which model one process trains (docs/configs.md, `fsdp_single_process`): the plain model by default,
FSDP2 (DTensor parameters) with `fsdp_single_process: true` or `fsdp_cpu_offload: true`.

With more than one process the recipe always uses FSDP2; the multi-process tests
(tests/test_algorithms_recipe.py, tests/test_recipe.py::test_two_processes) run it that way.
"""

import logging
from functools import partial

import pytest
from omegaconf import OmegaConf
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.distributed.tensor import DTensor

from tests.recipe_utils import recipe_in_process, write_config


@pytest.mark.parametrize(
    "overrides, sharded, mode",
    [
        ({}, False, "the plain model (fsdp_single_process: false)"),
        ({"fsdp_single_process": False}, False, "the plain model (fsdp_single_process: false)"),
        ({"fsdp_single_process": True}, True, "the FSDP2-wrapped model (fsdp_single_process: true)"),
        ({"fsdp_cpu_offload": True}, True, "the FSDP2-wrapped model (fsdp_cpu_offload: true)"),
    ],
    ids=["default", "false", "true", "cpu_offload"],
)
def test_one_process_trains_the_plain_model_unless_asked(
    tmp_path, clean_env, one_thread, caplog, monkeypatch, overrides, sharded, mode
):

    if overrides.get("fsdp_cpu_offload"):
        # torchtune's shard_model offloads with pinned memory, which needs an accelerator (a CPU-only machine
        # raises "Cannot access accelerator device"): unpinned here, the choice of FSDP2 is what is tested.
        # (torchtune_grpo.runtime.sharding.shard_model builds the policy: it adds the mixed-precision policy.)
        monkeypatch.setattr(
            "torchtune_grpo.runtime.sharding.CPUOffloadPolicy", partial(CPUOffloadPolicy, pin_memory=False)
        )
    # The tiny config has kl_coef > 0: the frozen reference model goes through the same choice as the policy.
    cfg = OmegaConf.load(write_config(tmp_path, max_steps=1, **overrides))
    assert "fsdp_single_process" not in cfg or overrides  # the default case really relies on the default
    with caplog.at_level(logging.INFO), recipe_in_process(cfg) as recipe:
        assert recipe.world_size == 1
        reference = recipe.step.build_experience.reference
        assert reference is not None and reference.model is not recipe.model
        for model in (recipe.model, reference.model):
            params = dict(model.named_parameters())
            assert params
            for name, p in params.items():
                assert isinstance(p, DTensor) == sharded, name
            assert isinstance(model, FSDPModule) == sharded
        assert f"One process: training {mode}" in caplog.text
