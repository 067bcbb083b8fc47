"""Hybrid models (Qwen3-Next, Qwen3.5 dense and MoE) served by the engine on the GPU in its default configuration
(CUDA graphs over static state slots, overlap scheduling, fla prefill, step kernels for decode and verify): greedy
tokens equal the CPU engine's, eager or captured, cold or through prefix hits; and with a drafter loaded (host
rounds at batch 8, device rounds at batch 1; a draft model, DFlash, the target's MTP head), speculation keeps them."""

from __future__ import annotations

import pytest

from outrider.llm import LLM
from outrider.params import SamplingParams
from outrider.testing.checkpoints import write_tiny_checkpoint
from tests.spec_helpers import write_hybrid_family

pytestmark = pytest.mark.cuda_only

PROMPTS = [[1, 17, 99, 200, 7], [1] + list(range(30, 70)), [42], [1, 300, 301, 302, 5, 6, 7, 8, 9, 10, 11],
           list(range(100, 123)), [9] * 19, [5, 9, 13, 200, 17], list(range(60, 100))]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def tokens(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [c.token_ids for c in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_hybrid_engine_with_graphs_and_overlap_equals_the_cpu(tmp_path, arch):
    path = write_tiny_checkpoint(tmp_path, arch, hidden_size=128, layers=4)
    cpu = tokens(LLM(str(path), device="cpu", dtype="float32", block_size=16, max_num_seqs=8))
    gpu = LLM(str(path), device="cuda", dtype="float32", block_size=16, max_num_seqs=8)
    assert gpu.engine.runner.graphs and gpu.engine.overlap
    assert tokens(gpu) == cpu
    assert tokens(gpu) == cpu  # again: prefix hits from state snapshots
    assert gpu.engine.pool.hits > 0
    eager = LLM(str(path), device="cuda", dtype="float32", block_size=16, max_num_seqs=8, enforce_eager=True)
    assert tokens(eager) == cpu


@pytest.mark.parametrize("kind", ["draft", "dflash", "mtp"])
@pytest.mark.parametrize("batch", [1, 8])
def test_speculation_on_a_hybrid_target_on_the_gpu_equals_plain_cpu_decoding(tmp_path, kind, batch):
    family = write_hybrid_family(tmp_path, "qwen3_5")
    prompts = PROMPTS[:batch]
    cpu = tokens(LLM(str(family["target"]), device="cpu", dtype="float32", spec_type="none", max_num_seqs=8),
                 prompts)
    kw = dict(device="cuda", dtype="float32", max_num_seqs=8, spec_draft_n_max=3)
    gpu = LLM(str(family["mtp"]), **kw) if kind == "mtp" else LLM(str(family["target"]), draft_model=str(family[kind]),
                                                                  **kw)
    assert gpu.engine.drafter_kind == kind and gpu.engine.runner.graphs
    assert batch > 1 or gpu.engine.speculation.rounds  # (batch 1: device rounds, captured)
    outs = gpu.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == cpu
    assert sum(o.timing.draft_n_accepted for o in outs) > 0


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_lone_prefill_chunks_of_a_hybrid_target_replay_padded_graphs_and_equal_eager_prefill(tmp_path, arch,
                                                                                             monkeypatch):
    """Each prompt runs alone, so its prefill chunks replay prefill graphs (padded up to the next length, the pad
    rows inert in the linear layers): greedy tokens equal eager prefill's (prefill_graph_tokens 0) for prompts
    shorter than the smallest graph, across fla's chunk of 64, one chunked by the step budget and a prefix hit that
    continues a state snapshot."""
    from outrider.graphs import CudaGraphRunner

    replays: list[int] = []
    run = CudaGraphRunner.run
    monkeypatch.setattr(CudaGraphRunner, "run", lambda self, *a: replays.append(self.q) or run(self, *a))
    path = write_tiny_checkpoint(tmp_path, arch, hidden_size=128, layers=4)
    long = list(range(100, 400))  # chunks of 128, 128, 32 (up to its snapshot), 12
    prompts = [[7, 8, 9], [1] + list(range(30, 70)), list(range(200, 300)), long, long + [5, 6, 7]]  # (hit: 288)
    runs = {}
    for graph_tokens in (256, 0):
        llm = LLM(str(path), device="cuda", dtype="float32", block_size=16, max_num_batched_tokens=128,
                  prefill_graph_tokens=graph_tokens)
        replays.clear()
        runs[graph_tokens] = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
        assert llm.engine.pool.hits > 0
        assert bool({8, 64, 128} & set(replays)) == bool(graph_tokens)
    assert runs[256] == runs[0]
