"""On the device's default path (CUDA graphs, overlap scheduling), constrained and penalised decode steps overlap:
their sampling, masks and penalty windows included, is enqueued without the host waiting for the device (it runs
while the GPU computes the step's forward), and the output equals the synchronous path's in float32."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from outrider import LLM, SamplingParams
from outrider.testing import write_tiny_checkpoint

SCHEMA = {"type": "object", "properties": {"k": {"enum": ["ab", "cd"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["k", "n"]}
PROMPTS = [[7 + i, 11, 13, 17 + i, 19] for i in range(6)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("structured_gpu"), "qwen3", hidden_size=64, layers=2,
                                 seed=3)


def params(llm: LLM) -> list[SamplingParams]:
    """JSON schema (greedy, and sampled with a penalty), GBNF, a penalised request and a free one."""
    schema = llm.engine.grammars.json_schema(SCHEMA)
    gbnf = llm.engine.grammars.gbnf('root ::= ("yes" | "no") ", " [a-z]{2,6} "."')
    return [SamplingParams(max_tokens=40, temperature=0.0, grammar=schema),
            SamplingParams(max_tokens=40, temperature=0.9, seed=2, grammar=schema, presence_penalty=0.5),
            SamplingParams(max_tokens=40, temperature=0.0, grammar=gbnf),
            SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repeat_penalty=1.3),
            SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=40, temperature=0.9, seed=5, grammar=gbnf)]


@pytest.mark.cuda_only
def test_constrained_steps_overlap_and_equal_the_synchronous_output(ckpt):
    llm = LLM(ckpt, device="cuda", dtype="float32", max_num_seqs=8)
    sync = LLM(ckpt, device="cuda", dtype="float32", max_num_seqs=8, overlap_schedule=False)
    assert llm.engine.overlap and llm.engine.runner.graphs  # the default path
    got = llm.generate(PROMPTS, params(llm))
    assert [c.token_ids for c in got] == [c.token_ids for c in sync.generate(PROMPTS, params(sync))]
    jsonschema.validate(json.loads(got[0].text), SCHEMA)


@pytest.mark.cuda_only
def test_constrained_sampling_never_waits_for_the_device(ckpt):
    """A constrained step's sampling is enqueued while its forward runs: a synchronising call there (a blocking
    copy, a read of a device value) would make the host wait out the forward, every step."""
    llm = LLM(ckpt, device="cuda", max_num_seqs=8)
    llm.generate(PROMPTS, params(llm))  # (first calls of the mask and penalty paths, unchecked)
    runner = llm.engine.runner
    sample, reads_history = runner.sample, []

    def strict_sample(step, *args, **kwargs):
        reads_history.append(step.reads_history)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return sample(step, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    runner.sample = strict_sample
    got = llm.generate(PROMPTS, params(llm))
    assert any(reads_history) and all(c.finish_reason is not None for c in got)
