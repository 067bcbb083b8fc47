"""The architectures added through the registry (Mistral with a window, Phi-3, Gemma 3) served by the engine:
greedy tokens equal transformers' generate at batch 1 and as one batch, with prompts prefilled in chunks shorter
than the window and a prefix served from the cache."""

from __future__ import annotations

import pytest
import torch

from outrider import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

CASES = {
    "mistral": {"extra_config": {"sliding_window": 6}},
    "phi3": {"extra_config": {"sliding_window": 7}},
    "gemma3": {"rope_theta": 10000.0, "extra_config": {"final_logit_softcapping": 5.0}},
}
SHARED = list(range(40, 60))  # a prefix longer than every window, shared by two prompts
PROMPTS = [[1, 17, 99, 200, 7], SHARED + [5, 6, 7], [42], SHARED + [8], list(range(100, 131))]
N_NEW = 12


@pytest.mark.parametrize("arch", list(CASES))
def test_engine_generates_what_transformers_generates(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch, **CASES[arch])
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want = []
    for ids in PROMPTS:
        ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False, eos_token_id=None)
        want.append(ref[0, len(ids):].tolist())
    params = SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True)
    batched = LLM(str(path), max_num_seqs=len(PROMPTS), max_num_batched_tokens=5, block_size=4)
    assert [c.token_ids for c in batched.generate(PROMPTS, params)] == want
    alone = LLM(str(path), max_num_seqs=1, block_size=4)
    outs = [alone.generate([ids], params)[0] for ids in PROMPTS]
    assert [c.token_ids for c in outs] == want
    assert outs[3].timing.cache_n >= 16  # (the shared prefix's whole blocks came from the cache)
