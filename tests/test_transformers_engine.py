"""The transformers engine (torchtune_grpo/generation/_transformers.py): transformers' ``generate`` sampling
from the trainer's current weights, the sampler TRL uses."""

import torch

from tests.hf_models import make_hf_model, make_model_dir, hf_components
from tests.recipe_utils import read_jsonl, run_tune, write_config
from torchtune_grpo.generation import NativeGenerator, TransformersGenerator
from torchtune_grpo.models import hf_model, HFCheckpointer

PAD, STOP = 0, 7


def _policy(directory, tmp_path):
    model = hf_model(str(directory))
    model.load_state_dict(HFCheckpointer(str(directory), str(tmp_path / "scratch")).load_checkpoint()["model"])
    return model.eval()


def test_greedy_completions_equal_the_native_engines(tmp_path):
    # The weights reach transformers' model through the name/layout conversion (llama: q/k rows permuted
    # back): greedy decoding, prompt after prompt, gives the native engine's tokens.
    for arch in ("llama3", "qwen2"):
        directory = tmp_path / arch
        make_hf_model(directory, arch, seed=3)
        policy = _policy(directory, tmp_path)
        prompts = [[5, 9, 11, 30], [40, 2, 8], [100, 101, 102, 103, 104]]
        kwargs = dict(group_size=1, max_new_tokens=6, pad_id=PAD, stop_tokens=[STOP], temperature=0.0)
        ours = NativeGenerator(temperature=1.0).generate(policy, prompts, **kwargs)
        theirs = TransformersGenerator(model=str(directory)).generate(policy, prompts, **kwargs)
        assert theirs.prompt_ids == ours.prompt_ids
        assert theirs.response_ids == ours.response_ids, arch
        assert theirs.truncated.tolist() == ours.truncated.tolist()


def test_samples_follow_the_policys_distribution_like_the_native_engine(tmp_path):
    # 4,000 first tokens from one prompt: the distance of each engine's frequencies to the policy's exact
    # softmax is that of torch.multinomial's own draws (the sampling noise), within a margin.
    make_hf_model(tmp_path / "m", "llama3", seed=5)
    policy = _policy(tmp_path / "m", tmp_path)
    with torch.no_grad():  # a peaked distribution (random weights give a near-uniform one): sharper logits
        policy.output.weight.mul_(6.0)
    prompt = [5, 9, 11, 30]
    with torch.no_grad():
        probs = torch.softmax(policy(torch.tensor([prompt]))[0, -1].double(), -1)
    assert probs.max() > 0.2  # far from uniform over the 160 ids
    n = 4000

    def tv(tokens):
        freq = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).double() / n
        return 0.5 * (freq - probs).abs().sum().item()

    control = tv(torch.multinomial(probs, n, replacement=True, generator=torch.Generator().manual_seed(1)).tolist())
    kwargs = dict(group_size=n, max_new_tokens=1, pad_id=PAD, stop_tokens=[STOP])
    seen = {}
    for name, engine in (("native", NativeGenerator(temperature=1.0)),
                         ("transformers", TransformersGenerator(model=str(tmp_path / "m")))):
        out = engine.generate(policy, [prompt], generator=torch.Generator().manual_seed(2), **kwargs)
        seen[name] = tv([r[0] for r in out.response_ids])
    assert seen["transformers"] < control + 0.02 and seen["native"] < control + 0.02, (seen, control)
    # A sampler off by a temperature of 1.2 would be caught: its distance is several times the noise.
    hot = torch.softmax(torch.log(probs) / 1.2, -1)
    assert 0.5 * (hot - probs).abs().sum().item() > control + 0.02
    # Seeded: the same generator state gives the same samples; another gives others.
    engine = TransformersGenerator(model=str(tmp_path / "m"))
    runs = [engine.generate(policy, [prompt], generator=torch.Generator().manual_seed(s), group_size=8,
                            max_new_tokens=4, pad_id=PAD, stop_tokens=[STOP]).response_ids for s in (9, 9, 10)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_the_recipe_trains_with_it_on_two_processes(tmp_path):
    # Each rank gathers the FSDP2-sharded weights (a collective) and samples its own prompts.
    directory = make_model_dir(tmp_path / "model", "qwen3")
    engine = {"_component_": "torchtune_grpo.generation.TransformersGenerator", "model": str(directory)}
    config = write_config(tmp_path, max_steps=2, save_every_n_steps=None, generation=engine,
                          **hf_components(directory))
    run_tune(config, nproc=2, cwd=tmp_path)
    metrics = [m for m in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in m]
    assert len(metrics) == 2 and all(m["grad_norm"] > 0 and m["response_length/mean"] > 0 for m in metrics)
