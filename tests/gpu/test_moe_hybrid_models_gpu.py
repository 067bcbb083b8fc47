"""MoE and hybrid models on the GPU against the CPU: Qwen3-MoE through the engine (fused experts, CUDA graphs),
and Qwen3-Next / Qwen3.5 / Qwen3.5-MoE through the hybrid harness (fla prefill, step kernels for decode and
verify, the fused experts, the Triton attention backend)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from outrider.attention import KVCache
from outrider.engine.state_pool import StateLayout, StatePool
from outrider.llm import LLM
from outrider.models import load_model
from outrider.params import SamplingParams
from outrider.testing.checkpoints import write_tiny_checkpoint
from tests.test_models_hybrid import PROMPTS, HybridRunner
from tests.test_models_parity import BLOCK_SIZE

pytestmark = pytest.mark.cuda_only


def _greedy(path, **kw) -> list[list[int]]:
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    return [c.token_ids for c in LLM(str(path), block_size=16, **kw).generate(PROMPTS, params)]


def test_qwen3_moe_on_the_gpu_with_graphs_equals_the_cpu(tmp_path):
    path = write_tiny_checkpoint(tmp_path, "qwen3_moe", hidden_size=128, layers=3, heads=4, kv_heads=2,
                                 extra_config={"num_experts": 16, "num_experts_per_tok": 4})
    cpu = _greedy(path, device="cpu", dtype="float32")
    assert _greedy(path, device="cuda", dtype="float32") == cpu
    assert _greedy(path, device="cuda", dtype="float32", enforce_eager=True) == cpu


class CudaHybridRunner(HybridRunner):
    """HybridRunner on the GPU: model, KV (Triton attention), state pool and inputs on CUDA."""

    def __init__(self, model, n_seqs: int):
        super().__init__(model, n_seqs)
        cfg = model.config
        self.kv = KVCache.allocate(cfg.num_hidden_layers, self.tables.numel(), BLOCK_SIZE, cfg.num_key_value_heads,
                                   cfg.head_dim, torch.float32, "cuda")
        from outrider.attention.triton_backend import TritonAttentionBackend  # (needs Triton: CUDA only)

        self.backend = TritonAttentionBackend()
        layout = StateLayout.of(model.linear_config, model.num_linear_layers)
        self.pool = StatePool(layout, n_seqs + 2, verify_rows=n_seqs, verify_positions=6, device="cuda")
        self.slots = [self.pool.allocate() for _ in range(n_seqs)][::-1]

    def prepare(self, chunks):
        ids, pos, meta = super().prepare(chunks)
        on_gpu = {f: getattr(meta, f).cuda() for f in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")}
        return ids.cuda(), pos.cuda(), dataclasses.replace(meta, **on_gpu)


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_hybrid_models_on_the_gpu_equal_the_cpu(tmp_path, arch):
    pytest.importorskip("fla")
    path = write_tiny_checkpoint(tmp_path, arch, layers=4, hidden_size=128, heads=4, kv_heads=2,
                                 extra_config={"linear_key_head_dim": 32, "linear_value_head_dim": 32})
    cpu_model, _ = load_model(path)
    gpu_model, _ = load_model(path, device="cuda", dtype="float32")
    runners = [HybridRunner(cpu_model, len(PROMPTS)), CudaHybridRunner(gpu_model, len(PROMPTS))]
    steps = [(PROMPTS, False), ([[7]] * len(PROMPTS), False), ([[5, 6, 7, 8]] * len(PROMPTS), True)]
    for chunks, verify in steps:  # prefill (ragged, past one chunk), decode, verify
        outs = []
        for runner in runners:
            runner.verify = verify
            outs.append(runner.step(chunks))
        for want, got in zip(*outs):
            torch.testing.assert_close(got.cpu(), want, atol=1e-2, rtol=1e-2)  # (fla computes fp32 dots in tf32)
    cpu_pool, gpu_pool = runners[0].pool, runners[1].pool
    torch.testing.assert_close(gpu_pool.verify_updates.cpu(), cpu_pool.verify_updates, atol=1e-2, rtol=1e-2)
