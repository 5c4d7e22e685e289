"""The GPU test set (marker ``gpu``): the CUDA paths that the CPU suite can only reason about.

Each test runs on the ``gpu_device`` fixture's device (tests/conftest.py): CUDA where it is available (or
with ``--device cuda``), the CPU with ``--device cpu``, which is how scripts/gpu_check.sh rehearses them
(tests/test_gpu_check.py runs that rehearsal in the CPU suite). Without CUDA and without ``--device`` the
CPU suite deselects them: they are never reported as passed where they did not run on their device.

Every figure a test measures is recorded with ``record_property`` (pytest's JUnit XML report carries it, and
scripts/gpu_report.py puts it in the GPU check's report). The shapes are tiny: what is checked is that the
CUDA code paths compute what the CPU ones do (bf16 with fp32 master weights, compiled decode with CUDA
graphs, FSDP2 over NCCL, NF4 on the device, the allocator's view of the chunked logprobs, the checkpoint
written from the device), not speed; benchmarks/gpu_grpo.py measures speed.
"""

import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import make_tiny_decoder, REPO
from tests.tolerances import logit_ulps, ulps
from tests.hf_models import hf_components, make_model_dir
from tests.recipe_utils import read_jsonl, weights, write_config

pytestmark = pytest.mark.gpu

LORA_CONFIG = REPO / "configs" / "tiny" / "lora_grpo_cpu.yaml"
# Scripted rollouts (a fixed function of the prompt) and a reward on token ids: runs that differ only in
# precision or sharding see the same data.
SCRIPTED = {
    "generation": {"_component_": "tests._engines.ScriptedGenerator"},
    "reward_functions": [{"_component_": "tests._rewards.EvenTokenReward"}],
}
# Runs whose point is not the decode step sample eagerly: on CUDA the default compiles it (tens of seconds per
# run). The compiled decode has its own test, and the checkpoint test runs the recipe with the default.
EAGER = {"generation.compile_decode": False}


def _dense(t: torch.Tensor) -> torch.Tensor:
    """A parameter or state-dict value as a plain fp32 CPU tensor (gathered if sharded, dequantized if NF4)."""
    t = t.detach()
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    if hasattr(t, "get_original_weight"):
        t = t.get_original_weight()
    return t.float().cpu().clone()


