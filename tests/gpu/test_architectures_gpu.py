"""The registered architectures on the GPU (CUDA graphs, the Triton attention kernel with sliding windows): greedy
tokens equal the CPU reference in float32, prompts longer than the windows, a batch of mixed lengths, whole and
chunked prefill."""

from __future__ import annotations

import pytest
import torch

from outrider.llm import LLM
from outrider.params import SamplingParams
from outrider.testing.checkpoints import write_tiny_checkpoint

pytestmark = pytest.mark.cuda_only

PROMPTS = [[5, 17, 42, 99, 7], list(range(10, 47)), [300, 301], list(range(100, 300))]
CASES = {
    "mistral-window": ("mistral", {"extra_config": {"sliding_window": 24}}),
    "phi3-longrope-window": ("phi3", {"extra_config": {
        "sliding_window": 40, "original_max_position_embeddings": 64,
        "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(16)],
                         "long_factor": [1.0 + 2.0 * i for i in range(16)]}}}),
    "gemma3": ("gemma3", {"rope_theta": 10000.0, "extra_config": {"sliding_window": 16, "query_pre_attn_scalar": 32,
                                                                  "final_logit_softcapping": 10.0}}),
}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    arch, kwargs = CASES[request.param]
    return write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch, hidden_size=128, layers=4, heads=4,
                                 kv_heads=2, head_dim=32, dtype=torch.float32, **kwargs)


def _greedy(path, **kw) -> list[list[int]]:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    return [c.token_ids for c in LLM(str(path), block_size=16, **kw).generate(PROMPTS, params)]


def test_greedy_gpu_equals_cpu_reference(checkpoint):
    want = _greedy(checkpoint, device="cpu", dtype="float32")
    assert _greedy(checkpoint, device="cuda", dtype="float32") == want
    # Prompts prefilled in chunks of up to 48 tokens beside other requests' decodes (eager steps).
    assert _greedy(checkpoint, device="cuda", dtype="float32", max_num_batched_tokens=48) == want
