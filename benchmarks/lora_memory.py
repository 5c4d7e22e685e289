"""Peak memory of GRPO full fine-tuning vs LoRA vs QLoRA on the same workload.

Each variant is the real recipe launched the way users launch it (``tune run grpo_full_finetune_distributed``
or ``tune run grpo_lora_finetune_distributed``, one process) in its own subprocess, from the shipped tiny
configs with the same data, batch, response length, kl_coef (so full fine-tuning holds a reference copy)
and number of steps; only the recipe and ``model`` differ (``lora_qwen2`` with the same sizes,
``quantize_base: True`` for QLoRA).

    python benchmarks/lora_memory.py                              # tiny (shipped) and small workloads, CPU
    python benchmarks/lora_memory.py --workload small --steps 3
    python benchmarks/lora_memory.py --workload qwen0.5b_shape --device cuda   # on a GPU

Workloads: ``tiny`` is the shipped 0.4M-parameter model (its memory is all framework overhead); ``small``
and ``qwen0.5b_shape`` are random-weight Qwen2-shaped models written to a temporary Hugging Face directory
(``qwen0.5b_shape`` has Qwen2.5-0.5B's layers, width, heads and MLP, with the tiny tokenizer's 512-token
vocabulary, so 358M rather than 494M parameters).

Reported per variant, on CPU (``/proc`` of the child):
  - peak RSS by the end of setup (models loaded), during training (sampled every 10 ms between the end of
    setup and the last step's metrics line) and overall (``ru_maxrss`` from ``wait4``: includes the final
    checkpoint save);
  - on CUDA, the recipe's own ``memory/peak_allocated_gib`` metric (``torch.cuda.max_memory_allocated``);
  - median step time (steps after the first);
  - the analytic size of the training state: weights (NF4 counted at 0.516 byte/parameter: 4 bits plus
    block scalers), gradients and AdamW moments of trainable parameters, and a reference copy (full
    fine-tuning with kl_coef > 0).
A baseline line gives the RSS of a process that only imports torch, torchtune and the recipes.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
TINY_FULL = REPO / "configs" / "tiny" / "full_grpo_cpu.yaml"
TINY_LORA = REPO / "configs" / "tiny" / "lora_grpo_cpu.yaml"

# Model sizes (torchtune qwen2 builder arguments) beyond the shipped tiny model. vocab_size stays 512: the
# tiny tokenizer has no other tokens.
WORKLOADS: Dict[str, Optional[Dict[str, int]]] = {
    "tiny": None,  # the shipped asset and configs, as they are
    "small": {
        "num_layers": 4, "num_heads": 8, "num_kv_heads": 8, "embed_dim": 1024, "intermediate_dim": 4096,
    },
    "qwen0.5b_shape": {
        "num_layers": 24, "num_heads": 14, "num_kv_heads": 2, "embed_dim": 896, "intermediate_dim": 4864,
    },
}
VARIANTS = {
    "full": ("grpo_full_finetune_distributed", TINY_FULL, {}),
    "lora": ("grpo_lora_finetune_distributed", TINY_LORA, {}),
    "qlora": ("grpo_lora_finetune_distributed", TINY_LORA, {"model.quantize_base": True}),
}
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)  # 4-bit codes, int8 block scalers, fp32 per 256 blocks


def make_checkpoint(shape: Dict[str, int], directory: Path) -> None:
    """A random-weight Qwen2-shaped Hugging Face model directory with the tiny tokenizer."""
    import torch
    from safetensors.torch import save_file
    from torchtune.models.qwen2 import qwen2
    from torchtune.models.qwen2._convert_weights import qwen2_tune_to_hf

    from torchtune_grpo.assets import asset_path

    asset = Path(asset_path("tiny_qwen2"))
    torch.manual_seed(0)
    model = qwen2(vocab_size=512, max_seq_len=1024, norm_eps=1e-6, rope_base=1e6, tie_word_embeddings=True,
                  **shape)
    state = qwen2_tune_to_hf(
        model.state_dict(), num_heads=shape["num_heads"], num_kv_heads=shape["num_kv_heads"],
        dim=shape["embed_dim"], tie_word_embeddings=True,
    )
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, directory / "model.safetensors")
    hf_config = json.loads((asset / "config.json").read_text())
    hf_config.update(
        hidden_size=shape["embed_dim"], intermediate_size=shape["intermediate_dim"],
        num_hidden_layers=shape["num_layers"], max_window_layers=shape["num_layers"],
        num_attention_heads=shape["num_heads"], num_key_value_heads=shape["num_kv_heads"],
    )
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2))
    for name in ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        shutil.copy(asset / name, directory / name)


def state_bytes(variant: str, config_path: Path, overrides: Dict[str, Any]) -> Dict[str, float]:
    """Analytic training-state size: weights, grads + AdamW moments of trainable params, reference copy."""
    import torch
    from omegaconf import OmegaConf
    from torchtune import config as tt_config

    cfg = OmegaConf.load(config_path)
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    with torch.device("meta"):
        model = tt_config.instantiate(cfg.model)
    total = sum(p.numel() for p in model.parameters())
    nf4 = 0
    if OmegaConf.select(cfg, "model.quantize_base", default=False):
        nf4 = sum(m.weight.numel() for m in model.modules() if type(m).__name__ == "LoRALinear")
    trainable = total if variant == "full" else sum(
        p.numel() for n, p in model.named_parameters() if "lora_" in n
    )
    dense = total - nf4
    weights = 4 * dense + NF4_BYTES_PER_PARAM * nf4  # fp32 on CPU
    reference = weights if (variant == "full" and float(cfg.get("kl_coef", 0)) > 0) else 0
    return {
        "params": total,
        "trainable": trainable,
        "state_gib": (weights + 4 * trainable * 3 + reference) / 2**30,  # grads + 2 AdamW moments, fp32
    }


def _rss_kib(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def run_variant(recipe: str, config_path: Path, out: Path, steps: int, threads: int) -> Dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(threads)}
    tune = str(Path(sys.executable).parent / "tune")
    proc = subprocess.Popen(
        [tune, "run", recipe, "--config", str(config_path)], cwd=out.parent, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    card, metrics = out / "algorithm_card.md", out / "metrics.jsonl"
    marks = {"setup_kib": 0, "train_kib": 0}
    log: List[str] = []

    def drain() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            log.append(line)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    while True:
        # wait4 (not Popen.poll) reaps the child, so its resource usage (ru_maxrss) is ours to read.
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            break
        if card.exists():
            if not marks["setup_kib"]:
                marks["setup_kib"] = _rss_kib(proc.pid, "VmHWM")
            done = metrics.exists() and len(metrics.read_text().splitlines()) >= steps
            if not done:
                marks["train_kib"] = max(marks["train_kib"], _rss_kib(proc.pid, "VmRSS"))
        time.sleep(0.01)
    reader.join(timeout=5)
    if proc.returncode != 0 or not metrics.exists():
        sys.stderr.write("".join(log[-60:]))
        raise RuntimeError(f"{recipe} failed with {proc.returncode}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    times = [r["time/step"] for r in rows[1:]] or [rows[0]["time/step"]]
    result = {
        "setup_peak_mib": marks["setup_kib"] / 1024,
        "train_peak_mib": marks["train_kib"] / 1024,
        "step_s": statistics.median(times),
        "cuda_peak_gib": max((r.get("memory/peak_allocated_gib", 0.0) for r in rows), default=0.0),
        "overall_peak_mib": usage.ru_maxrss / 1024,
    }
    return result


def baseline_mib(threads: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen(
        [sys.executable, "-c", "import torch, torchtune, grpo_full_finetune_distributed, "
         "grpo_lora_finetune_distributed"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    _, _, usage = os.wait4(proc.pid, 0)
    return usage.ru_maxrss / 1024


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=[*WORKLOADS, "both"], default="both",
                        help="'both' = tiny and small. Default: both")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps per run. Default: 3")
    parser.add_argument("--device", default="cpu", help="cpu or cuda. Default: cpu")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run. Default: 1")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    workloads = ["tiny", "small"] if args.workload == "both" else [args.workload]

    results: Dict[str, Any] = {"baseline_mib": baseline_mib(args.threads), "runs": []}
    print(f"baseline (imports only): peak RSS {results['baseline_mib']:.0f} MiB")
    with tempfile.TemporaryDirectory(prefix="lora_memory_") as tmp:
        for workload in workloads:
            shape = WORKLOADS[workload]
            ckpt_dir = None
            if shape is not None:
                ckpt_dir = Path(tmp) / f"{workload}_model"
                make_checkpoint(shape, ckpt_dir)
            print(f"\n{workload}: {args.steps} steps, device {args.device}")
            print(f"{'variant':<7} {'params':>8} {'trainable':>10} {'state GiB':>9} {'setup MiB':>9} "
                  f"{'train MiB':>9} {'overall MiB':>11} {'cuda GiB':>8} {'step s':>7}")
            for variant in args.variants:
                recipe, base_config, extra = VARIANTS[variant]
                from omegaconf import OmegaConf

                cfg = OmegaConf.load(base_config)
                out = Path(tmp) / f"{workload}_{variant}" / "out"
                overrides: Dict[str, Any] = {
                    "output_dir": str(out), "max_steps": args.steps, "save_every_n_steps": None,
                    "log_completions": 0, "device": args.device, **extra,
                }
                if shape is not None:
                    overrides.update({f"model.{k}": v for k, v in shape.items()})
                    overrides["checkpointer.checkpoint_dir"] = str(ckpt_dir)
                for key, value in overrides.items():
                    OmegaConf.update(cfg, key, value, force_add=True, merge=False)
                out.parent.mkdir(parents=True, exist_ok=True)
                config_path = out.parent / "config.yaml"
                OmegaConf.save(cfg, config_path)
                sizes = state_bytes(variant, config_path, {})
                measured = run_variant(recipe, config_path, out, args.steps, args.threads)
                row = {"workload": workload, "variant": variant, **sizes, **measured}
                results["runs"].append(row)
                print(f"{variant:<7} {sizes['params'] / 1e6:>7.1f}M {sizes['trainable'] / 1e6:>9.2f}M "
                      f"{sizes['state_gib']:>9.3f} {measured['setup_peak_mib']:>9.0f} "
                      f"{measured['train_peak_mib']:>9.0f} {measured['overall_peak_mib']:>11.0f} "
                      f"{measured['cuda_peak_gib']:>8.2f} {measured['step_s']:>7.2f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