def _run_recipe(tmp_path: Path, device: torch.device, steps: int, *, lora: bool = False, base: Path = None,
                **overrides) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor], List[dict], object]:
    """The recipe in this process (setup, train, cleanup) on ``device``; returns (weights before, weights
    after, metrics rows, the recipe after cleanup)."""
    if lora:
        from grpo_lora_finetune_distributed import GRPOLoRAFinetuneRecipeDistributed as Recipe
    else:
        from grpo_full_finetune_distributed import GRPOFullFinetuneRecipeDistributed as Recipe

    tmp_path.mkdir(parents=True)
    kwargs = {"base": base} if base else {}
    path = write_config(tmp_path, device=device.type, max_steps=steps, **kwargs, **overrides)
    cfg = OmegaConf.load(path)
    recipe = Recipe(cfg)
    recipe.setup(cfg)
    try:
        before = {k: _dense(v) for k, v in recipe.model.state_dict().items()}
        recipe.train()
        after = {k: _dense(v) for k, v in recipe.model.state_dict().items()}
    finally:
        recipe.cleanup()
    rows = [r for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    return before, after, rows, recipe


def test_bf16_with_fp32_master_weights_moves_at_lr_1e6_and_tracks_fp32(
    gpu_device, tmp_path, clean_env, one_thread, record_property
):
    # dtype bf16 = fp32 master weights and AdamW state, transformer layers computed in bf16 through FSDP2's
    # mixed precision (runtime/precision.py). (1) One AdamW step at lr 1e-6 moves each weight by ~1e-6; the tiny
    # model's weights are ~0.02, where a bf16 weight's spacing is ~1.2e-4, so only fp32 master weights keep
    # the update: nearly every element must change. (2) Over 3 steps at lr 1e-3 on the same scripted
    # rollouts, the bf16-compute run's losses, entropies, KL and weight updates track the fp32 run's.
    before, after, _, _ = _run_recipe(tmp_path / "lr1e-6", gpu_device, 1, dtype="bf16", lr_scheduler=None,
                                      save_every_n_steps=None, **{"optimizer.lr": 1e-6}, **EAGER)
    moved = {k: (after[k] != before[k]).float().mean().item() for k in before}
    record_property("lr1e-6_min_fraction_of_weights_moved", min(moved.values()))
    assert min(moved.values()) > 0.95, sorted(moved.items(), key=lambda kv: kv[1])[:3]

    common = dict(kl_coef=0.05, save_every_n_steps=None, **SCRIPTED)
    b32, a32, m32, _ = _run_recipe(tmp_path / "fp32", gpu_device, 3, dtype="fp32", **common)
    b16, a16, m16, _ = _run_recipe(tmp_path / "bf16", gpu_device, 3, dtype="bf16", **common)
    assert [r["step"] for r in m16] == [1, 2, 3]
    rel_loss = max(abs(y["policy_loss"] - x["policy_loss"]) / (abs(x["policy_loss"]) + 1e-3) for x, y in zip(m32, m16))
    rel_entropy = max(abs(y["entropy"] - x["entropy"]) / x["entropy"] for x, y in zip(m32, m16))
    record_property("bf16_vs_fp32_max_rel_policy_loss", rel_loss)
    record_property("bf16_vs_fp32_max_rel_entropy", rel_entropy)
    # bf16 against fp32 is a precision difference, not an order one: bf16 keeps 8 significant bits (unit roundoff
    # 2^-9 = 2e-3 per operation), ~1e-2 absolute on logprobs of a few units after the layers' matmuls. The loss and
    # entropy are means over the step's tokens, where those errors (of random sign) average down by sqrt(tokens);
    # the KL is a difference of policy and reference log-ratios, small after 3 steps at lr 1e-3, so the same
    # absolute bf16 error is a larger share of it: 10% relative. Bounds: 5% (policy loss, +1e-3 for values near
    # 0), 2% (entropy), 10% (KL); they concern bf16 arithmetic (CUDA, or oneDNN's on the CPU rehearsal), not the
    # fp32 kernel choice. Measured on an H200: policy loss 0, entropy 1.7e-6 relative.
    assert rel_loss <= 0.05 and rel_entropy <= 0.02, (m32, m16)
    assert m32[-1]["kl"] > 0 and m16[-1]["kl"] == pytest.approx(m32[-1]["kl"], rel=0.1)
    # k_proj's bias shifts every score of a query equally (softmax ignores it): its gradient is noise.
    cos = {
        k: torch.nn.functional.cosine_similarity((a32[k] - b32[k]).flatten(), (a16[k] - b16[k]).flatten(), dim=0).item()
        for k in b32 if not k.endswith("k_proj.bias")
    }
    record_property("bf16_vs_fp32_min_update_cosine", min(cos.values()))
    assert min(cos.values()) > 0.9, min((v, k) for k, v in cos.items())


def _record_decode_logprobs(monkeypatch) -> List[torch.Tensor]:
    """Make the native engine record each decode step's ``[N, V]`` log-softmax (fp32) as it samples."""
    import torchtune_grpo.generation._native as native

    steps: List[torch.Tensor] = []
    sample = native.sample_tokens

    def recording(logits, **kwargs):
        # A copy now: a CUDA-graph replay writes the next step's logits into the same buffer.
        steps.append(logits.detach().float().log_softmax(-1).cpu())
        return sample(logits, **kwargs)

    monkeypatch.setattr(native, "sample_tokens", recording)
    return steps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_decode_equals_eager_tokens_and_logprobs(gpu_device, dtype, monkeypatch, record_property):
    # The decode step compiled as the recipe compiles it (CUDA: inductor with CUDA graphs,
    # mode="reduce-overhead"; CPU rehearsal: the same tracing with the aot_eager backend) gives eager's greedy
    # tokens and log-probabilities, and both give what a plain forward of the whole sequence gives (the
    # training path), so the KV-cached decode is right on the device.
    from torchtune_grpo.generation import NativeGenerator

    torch._dynamo.reset()
    model = make_tiny_decoder().to(device=gpu_device, dtype=dtype)
    prompts = torch.randint(1, 96, (3, 12), generator=torch.Generator().manual_seed(0)).tolist()
    kw = dict(group_size=2, max_new_tokens=24, pad_id=0, stop_tokens=[97])  # 97: outside the vocabulary
    backend = "inductor" if gpu_device.type == "cuda" else "aot_eager"
    runs = {}
    for name, engine in (("eager", NativeGenerator(temperature=0.0, compile_decode=False)),
                         ("compiled", NativeGenerator(temperature=0.0, compile_decode=True, compile_backend=backend))):
        steps = _record_decode_logprobs(monkeypatch)
        engine.generate(model, prompts, **kw)  # the first call compiles (and captures the CUDA graph)
        steps.clear()
        out = engine.generate(model, prompts, **kw)
        chosen = torch.tensor(out.response_ids)  # [N, 24]: no stop token, every row is full
        lp = torch.stack([s.gather(1, chosen[:, t : t + 1]).squeeze(1) for t, s in enumerate(steps)], dim=1)
        runs[name] = (chosen, lp)
    assert torch.equal(runs["compiled"][0], runs["eager"][0])
    diff = (runs["compiled"][1] - runs["eager"][1]).abs().max().item()
    # Training path: one forward of prompt + response; the logprob of response token t is at position 11 + t.
    seqs = torch.tensor([p for p in prompts for _ in range(2)])
    full = torch.cat([seqs, runs["eager"][0]], dim=1).to(gpu_device)
    with torch.no_grad():
        raw = model(full).float()
        logits = raw.log_softmax(-1).cpu()
    forward = logits[:, 11:-1].gather(2, runs["eager"][0].unsqueeze(-1)).squeeze(-1)
    diff_forward = (runs["eager"][1] - forward).abs().max().item()
    name = "fp32" if dtype == torch.float32 else "bf16"
    record_property(f"{name}_compiled_vs_eager_max_logprob_diff", diff)
    record_property(f"{name}_decode_vs_forward_max_logprob_diff", diff_forward)
    # fp32: compiled against eager decode, and the KV-cached decode against one forward of the whole sequence,
    # run other kernels and shapes: a logprob (a logit minus a logsumexp) is then a few ulp of the logits apart
    # (x4 weights: |z| up to ~150, 1 ulp = 1.5e-5), ~4-5 ulp typically, above the former 1e-4 (6.7 ulp) as a
    # worst case. Bound: 16 ulp of the largest logit (measured: 1.7e-5 on an H200, 1.6e-5 on the CPU).
    # bf16: not derived. The logits themselves round to 8 significant bits (1 ulp = 0.5-1 at |z| ~ 64-150), so
    # two kernels' logits can differ by ~1; the greedy token's logprob moves by (1 - p_greedy) x the change of
    # the logit gaps, which these peaked distributions keep small: 0.1 (measured: 0.097 on an H200, 0 on the CPU).
    tol = ulps(raw, 16) if dtype == torch.float32 else 0.1
    assert diff <= tol and diff_forward <= tol, (diff, diff_forward)
    torch._dynamo.reset()


def test_fsdp2_on_one_device_matches_the_plain_model(gpu_device, tmp_path, clean_env, one_thread, record_property):
    # FSDP2 on a one-process group (NCCL on CUDA, gloo on CPU: fsdp_single_process: true) trains like the
    # plain module (the one-process default): same losses and, after 2 steps, the same weights (fp32).
    common = dict(dtype="fp32", save_every_n_steps=None, kl_coef=0.05, **SCRIPTED)
    b0, plain, m_plain, _ = _run_recipe(tmp_path / "plain", gpu_device, 2, fsdp_single_process=False, **common)
    b1, sharded, m_fsdp, _ = _run_recipe(tmp_path / "fsdp", gpu_device, 2, fsdp_single_process=True, **common)
    assert b0.keys() == b1.keys() and all(torch.equal(b0[k], b1[k]) for k in b0)
    for x, y in zip(m_plain, m_fsdp):
        # Step 1's weights are equal (checked above), so its loss is the same computation; step 2's follows weights
        # that differ by the rounding of one update (FSDP2's sharded AdamW step and its gradient reduction in another
        # order: a few ulp of the weights, 1.25e-6 measured on an H200), which moves a loss of O(0.1-1) by far less than
        # 1e-4 relative. Bound: 1e-4 relative, 1e-6 absolute for a loss near 0.
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4, abs=1e-6), (x, y)
    diff = max((sharded[k] - plain[k]).abs().max().item() for k in plain)
    moved = max((plain[k] - b0[k]).abs().max().item() for k in plain)
    record_property("fsdp2_vs_plain_max_weight_diff", diff)
    # Two AdamW steps (lr 1e-3) on gradients reduced in another order: the step lr m / (sqrt(v) + eps) is nearly
    # insensitive to a gradient's relative rounding d (it changes by lr d eps / (|g| + eps)), largest where |g| is near
    # eps; plus one rounding of each weight (|w| <~ 1: 6e-8). Bound: 1e-5 (measured 1.25e-6 on an H200).
    assert moved > 1e-4 and diff <= 1e-5, (moved, diff)


