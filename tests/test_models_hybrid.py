"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (models/hybrid.py) against transformers on tiny random fp32 checkpoints, at the model
level with a small harness (paged KV for the full-attention layers, a StatePool for the linear ones): ragged
batches, chunked prefill, greedy decoding, and a speculative verify rolled back to each accepted length."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from outrider.engine.state_pool import StateLayout, StatePool
from outrider.layers.gated_deltanet import StateBatch
from outrider.models import load_model
from outrider.models.hybrid import LinearStates
from outrider.models.output import ForwardResult
from outrider.testing import write_tiny_checkpoint
from outrider.testing.checkpoints import write_multimodal_release
from tests.test_models_parity import Runner, assert_greedy_matches_hf, hf_logits

transformers = pytest.importorskip("transformers")

PROMPTS = [[1, 17, 99, 200, 7], [1] + list(range(30, 100)), [42], [1, 300, 301, 302, 5, 6, 7, 8, 9, 10, 11]]
CASES = {
    "qwen3_next": dict(arch="qwen3_next", layers=4),
    "qwen3_5": dict(arch="qwen3_5", layers=4),
    "qwen3_5-tied-3to1": dict(arch="qwen3_5", layers=4, tie=True, extra_config={"full_attention_interval": 4}),
    "qwen3_5_moe": dict(arch="qwen3_5_moe", layers=4),
}


class HybridRunner(Runner):
    """The parity tests' runner (shuffled KV blocks, state kept across steps) plus a state pool, one slot per
    sequence; `verify` makes the next steps verify forwards."""

    def __init__(self, model, n_seqs: int, max_len: int = 160, verify_positions: int = 6):
        super().__init__(model, model.config, n_seqs, max_len)
        layout = StateLayout.of(model.linear_config, model.num_linear_layers)
        self.pool = StatePool(layout, n_seqs + 2, verify_rows=n_seqs, verify_positions=verify_positions)
        self.slots = [self.pool.allocate() for _ in range(n_seqs)][::-1]  # slots need not follow rows
        self.verify = False

    @torch.no_grad()
    def forward(self, chunks: list[list[int]], aux_layer_ids: tuple[int, ...] = ()) -> ForwardResult:
        ids, pos, meta = self.prepare(chunks)
        batch = StateBatch(meta.query_start_loc_host, torch.tensor(self.slots, device=ids.device), self.slots,
                           self.verify, meta.query_start_loc)
        return self.model(ids, pos, self.kv, meta, self.backend, aux_layer_ids, states=LinearStates(self.pool, batch))


