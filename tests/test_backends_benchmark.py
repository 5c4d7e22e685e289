"""benchmarks/backends_smollm2.py's cheap path (``--tiny``): a tiny random Llama through both policy backends.

The benchmark itself runs SmolLM2-135M (docs/benchmarks/backends.md); here its logprob and two-step comparisons
run on a tiny Llama directory, so that what it reports (and the two backends' agreement) is checked in CI.
"""

import torch

from tests.conftest import load_benchmark
from tests.tolerances import ulps


def test_backends_benchmark_tiny_path_agrees_across_backends(tmp_path):
    # benchmarks/backends_smollm2.py --tiny: its logprob and two-step comparisons on a tiny random Llama (2 layers,
    # 64 wide, query/key projections x8: a query's largest attention weight averages 0.35 where uniform would be
    # ~0.05), torchtune's decoder against transformers' LlamaForCausalLM built from the same directory.
    backends = load_benchmark("backends_smollm2")
    threads = torch.get_num_threads()
    try:
        result = backends.main(["--tiny", "--parts", "logprobs", "steps", "--work-dir", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    lp = result["logprobs"]
    assert lp["rows"] == 5 and lp["tokens_compared"] == 14 + 3 + 20 + 1 + 11  # every response token of the rows
    # The same weights through two implementations of the same math (RoPE tables, q/k layout, GQA, SDPA, RMSNorm
    # written twice; the chunked head shared): each of a layer's ~8 operations rounds per element, in sums of at
    # most 128 terms blocked differently (~sqrt(128) = 11 ulp typically), over 2 layers, into logprobs z - lse
    # with |z|, |lse| of the size of the largest |logprob|. Bound: 64 ulp of the largest |logprob| (~5e-5).
    bound = ulps(torch.tensor(lp["logprob_range"]), 64)
    assert lp["logprob_max_abs_diff"] <= bound and lp["entropy_max_abs_diff"] <= bound
    # Each fp32 backend against transformers in float64: its own rounding, the same bound.
    assert lp["torchtune_vs_float64_max_abs_diff"] <= bound and lp["transformers_vs_float64_max_abs_diff"] <= bound

    same_layout, default = result["steps"]
    assert same_layout["shared_prompt_layout"] == {"torchtune": False, "transformers": False}
    # By default both backends share each prompt across its group's rows (transformers' module through explicit
    # attention masks, models/_transformers_layouts.py).
    assert default["shared_prompt_layout"] == {"torchtune": True, "transformers": True}
    for run in (same_layout, default):
        first_tt, first_tr = run["torchtune"][0], run["transformers"][0]
        # Step 1 (the initial weights): the entropy is a token mean of per-token entropies (bound as above); the
        # gradient norm a sum over 2 layers' parameters of gradients each within a few ulp: 64 ulp of it.
        assert abs(first_tt["entropy"] - first_tr["entropy"]) <= ulps(torch.tensor(first_tt["entropy"]), 64)
        assert abs(first_tt["grad_norm"] - first_tr["grad_norm"]) <= ulps(torch.tensor(first_tt["grad_norm"]), 64)
        # Step 2 runs on the weights after one AdamW step (lr 1e-3). Adam's first step is lr x g / (|g| + eps): equal
        # gradients give equal moves, but one element whose gradient is within rounding of 0 could move by up to
        # 2 lr differently, and through 64-wide products of activations of order 1 shift logprobs by ~1e-3. The
        # trained policies' logprobs agreeing to 1e-4 says no element's move differed by more than a tenth of that.
        assert run["trained_logprob_max_abs_diff"] <= 1e-4
        # The step-2 loss is the policy term (ratio 1: minus the token mean of the advantages, the same rows on
        # both) plus 0.04 x the token mean of k3(d) ~ d^2 / 2, d = log pi_ref - log pi with |d| <~ 1 here: it moves
        # by <= 0.04 x |d| x |delta d| <= 0.04 x 1 x (1e-4 + 5e-5) = 6e-6 < 1e-5, the bound on losses.
        assert run["loss_max_abs_diff"] <= 1e-5
    # The second step really trained: the KL to the reference grew.
    assert same_layout["torchtune"][1]["kl"] > same_layout["torchtune"][0]["kl"]