@pytest.mark.parametrize("quantize_base", [False, True], ids=["lora", "qlora"])
def test_lora_and_qlora_steps(gpu_device, quantize_base, tmp_path, clean_env, one_thread, record_property):
    # The LoRA recipe (bf16, 2 steps) on the device: only the adapters train (every B starts at zero and
    # moves), the base weights stay as loaded, and with QLoRA they are NF4 tensors on the device.
    from torchao.dtypes.nf4tensor import NF4Tensor

    before, after, rows, recipe = _run_recipe(
        tmp_path / "run", gpu_device, 2, lora=True, base=LORA_CONFIG, dtype="bf16", lr_scheduler=None,
        save_every_n_steps=None, **{"model.quantize_base": quantize_base}, **EAGER,
    )
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows)
    adapters = {k for k in before if "lora_a" in k or "lora_b" in k}
    assert adapters and all(after[k].abs().max() > 0 for k in adapters if "lora_b" in k)
    assert all(torch.equal(after[k], before[k]) for k in before if k not in adapters)
    nf4 = [p for p in recipe.model.parameters() if isinstance(p, NF4Tensor)]
    assert bool(nf4) == quantize_base and all(p.device.type == gpu_device.type for p in nf4)
    record_property(f"{'qlora' if quantize_base else 'lora'}_step2_loss", rows[-1]["loss"])


