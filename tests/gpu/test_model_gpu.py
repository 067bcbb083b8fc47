"""Whole-model checks on the GPU: greedy tokens equal the CPU reference; graphs equal eager; bf16 forward."""

from __future__ import annotations

import pytest
import torch

from outrider.llm import LLM
from outrider.params import SamplingParams
from outrider.testing.checkpoints import write_tiny_checkpoint

pytestmark = pytest.mark.cuda_only

PROMPTS = [[5, 17, 42, 99, 7], list(range(10, 47)), [300, 301]]  # 3 sequences: decode pads to bucket 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "qwen3", hidden_size=128, layers=3, heads=4,
                                 kv_heads=2, head_dim=32, dtype=torch.float32)


def _greedy(path, **kw) -> list[list[int]]:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    return [c.token_ids for c in LLM(str(path), block_size=16, **kw).generate(PROMPTS, params)]


def test_greedy_gpu_equals_cpu_reference(tiny):
    assert _greedy(tiny, device="cuda", dtype="float32") == _greedy(tiny, device="cpu", dtype="float32")


def test_cuda_graphs_equal_eager(tiny):
    assert _greedy(tiny, device="cuda", dtype="float32") == _greedy(tiny, device="cuda", dtype="float32",
                                                                    enforce_eager=True)


@pytest.mark.parametrize("late_release", [False, True])
def test_graphs_without_pdl_equal_graphs_with_it(tiny, monkeypatch, late_release):
    """Programmatic dependent launch changes when kernels start, never what they compute (nor does when a GEMM
    releases the next kernel: the tiny model's weights are all below the late-release size unless it is 0)."""
    from outrider.kernels import gemm, launch

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9.0+")
    monkeypatch.setattr(gemm, "GEMM_LATE_RELEASE_BYTES", 0 if late_release else 2**62)
    with_pdl = _greedy(tiny, device="cuda", dtype="bfloat16")
    monkeypatch.setattr(launch, "PDL", False)
    assert _greedy(tiny, device="cuda", dtype="bfloat16") == with_pdl


def test_verify_graphs_replay_and_equal_eager(tiny, tmp_path, monkeypatch):
    """Speculative steps of one or two sequences replay captured verify graphs (k + 1 tokens per sequence) and
    the draft model its decode graphs, and greedy output equals the eager engine's, which equals plain
    decoding's (lossless)."""
    from outrider.graphs import CudaGraphRunner

    draft = write_tiny_checkpoint(tmp_path / "draft", "qwen3", hidden_size=64, layers=1, heads=4, kv_heads=2,
                                  head_dim=16, dtype=torch.float32, seed=3)
    replays: list[int] = []
    run = CudaGraphRunner.run
    monkeypatch.setattr(CudaGraphRunner, "run", lambda self, *a: replays.append(self.q) or run(self, *a))
    spec = dict(device="cuda", dtype="float32", draft_model=str(draft), spec_draft_n_max=3,
                spec_measured_costs=False)  # (drafting forced: the measured policy may find a tiny model's rounds slow)
    prompts = PROMPTS[:2]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    graphs = [c.token_ids for c in LLM(str(tiny), block_size=16, **spec).generate(prompts, params)]
    assert any(q > 1 for q in replays)
    eager = [c.token_ids for c in LLM(str(tiny), block_size=16, enforce_eager=True, **spec).generate(prompts, params)]
    plain = [c.token_ids for c in LLM(str(tiny), block_size=16, device="cuda", dtype="float32").generate(prompts, params)]
    assert graphs == eager == plain


