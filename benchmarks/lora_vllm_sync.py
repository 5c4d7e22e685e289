"""LoRA with the vLLM engine: what a sync costs, and what a step costs, against the alternatives.

``sync``: one process, one ``VLLMGenerator``, a LoRA policy (rank 8 on q/k/v/o and the MLP) with random
non-zero adapters; the time and bytes of each way the weights can reach the engine, with the sync check:

- ``adapter``: the adapter alone, as a new vLLM adapter version (what ``lora_sync: adapter`` sends after
  every optimizer step; the base went once, before training);
- ``merge``: every weight, the adapter merged in fp32 (``lora_sync: merge``);
- ``full``: every weight of a plain model (the full fine-tuning recipe's sync).

``steps``: the LoRA (or, ``--recipe full``, the full fine-tuning) recipe through ``tune run`` for a few steps with the vLLM engine and with the native
engine on the same model and prompts; per-step ``time/generation``, ``time/train`` (everything but
generation, rewards and the sync: experience and update), ``time/weight_sync``, and the response tokens
trained, so the update can be compared per token (the two engines sample different completions).

    python benchmarks/lora_vllm_sync.py sync MODEL_DIR [--repeats 3]
    python benchmarks/lora_vllm_sync.py steps MODEL_DIR --engine vllm|native [--recipe lora|full] [--steps 3]

    python benchmarks/lora_vllm_sync.py llama100m DIR      # writes the llama100m-shaped random model

``MODEL_DIR``: a Hugging Face directory, e.g. SmolLM2-135M (``benchmarks/smollm2.py``) or the llama100m
shape of ``grpo_vs_trl.WORKLOADS`` as a random Llama directory (``llama100m``; no tokenizer: ``sync`` needs
none).
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LORA = dict(lora_attn_modules=["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True,
            lora_rank=8, lora_alpha=16)


def _timed(fn):
    t0 = time.perf_counter()
    value = fn()
    return time.perf_counter() - t0, value


def sync(model_dir: str, repeats: int) -> dict:
    import torch
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo")
    from torchtune_grpo.generation import VLLMGenerator, WeightPublisher, WeightSyncCheck
    from torchtune_grpo.generation._lora_sync import adapter_weights, base_weights, merged_weights
    from torchtune_grpo.models.lora import lora_hyperparams
    from torchtune_grpo.models import HFCheckpointer, lora_hf_model

    cpu = torch.device("cpu")
    model = lora_hf_model(model_dir, max_seq_len=256, **LORA)
    state = HFCheckpointer(model_dir, output_dir=tempfile.mkdtemp()).load_checkpoint()["model"]
    model.load_state_dict(state, strict=False)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_b" in name:
                p.normal_(0, 0.01)
    model.eval()
    engine = VLLMGenerator(model=model_dir, max_model_len=256, kv_cache_memory_gib=0.5)
    check = WeightSyncCheck(probe="random", probe_length=64)
    publisher = WeightPublisher(engine, check, probe_prompt=[], device=cpu, all_reduce_max=lambda x: x,
                                trainer_dtype=torch.float32)
    t_start, first = _timed(lambda: publisher.publish(model, step=0))  # engine start + base + adapter v0
    out = {"model_dir": model_dir, "loadavg_1min_start": os.getloadavg()[0], "engine_start_and_first_sync_s": t_start,
           "first_sync": first}
    adapter_runs = []
    for step in range(1, repeats + 1):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.add_(1e-3 * torch.randn_like(p))
        adapter_runs.append(publisher.publish(model, step=step))
    scale = LORA["lora_alpha"] / LORA["lora_rank"]
    hparams = lora_hyperparams(model)
    adapter_s, merge_s, full_s = [], [], []
    for i in range(repeats):
        # the adapter alone, without the check: gather + PEFT files + vLLM add_lora (+ old version removed)
        adapter_s.append(_timed(lambda: engine.load_adapter(adapter_weights(model, cpu), hparams,
                                                            version=repeats + 1 + i))[0])
        # merged weights, loaded without an adapter: what lora_sync: merge sends every step
        merge_s.append(_timed(lambda: engine.load_weights(merged_weights(model, cpu, torch.float32, scale)))[0])
        # every weight as it is (the base): what the full fine-tuning recipe sends, with no merge arithmetic
        full_s.append(_timed(lambda: engine.load_weights(base_weights(model, cpu, torch.float32)))[0])
    merged_bytes = sum(t.numel() * t.element_size() for _, t in merged_weights(model, cpu, torch.float32, scale))
    out["adapter"] = {
        "load_s": statistics.median(adapter_s),
        "sync_s_with_check": statistics.median(r["time/weight_sync"] for r in adapter_runs),
        "bytes": adapter_runs[-1]["generation/sync_bytes"],
        "sync_logprob_diff_max": max(r["generation/sync_logprob_diff"] for r in adapter_runs),
    }
    out["merge"] = {"load_s": statistics.median(merge_s), "bytes": merged_bytes}
    out["full"] = {"load_s": statistics.median(full_s), "bytes": merged_bytes}
    out["check_s"] = _timed(lambda: publisher.check.measure(
        torch.zeros(63), engine.prompt_logprobs(check.probe(engine.vocab_size))))[0]  # the engine's half of a check
    out["bytes_ratio_adapter_over_full"] = out["adapter"]["bytes"] / merged_bytes
    out["loadavg_1min_end"] = os.getloadavg()[0]
    engine.close()
    return out


def steps(model_dir: str, engine: str, n: int, recipe: str, lora_sync: str = "adapter") -> dict:
    sys.path.insert(0, str(REPO))
    from omegaconf import OmegaConf

    work = Path(tempfile.mkdtemp(prefix=f"{recipe}_{engine}_"))
    base = "lora_vllm_grpo_cpu.yaml" if recipe == "lora" else "vllm_grpo_cpu.yaml"
    cfg = OmegaConf.load(REPO / "configs" / "tiny" / base)
    cfg.output_dir = str(work / "out")
    cfg.checkpointer = {"_component_": "torchtune_grpo.models.HFCheckpointer", "checkpoint_dir": model_dir,
                        "output_dir": "${output_dir}"}
    if recipe == "lora":
        cfg.model = {"_component_": "torchtune_grpo.models.lora_hf_model", "path": model_dir, "max_seq_len": 512,
                     **LORA}
    else:
        cfg.model = {"_component_": "torchtune_grpo.models.hf_model", "path": model_dir, "max_seq_len": 512}
        cfg.generation.pop("dtype")  # the trainer's (the default when dtype is unset)
        cfg.optimizer.lr = 1e-6
    cfg.tokenizer = {"_component_": "torchtune_grpo.models.hf_tokenizer", "path": model_dir}
    cfg.dataset.prompt_style = "chat"
    cfg.update({"batch_size": 4, "group_size": 8, "micro_batch_size": 32, "max_response_length": 48, "max_steps": n,
                "save_every_n_steps": None, "lr_scheduler": None, "kl_coef": 0.0})
    if engine == "native":
        cfg.generation = {"_component_": "torchtune_grpo.generation.NativeGenerator", "temperature": 1.0}
        cfg.loss.pop("tis_cap")
    else:
        cfg.generation.max_model_len = 512
        if recipe == "lora":
            cfg.generation.lora_sync = lora_sync
    OmegaConf.save(cfg, work / "config.yaml")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "recipes"), str(REPO)])}
    t0 = time.perf_counter()
    name = "grpo_lora_finetune_distributed" if recipe == "lora" else "grpo_full_finetune_distributed"
    proc = subprocess.run([str(Path(sys.executable).parent / "tune"), "run", name, "--config", str(work / "config.yaml")],
                          cwd=work, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-3000:] + proc.stderr[-3000:])
    rows = [json.loads(l) for l in (work / "out" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    keys = ("time/step", "time/generation", "time/train", "time/weight_sync", "response_length/mean",
            "generation/sync_bytes", "generation/sync_logprob_diff", "generation/logprob_mismatch")
    per_step = [{k: r[k] for k in keys if k in r} for r in rows]
    for r in per_step:  # trained tokens: batch x G responses of mean length
        r["train_s_per_1k_response_tokens"] = 1000 * r["time/train"] / (32 * r["response_length/mean"])
    return {"recipe": recipe, "engine": engine, "lora_sync": lora_sync if recipe == "lora" else None,
            "model_dir": model_dir, "wall_s": time.perf_counter() - t0,
            "loadavg_1min_end": os.getloadavg()[0], "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "steps": per_step}


def write_llama100m(directory: str) -> dict:
    """grpo_vs_trl's llama100m shape (12 layers, 768 wide, 12/4 heads, tied 32k vocabulary) as a random Llama
    Hugging Face directory (std 0.02, fp32)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                         num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=4096,
                         rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    model.save_pretrained(directory)
    return {"written": directory}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["sync", "steps", "llama100m"])
    parser.add_argument("model_dir")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engine", choices=["vllm", "native"], default="vllm")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--recipe", choices=["lora", "full"], default="lora")
    parser.add_argument("--lora-sync", choices=["adapter", "merge"], default="adapter")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.what == "llama100m":
        result = write_llama100m(args.model_dir)
    elif args.what == "sync":
        result = sync(args.model_dir, args.repeats)
    else:
        result = steps(args.model_dir, args.engine, args.steps, args.recipe, args.lora_sync)
    text = json.dumps(result, indent=1)
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text)
    os._exit(0)  # vLLM's in-process teardown and the gloo group: leave without them


if __name__ == "__main__":
    main()