def test_chunked_logprobs_peak_memory_is_two_chunk_buffers(gpu_device, record_property):
    # docs/benchmarks/memory.md ("Logprob + loss memory"): beyond the weight and hidden-state gradients, the fused chunked
    # logprob + loss path holds about two [chunk, V] fp32 buffers, whatever the number of tokens T. CUDA:
    # Qwen3's output layer (hidden 1024, V 151,936), chunk 512, the allocator's peak; CPU: a smaller layer
    # (V 32,768, chunk 256: 32 MiB per buffer, above the noise of the process's peak RSS).
    if gpu_device.type == "cuda":
        tokens, chunk, hidden, vocab = "2048,8192", 512, 1024, 151936
    else:
        tokens, chunk, hidden, vocab = "512,1024", 256, 64, 32768
    # A process of its own (its peak RSS is the measure on CPU): this python, or in the rehearsal with --fork-stages
    # a child of scripts/gpu_check.sh's fork server (GPU_CHECK_PYTHON), which imported the check's packages and did
    # nothing else. Either way the peak is reset to the process's RSS just before the forward, and the 32 MiB
    # [chunk, V] buffers are new mappings (above glibc's largest mmap threshold), so what was resident before
    # does not count.
    python = shlex.split(os.environ.get("GPU_CHECK_PYTHON", "")) or [sys.executable]
    cmd = [*python, str(REPO / "benchmarks" / "logprob_memory.py"), "_child", tokens, str(chunk),
           str(hidden), str(vocab), "1", "1", gpu_device.type]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300).stdout
    first, second = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    buffer = chunk * vocab * 4
    for r in (first, second):
        record_property(f"logprob_working_MiB_T{r['tokens']}", r["working_bytes"] / 2**20)
    record_property("logprob_chunk_buffer_MiB", buffer / 2**20)
    assert 1.5 * buffer <= first["working_bytes"] <= 2.5 * buffer, (first, buffer)
    assert 1.5 * buffer <= second["working_bytes"] <= first["working_bytes"] + 0.25 * buffer, (first, second)