def test_step_reserve_is_measured_and_sizes_the_pool(tiny):
    """The KV pool is sized from the free memory less a measured step (engine/memory.py): the measurement is a
    real peak (more than the logits of its rows alone), and the pool then fits the budget."""
    from outrider.engine import memory
    from outrider.models import load_model

    model, cfg = load_model(tiny, dtype=torch.bfloat16, device="cuda")
    rows = 64
    reserve = memory.measure_step_reserve(model, cfg, tokens=2048, rows=rows, block_size=16, dtype=torch.bfloat16,
                                          device=torch.device("cuda"))
    assert rows * cfg.vocab_size * 4 < reserve < memory.FALLBACK_RESERVE
    del model
    torch.cuda.empty_cache()
    free_before, _ = torch.cuda.mem_get_info()
    utilization = 0.05
    llm = LLM(str(tiny), device="cuda", dtype="bfloat16", max_num_seqs=rows, max_model_len=2048,
              gpu_memory_utilization=utilization)
    kv = llm.engine.kv_cache
    kv_bytes = sum(t.numel() * t.element_size() for t in (*kv.k, *kv.v))
    assert kv.num_blocks > 2
    # The pool fits the budget: the free memory's share, which the measured step and the graphs come out of.
    assert kv_bytes <= utilization * free_before


def test_bf16_forward_close_to_cpu_fp32(tiny):
    from outrider.attention import KVCache, get_backend
    from outrider.attention.metadata import build_metadata
    from outrider.models import load_model

    ids = PROMPTS[1]
    outs = []
    for device, dtype in (("cpu", torch.float32), ("cuda", torch.bfloat16)):
        model, cfg = load_model(tiny, dtype=dtype, device=device)
        cache = KVCache.allocate(cfg.num_hidden_layers, 8, 16, cfg.num_key_value_heads, cfg.head_dim, dtype, device)
        meta, pos = build_metadata([([1, 2, 3], 0, len(ids))], 16, torch.device(device))
        with torch.inference_mode():
            h = model(torch.tensor(ids, device=device), pos, cache, meta, get_backend(device)).hidden
        outs.append(h.float().cpu())
    err = ((outs[1] - outs[0]).norm() / outs[0].norm()).item()
    assert err < 3e-2, err


def test_lm_head_rows_keep_float32_logits_at_every_row_count(tiny):
    """Verify rows (3-16 a sequence; eager here: cuBLAS) get the float32 logits a decode row (the skinny GEMM, in a
    graph) gets: not rounded to bfloat16 first, where their argmax would break near-ties differently."""
    from outrider.kernels import ops

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8, 128, device="cuda", generator=gen).bfloat16()
    w = torch.randn(4096, 128, device="cuda", generator=gen).bfloat16()
    want = x.float() @ w.float().t()
    got = ops.linear(x, w, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-4)  # (bfloat16 rounding: up to 0.06 here)


def test_lone_prefill_chunks_replay_padded_graphs_and_equal_eager(tiny, monkeypatch):
    """With prefill_graph_tokens, each prompt here runs alone and its prefill replays a graph of the next power of
    two (the 5- and 37-token prompts padded, the 2-token one too), whole or in chunks; output equals eager."""
    from outrider.graphs import CudaGraphRunner

    replays: list[int] = []
    run = CudaGraphRunner.run
    monkeypatch.setattr(CudaGraphRunner, "run", lambda self, *a: replays.append(self.q) or run(self, *a))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for chunk in (2048, 16):
        llm = LLM(str(tiny), block_size=16, device="cuda", dtype="float32", prefill_graph_tokens=64,
                  max_num_batched_tokens=chunk)
        replays.clear()
        graphs = [llm.generate([p], params)[0].token_ids for p in PROMPTS]
        assert {8, 64 if chunk > 16 else 16} <= set(replays)
        eager_llm = LLM(str(tiny), block_size=16, device="cuda", dtype="float32", enforce_eager=True,
                        max_num_batched_tokens=chunk)
        assert graphs == [eager_llm.generate([p], params)[0].token_ids for p in PROMPTS]


def test_hidden_rows_are_recomputed_from_the_cache_without_writing_it(tiny):
    from tests.spec_helpers import check_hidden_rows_recompute_without_writing

    check_hidden_rows_recompute_without_writing(tiny, "cuda")
