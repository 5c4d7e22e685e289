"""The image demo's warm start (scripts/demo_images.sh): a tiny random Gemma 3 image-text directory made in code,
and a plain supervised fine-tune of it on image prompts.

torchtune's SFT recipe does not train a transformers image-text model, so :func:`image_sft` is a short PyTorch
loop over transformers' own class (``AutoModelForImageTextToText``): the prompts are built exactly as the GRPO
recipe builds them (:func:`~torchtune_grpo.data.image_dataset` with the directory's processor), the response is
the row's ``response_column`` followed by the end-of-turn token, and the loss is the cross-entropy of the response
tokens only. Every parameter trains: the random vision tower must learn to see.
"""

import json
import math
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

__all__ = ["GEMMA3_IMAGE_TEMPLATE", "image_sft", "tiny_gemma3_dir"]

# Gemma 3's chat template, shortened: a system message goes ahead of the first user turn; a content that is a list
# of items writes <start_of_image> for each image (the processor expands it to the image's tokens) and the text.
GEMMA3_IMAGE_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set first_user_prefix = '' %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- for message in loop_messages %}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}
    {%- set ns = namespace(text='') %}
    {%- if message['content'] is string %}
        {%- set ns.text = message['content'] %}
    {%- else %}
        {%- for item in message['content'] %}
            {%- if item['type'] == 'image' %}
                {%- set ns.text = ns.text + '<start_of_image>' %}
            {%- elif item['type'] == 'text' %}
                {%- set ns.text = ns.text + item['text'] %}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {{- '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') + ns.text | trim + '<end_of_turn>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<start_of_turn>model\\n' }}
{%- endif %}
"""
_SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
             "<image_soft_token>"]
END_OF_TURN = "<end_of_turn>"
#: The files of a model directory besides the weights (copied into the SFT's output).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "processor_config.json",
                   "generation_config.json")


def tiny_gemma3_dir(directory, *, seed: int = 0) -> Path:
    """Write a tiny random Gemma 3 image-text directory (no download): what ``AutoModelForImageTextToText``,
    ``AutoProcessor`` and the GRPO recipe load.

    - tokenizer: the package's tiny byte-level BPE (``tiny_qwen2``: 480 tokens, every digit its own token) with
      Gemma 3's special and image tokens after it (ids 480-487), :data:`GEMMA3_IMAGE_TEMPLATE` as chat template;
    - language model: 2 full-attention layers, hidden 128, 4 heads of 32 (2 KV heads), MLP 256, vocab 512, tied;
    - vision tower: SigLIP, 1 layer, hidden 32, 32 x 32 pixels in 4 x 4 patches, pooled by the projector to
      4 image tokens (one per 16 x 16 quarter of the picture);
    - processor: ``Gemma3Processor`` resizing every picture to 32 x 32.

    Args:
        directory: where to write (created if needed).
        seed (int): the weights' seed (transformers' own initialisation). Default is 0.

    Returns:
        Path: ``directory``.
    """
    from tokenizers import Tokenizer
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor

    from torchtune_grpo.assets import asset_path

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    bpe = json.loads(Path(asset_path("tiny_qwen2", "tokenizer.json")).read_text(encoding="utf-8"))
    bpe["added_tokens"] = []  # Qwen2's special tokens go: Gemma 3's come instead
    tok = Tokenizer.from_str(json.dumps(bpe))
    tok.add_special_tokens(_SPECIALS)
    tok.save(str(directory / "tokenizer.json"))
    i = tok.token_to_id
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
        "extra_special_tokens": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                 "image_token": "<image_soft_token>"}}, indent=1), encoding="utf-8")
    rope = dict(rope_type="default", rope_theta=10000.0)
    text = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, num_hidden_layers=2, layer_types=["full_attention"] * 2, query_pre_attn_scalar=32,
                max_position_embeddings=256, final_logit_softcapping=None, bos_token_id=i("<bos>"),
                eos_token_id=i("<eos>"), pad_token_id=i("<pad>"),
                rope_parameters=dict(sliding_attention=rope, full_attention=rope))
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=4, vision_use_head=False)
    config = AutoConfig.for_model("gemma3", text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                  boi_token_index=i("<start_of_image>"), eoi_token_index=i("<end_of_image>"),
                                  image_token_index=i("<image_soft_token>"))
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config, dtype=torch.float32).save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps({  # stop at the end of the model's turn
        "bos_token_id": i("<bos>"), "eos_token_id": [i("<eos>"), i(END_OF_TURN)], "pad_token_id": i("<pad>")},
        indent=1), encoding="utf-8")
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 32, "width": 32}),
                                tokenizer=AutoTokenizer.from_pretrained(directory),
                                chat_template=GEMMA3_IMAGE_TEMPLATE, image_seq_length=4)
    processor.save_pretrained(directory)
    return directory


def _batch(items: List[Dict[str, Any]], responses: List[List[int]], pad_id: int) -> Dict[str, torch.Tensor]:
    """Prompt + response rows, right-padded: ``input_ids``, ``attention_mask``, ``token_type_ids`` ``[B, L]``,
    ``labels [B, L]`` (-100 but on the response tokens) and ``pixel_values [images, 3, H, W]``."""
    rows = [item["tokens"] + response for item, response in zip(items, responses)]
    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), pad_id)
    labels = torch.full((len(rows), length), -100)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    types = torch.zeros(len(rows), length, dtype=torch.long)
    for b, (item, response, row) in enumerate(zip(items, responses, rows)):
        prompt = len(item["tokens"])
        ids[b, :len(row)] = torch.tensor(row)
        labels[b, prompt:len(row)] = torch.tensor(response)
        mask[b, :len(row)] = 1
        types[b, :prompt] = item["image_inputs"]["token_type_ids"]
    pixels = torch.cat([item["image_inputs"]["pixel_values"] for item in items])
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types, "labels": labels,
            "pixel_values": pixels}


def image_sft(model_dir, data_file, output_dir, *, response_column: str = "teacher", epochs: int = 2,
              batch_size: int = 64, lr: float = 3e-3, warmup_steps: int = 20, seed: int = 0,
              log: Optional[Callable[[str], None]] = print) -> Path:
    """Supervised fine-tuning of an image-text directory on a JSONL of image prompts (module docstring).

    The optimiser is AdamW (no weight decay), the learning rate warms up linearly over ``warmup_steps`` and then
    falls linearly to 0 at the last step, gradients are clipped to norm 1; fp32, on the CPU.

    Args:
        model_dir: the directory to start from (e.g. :func:`tiny_gemma3_dir`).
        data_file: a JSONL in :func:`~torchtune_grpo.data.image_dataset`'s format (``image``, ``question``) with
            the target text in ``response_column``.
        output_dir: where the trained directory goes (weights, config, and ``model_dir``'s tokenizer, processor
            and generation files): a directory the GRPO recipe starts from.
        response_column (str): the column holding the response to learn. Default is ``"teacher"``.
        epochs (int): passes over the file. Default is 2.
        batch_size (int): prompts per optimiser step. Default is 64.
        lr (float): the peak learning rate. Default is 3e-3.
        warmup_steps (int): steps of linear warm-up. Default is 20.
        seed (int): seed of the shuffling (and of nothing else: the loop has no other randomness). Default is 0.
        log (Optional[Callable[[str], None]]): where progress lines go. Default is ``print``.

    Returns:
        Path: ``output_dir``.
    """
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from torchtune_grpo.data._images import image_dataset

    model_dir, output_dir = Path(model_dir), Path(output_dir)
    items = list(image_dataset(None, "json", data_files=str(data_file), model_dir=str(model_dir),
                               max_prompt_length=None, on_invalid_row="error"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    end_of_turn = tok.convert_tokens_to_ids(END_OF_TURN)
    responses = [tok(str(item[response_column]), add_special_tokens=False)["input_ids"] + [end_of_turn]
                 for item in items]
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    steps_per_epoch = math.ceil(len(items) / batch_size)
    total = epochs * steps_per_epoch
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup_steps, (total - s) / max(1, total - warmup_steps)))
    order = torch.Generator().manual_seed(seed)
    step = 0
    for epoch in range(epochs):
        for batch in torch.randperm(len(items), generator=order).split(batch_size):
            inputs = _batch([items[i] for i in batch], [responses[i] for i in batch], tok.pad_token_id)
            loss = model(**inputs).loss
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            step += 1
            if log is not None and (step % 25 == 0 or step == total):
                log(f"SFT step {step}/{total} (epoch {epoch + 1}): loss {loss.item():.4f}")
    model.save_pretrained(output_dir)
    for name in TOKENIZER_FILES:
        shutil.copyfile(model_dir / name, output_dir / name)
    return output_dir