def test_recipe_checkpoint_loads_in_transformers_with_equal_logits(gpu_device, tmp_path, clean_env, one_thread,
                                                                   record_property):
    # A tiny random Qwen3 directory through the one-line model config (HFCheckpointer + hf_model), trained 2
    # steps in bf16 on the device and saved: transformers loads the step directory, and its logits equal our
    # model's on the same weights (fp32: 1e-4; bf16 on the device: both within bf16 rounding of the fp32 ones).
    # The recipe's own generation settings: on CUDA the decode step is compiled, as in a real run.
    from transformers import AutoModelForCausalLM

    from torchtune_grpo.models import HFCheckpointer, hf_model

    src = make_model_dir(tmp_path / "Qwen3-tiny")
    _run_recipe(tmp_path / "run", gpu_device, 2, dtype="bf16", save_every_n_steps=2, lr_scheduler=None,
                **{"optimizer.lr": 1e-3}, **hf_components(src))
    step = tmp_path / "run" / "out" / "step_2"
    start, end = weights(src), weights(step)
    assert max((end[k] - start[k]).abs().max().item() for k in start) > 1e-4

    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0)).to(gpu_device)
    ours = hf_model(str(step))
    ours.load_state_dict(HFCheckpointer(str(step), str(tmp_path / "scratch")).load_checkpoint()["model"])
    logits = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        theirs = AutoModelForCausalLM.from_pretrained(step, dtype=dtype).to(gpu_device).eval()
        with torch.no_grad():
            logits[f"hf_{name}"] = theirs(tokens).logits.float().cpu()
            logits[f"ours_{name}"] = ours.to(device=gpu_device, dtype=dtype).eval()(tokens).float().cpu()
    ref = logits["hf_fp32"]
    fp32_diff = (logits["ours_fp32"] - ref).abs().max().item()
    bf16_tol = 0.05 * ref.abs().max().item()
    diffs = {k: (logits[k] - ref).abs().max().item() for k in ("ours_bf16", "hf_bf16")}
    diffs["ours_vs_hf_bf16"] = (logits["ours_bf16"] - logits["hf_bf16"]).abs().max().item()
    record_property("checkpoint_fp32_max_logit_diff", fp32_diff)
    for k, v in diffs.items():
        record_property(f"checkpoint_{k}_max_logit_diff", v)
    record_property("checkpoint_bf16_tolerance", bf16_tol)
    # fp32: transformers against torchtune on the device, as tests/test_models.py (other op orders, each library's RoPE
    # tables; logits |z| <~ 4): 1e-4 (measured 2.2e-6 on an H200). bf16: 8 significant bits, 2^-9 relative per
    # operation, through 2 layers and the head: a few bf16 ulp (2^-7 = 0.8%) of the largest logit. Bound: 5% of the
    # largest fp32 logit (measured: 0.047, 28% of it, on an H200).
    assert fp32_diff <= 1e-4, fp32_diff
    assert max(diffs.values()) <= bf16_tol, (diffs, bf16_tol)