def assert_logits_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32 logits within rounding of transformers': 2e-4, or 2e-5 of the largest logit where logits are large (a
    tied head's reach ~50, where the delta rule's float32 sums part by ~3e-4 over 70 tokens, machine to machine)."""
    torch.testing.assert_close(got, want, atol=max(2e-4, 2e-5 * want.abs().max().item()), rtol=0)


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), **CASES[request.param])
    ours, _ = load_model(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours, hf, path


def test_ragged_batch_logits_match_transformers(pair):
    ours, hf, _ = pair
    got = HybridRunner(ours, len(PROMPTS)).step(PROMPTS)
    for ids, logits in zip(PROMPTS, got):
        assert_logits_close(logits, hf_logits(hf, ids))


def test_chunked_prefill_carries_the_state(pair):
    ours, hf, _ = pair
    runner = HybridRunner(ours, len(PROMPTS))
    cuts = [(2, 3), (13, 66), (0, 1), (10, 11)]  # three steps; the third sequence joins late
    steps = [[ids[:a] for ids, (a, _) in zip(PROMPTS, cuts)], [ids[a:b] for ids, (a, b) in zip(PROMPTS, cuts)],
             [ids[b:] for ids, (_, b) in zip(PROMPTS, cuts)]]
    got = [torch.cat(parts) for parts in zip(*(runner.step(s) for s in steps))]
    for ids, logits in zip(PROMPTS, got):
        assert_logits_close(logits, hf_logits(hf, ids))


def test_greedy_generation_matches_transformers_generate(pair):
    ours, hf, _ = pair
    assert_greedy_matches_hf(HybridRunner(ours, 3), hf, PROMPTS[:3], 32)


@pytest.mark.parametrize("accepted", [[0, 4], [4, 2], [1, 0]])
def test_verify_then_rollback_continues_from_the_accepted_prefix(pair, accepted):
    """A verify of k + 1 = 5 tokens per sequence, ragged acceptance: each sequence keeps the state after its
    accepted drafts (never re-running its prefix), and its next step's logits are transformers' for exactly the
    committed tokens."""
    ours, hf, _ = pair
    prompts, drafts = [PROMPTS[0], PROMPTS[3]], [[5, 6, 7, 8], [70, 71, 72, 73]]
    runner = HybridRunner(ours, 2)
    last = [int(lg[-1].argmax()) for lg in runner.step(prompts)]
    runner.verify = True
    verify = runner.step([[t] + d for t, d in zip(last, drafts)])
    runner.verify = False
    for ids, t, d, logits in zip(prompts, last, drafts, verify):
        assert_logits_close(logits, hf_logits(hf, ids + [t] + d)[len(ids):])
    runner.pool.commit_verify(torch.tensor(runner.slots), torch.arange(2), torch.tensor(accepted))
    runner.lens = [len(p) + j + 1 for p, j in zip(prompts, accepted)]  # rejected KV is overwritten next step
    bonus = [int(v[j].argmax()) for v, j in zip(verify, accepted)]
    nxt = runner.step([[b] for b in bonus])
    for ids, t, d, j, b, logits in zip(prompts, last, drafts, accepted, bonus, nxt):
        assert_logits_close(logits[0], hf_logits(hf, ids + [t] + d[:j] + [b])[-1])


def test_qwen3_5_conditional_generation_checkpoint_serves_its_text_model(tmp_path):
    """The release layout: keys under text_config, weights under model.language_model., a vision tower beside
    (not loaded): the same model as the text-only checkpoint."""
    text = write_tiny_checkpoint(tmp_path / "text", "qwen3_5", layers=4)
    full = write_multimodal_release(text, tmp_path / "full")
    tensors = load_file(full / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(tensors, full / "model.safetensors")
    a, _ = load_model(text)
    b, cfg = load_model(full)
    assert cfg.architecture == "Qwen3_5ForConditionalGeneration"
    ids = PROMPTS[1]
    torch.testing.assert_close(HybridRunner(b, 1).step([ids])[0], HybridRunner(a, 1).step([ids])[0])


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next", "qwen3_5_moe"])
def test_mtp_layer_reads_the_released_mtp_layer_tensors(tmp_path, arch):
    """mtp.layers.0 as released: a gated full-attention layer (Qwen3.5 dense: its 11 tensors), with the model's
    MoE block (router, experts, gated shared expert) where the model has one."""
    from outrider.models import registry
    from outrider.models.hybrid import mtp_layer
    from outrider.models.loader import checkpoint_layout

    cfg = registry.load_config(write_tiny_checkpoint(tmp_path, arch, layers=4))
    with torch.device("meta"):
        layer = mtp_layer(cfg, fused_experts=arch == "qwen3_5_moe")
    names = set(checkpoint_layout(layer))
    attention = {f"self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
    norms = {"input_layernorm.weight", "post_attention_layernorm.weight"}
    if arch == "qwen3_5":
        assert names == attention | norms | {f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
        return
    shared = {f"mlp.shared_expert.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
    router = {"mlp.gate.weight", "mlp.shared_expert_gate.weight"}
    experts = ({"mlp.experts.gate_up_proj", "mlp.experts.down_proj"} if arch == "qwen3_5_moe" else
               {f"mlp.experts.{e}.{p}.weight" for e in range(8) for p in ("gate_proj", "up_proj", "down_proj")})
    assert names == attention | norms | shared | router | experts
    assert layer.self_attn.qkv_proj.parts["q_proj"] == 2 * cfg.num_attention_heads * cfg.head_dim  # + the gate


@pytest.mark.parametrize("quant", ["F32", "F16"])
@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next", "qwen3_5_moe"])
def test_gguf_as_llama_cpp_writes_it_loads_the_same_model(tmp_path, arch, quant):
    """llama.cpp's qwen35 / qwen3next / qwen35moe file (1 + w norms, -exp(A_log), squeezed conv, MTP dropped;
    Qwen3.5's value heads tiled, Qwen3-Next's qkvz split, experts stacked or fused) loads to the safetensors
    model's parameters and logits."""
    from outrider.testing.gguf import write_gguf

    ckpt = write_tiny_checkpoint(tmp_path / arch, arch, layers=4)
    ours, cfg = load_model(ckpt)
    from_gguf, gcfg = load_model(write_gguf(ckpt, tmp_path / f"{arch}.gguf", quant=quant), dtype="float32")
    keys = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
            "linear_conv_kernel_dim", "full_attention_interval")
    assert [gcfg.raw[k] for k in keys] == [cfg.raw[k] for k in keys]
    orders = [None if o is None else o.tolist()  # partial RoPE's order, or None (RoPE over every dimension)
              for o in (m.model.layers[1].self_attn.order for m in (from_gguf, ours))]
    assert orders[0] == orders[1]
    tol = 1e-6 if quant == "F32" else 2e-3  # (F32: A_log comes back through log(exp))
    a, b = dict(ours.named_parameters()), dict(from_gguf.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        if name.endswith("linear_attn.in_proj.weight"):  # (Qwen3-Next's GGUF packs its projections otherwise)
            continue
        torch.testing.assert_close(b[name], a[name], atol=tol * max(1.0, a[name].abs().max().item()), rtol=0,
                                   msg=name)
    x = torch.randn(3, cfg.hidden_size)
    for mine, theirs in zip(ours.model.layers, from_gguf.model.layers):
        if mine.kind == "linear_attention":  # the projections' parts, whatever their packing
            for got, want in zip(theirs.linear_attn.split(x), mine.linear_attn.split(x)):
                torch.testing.assert_close(got, want, atol=10 * tol, rtol=10 * tol)
    ids = PROMPTS[1]
    torch.testing.assert_close(HybridRunner(from_gguf, 1).step([ids])[0], HybridRunner(ours, 1).step([ids])[0],
                               atol=1e-4 if quant == "F32" else 0.1, rtol=0)


def test_a_forward_without_states_is_refused_by_name(pair):
    ours, _, _ = pair
    runner = HybridRunner(ours, 1)
    ids, pos, meta = runner.prepare([[1, 2, 3]])
    with pytest.raises(ValueError, match="needs `states`"):
        ours(ids, pos, runner.kv, meta, runner.backend)


def test_a_prefix_hit_from_a_block_boundary_snapshot_equals_the_cold_prompt(pair):
    """The prefix-cache rule at the model level: sequence 0's prefill ends a chunk on a block boundary and
    snapshots its state there; sequence 1 reuses those KV blocks (shared in its block table) and restores the
    snapshot into its own slot, then computes only the rest: its logits are the cold prompt's."""
    ours, hf, _ = pair
    shared, first_rest, second_rest = PROMPTS[1][:12], PROMPTS[1][12:20], [9, 8, 7, 6, 5]
    runner = HybridRunner(ours, 2)
    runner.step([shared, []])  # 12 tokens = 3 whole blocks of 4
    assert runner.pool.snapshot(runner.slots[0], key="block 3")
    runner.step([first_rest, []])  # sequence 0 goes on past the snapshot
    runner.tables[1, :3] = runner.tables[0, :3]  # the hit: sequence 1 reads sequence 0's first 3 blocks
    runner.lens[1] = len(shared)
    assert runner.pool.longest_snapshot(["block 1", "block 2", "block 3"]) == 3
    runner.pool.restore("block 3", runner.slots[1])
    got = runner.step([[], second_rest])[1]
    assert_logits_close(got, hf_logits(hf, shared + second_rest)[len(shared):])