def test_a_generation_worker_on_the_device_samples_what_the_trainer_does(
    gpu_device, tmp_path, clean_env, one_thread, record_property
):
    # generation_workers.device: the worker's model, forward and sampling generator on the device (fp32, the
    # native engine eager). At max_staleness 0 the worker samples with the trainer's weights of the same
    # version, so the step's metrics follow the synchronous run's and its behaviour logprobs the trainer's.
    common = dict(dtype="fp32", save_every_n_steps=None, **EAGER)
    _, sync_w, sync, _ = _run_recipe(tmp_path / "sync", gpu_device, 2, **common)
    _, worker_w, worker, _ = _run_recipe(
        tmp_path / "worker", gpu_device, 2, generation_workers={"enabled": True, "max_staleness": 0,
                                                                "device": gpu_device.type}, **common,
    )
    mismatch = max(m["generation/logprob_mismatch"] for m in worker)
    diff = max((worker_w[k] - sync_w[k]).abs().max().item() for k in sync_w)
    record_property("worker_vs_trainer_max_logprob_mismatch", mismatch)
    record_property("worker_vs_sync_max_weight_diff", diff)
    # The worker's behaviour logprobs and the trainer's come from the same weights, device and dtype in other batch
    # shapes: a few ulp of the tiny model's logits (|z| <~ 2, 1 ulp 2.4e-7). Bound: 1e-4 (measured 0 on an H200); the
    # weights after 2 steps: the same computation, 1e-5 (measured 0).
    assert [m["staleness/max"] for m in worker] == [0, 0] and mismatch <= 1e-4, mismatch
    for x, y in zip(sync, worker):  # the same tokens: kernels of one device and dtype on both sides
        # Same tokens and weights on both sides; the loss differs only by the worker's behaviour logprobs entering
        # as the old logprobs (mismatch <= 1e-4 above, computed on the same device and dtype in another batch shape):
        # a ratio exp(delta) = 1 + delta with delta ~ 1e-5, 1e-4 relative at most. Bound: 1e-4 relative, 1e-6 absolute.
        assert y["reward/mean"] == x["reward/mean"] and y["loss"] == pytest.approx(x["loss"], rel=1e-4, abs=1e-6)
    assert diff <= 1e-5, diff


def test_multi_turn_sessions_compact_on_the_device(gpu_device, record_property):
    # Eager decoding on the device: rows whose turn stopped leave every turn's batch (caches written back to
    # the session's) and the episodes equal the full-batch session's, greedy, in both cache layouts.
    from tests.test_multiturn_continuation import decode_batches_per_turn, episodes, forward_batches
    from torchtune_grpo.generation import NativeGenerator

    model = make_tiny_decoder(scale=8.0).to(gpu_device)
    for share_prefill in (True, False):
        kw = dict(temperature=0.0, share_prefill=share_prefill, stop_check_interval=1, compile_decode=False)
        shapes = forward_batches(model)
        got = episodes(NativeGenerator(**kw), model, group_size=3)
        turns = decode_batches_per_turn(shapes)
        full = episodes(NativeGenerator(compact_decode=False, **kw), model, group_size=3)
        assert got.response_ids == full.response_ids and got.turns == full.turns
        assert len(turns) >= 2 and any(len(set(steps)) > 1 for steps in turns), turns
    record_property("session_decode_row_steps", sum(map(sum, turns)))


def test_packed_rows_flex_attention_equals_the_dense_mask(gpu_device, record_property):
    # packed_attention: flex (FlexAttention block masks, compiled, on CUDA) against the dense block-diagonal
    # mask's SDPA: the same logprobs, entropies and gradients (fp32) on long-tailed packed rows. On the CPU
    # (the rehearsal) both run the dense mask: there it checks the plumbing only.
    from tests.test_packed_rows import _long_tailed
    from tests.test_shared_prompt import _logprobs_and_grads
    from torchtune_grpo.training.batch import TrainingBatch

    model = make_tiny_decoder(scale=1.0).to(gpu_device).train()
    prompts, responses = _long_tailed(0, 97)
    mbs = [slice(0, 6), slice(6, len(prompts))]
    runs = {}
    for backend in ("sdpa", "flex"):
        batch = TrainingBatch(prompts, responses, 0, share_prompt=False, pack=True, device=gpu_device,
                              packed_attention=backend)
        runs[backend] = _logprobs_and_grads(model, batch, mbs)
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = runs["sdpa"], runs["flex"]
    lp_diff = (lp_b - lp_a).abs().max().item()
    grad_diff = max((g_b[k] - g_a[k]).abs().max().item() for k in g_a)
    record_property("flex_vs_sdpa_max_logprob_diff", lp_diff)
    record_property("flex_vs_sdpa_max_grad_diff", grad_diff)
    # Flex attention (compiled, blockwise online softmax) and the dense mask's SDPA sum the same attention terms in
    # another order, as packed against padded rows do (tests/test_packed_rows.py, whose bounds these are): a
    # logprob or entropy is a few ulp of the logits apart (|z| / 0.7 up to ~100 here, 1 ulp = 1.2e-5), a
    # gradient ~sqrt(n) ulp of its partial sums over the batch's ~200 positions. Bounds: 16 ulp of the largest
    # logit / 0.7 (the former 1e-4 + 1e-5 relative allowed 8 ulp for a logprob near 0), and 32 ulp of each
    # gradient tensor's largest element (the former 1e-4 absolute was 5 ulp of the largest, ~170). On the CPU
    # both run the dense mask (0 measured); not yet measured on a GPU with these bounds.
    atol = logit_ulps(model, [p + r for p, r in zip(prompts, responses)], 16) / 0.7
    torch.testing.assert_close(lp_b, lp_a, atol=atol, rtol=0)
    torch.testing.assert_close(ent_b, ent_a, atol=atol, rtol=0)
    for k in g_a:
        torch.testing.assert_close(g_b[k], g_a[k], atol=ulps(g_a[k], 32), rtol=0, msg=lambda m: f"{k}: {m}")


def test_bf16_head_accumulates_in_fp32_on_the_device(gpu_device, record_property):
    # logprob_head: bf16 on the device against float64 of the same bf16-rounded inputs, with the bounds of
    # tests/test_update_switches.py (80 ulp of the largest sum |h w| for logprobs and entropies; 2^-8 |dz| |W|
    # per gradient element). On CUDA it must run torch's fp32-output bf16 kernels (a bf16-output product would
    # round the logits to 8 bits and miss the bounds); on the CPU, the upcast products.
    from tests.test_update_switches import bf16_head_against_float64

    out = bf16_head_against_float64(gpu_device)
    for key in ("logprob", "entropy", "grad_h", "grad_w"):
        record_property(f"bf16_head_{key}_error_over_bound", out[key])
    record_property("bf16_head_kernel", out["kernel"])
    assert out["kernel"] == ("out_dtype" if gpu_device.type == "cuda" else "upcast"), out
    assert max(out[k] for k in ("logprob", "entropy", "grad_h", "grad_w")) <= 1, out


def test_offloaded_nf4_reference_streams_its_layers_and_computes_the_same(gpu_device, record_property):
    # reference: {precision: nf4, offload: true}: the layers in (pinned) CPU memory, each copied to the device on a
    # side stream just before it runs. The same bytes reach the same kernels, so the logits equal the resident NF4
    # reference's bit for bit; on CUDA it holds less device memory (the layers are not there between forwards).
    from torchtune.models.qwen2 import qwen2

    from torchtune_grpo.runtime.model_setup import Placement
    from torchtune_grpo.runtime.precision import Precision
    from torchtune_grpo.runtime.reference_setup import build_reference, ReferenceOptions

    shape = dict(vocab_size=96, num_layers=4, num_heads=4, num_kv_heads=4, embed_dim=256, intermediate_dim=512,
                 max_seq_len=64, tie_word_embeddings=True)  # NF4-sized (multiples of 64 x 256)
    torch.manual_seed(0)
    model = qwen2(**shape)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)  # peaked attention
    state, cfg = model.state_dict(), OmegaConf.create({"_component_": "torchtune.models.qwen2.qwen2", **shape})
    placement = Placement(gpu_device, 1, Precision.from_name("fp32"))
    cuda = gpu_device.type == "cuda"

    def held(options):
        before = torch.cuda.memory_allocated(gpu_device) if cuda else 0
        ref = build_reference(cfg, state, placement, options, source="test", max_len=32)
        return ref, (torch.cuda.memory_allocated(gpu_device) - before if cuda else None)

    resident, resident_bytes = held(ReferenceOptions("nf4"))
    offloaded, offloaded_bytes = held(ReferenceOptions("nf4", offload=True))
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1)).to(gpu_device)
    with torch.no_grad():
        expected, out = resident(tokens), offloaded(tokens)
    assert torch.equal(out, expected)
    assert offloaded.offloaded_layers.copies == shape["num_layers"]
    assert all(p.device.type == "cpu" for p in offloaded.layers.parameters())  # back on the host after the forward
    if cuda:
        assert offloaded_bytes < resident_bytes
        record_property("nf4_resident_device_MiB", resident_bytes / 2**20)
        record_property("nf4_offloaded_device_MiB", offloaded_bytes / 2**20)
