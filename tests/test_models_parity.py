"""Our decoder vs Hugging Face transformers on tiny random fp32 checkpoints: logits and greedy generations."""

from __future__ import annotations

import itertools

import pytest
import torch

from outrider.attention import AttentionMetadata, KVCache
from outrider.attention.torch_ref import TorchReferenceBackend
from outrider.models import load_model
from outrider.models.output import ForwardResult

transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 4
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def longrope(original: int) -> dict:
    """Phi-3's LongRoPE over head_dim 16 (8 frequencies), distinct short and long divisors."""
    return {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                             "long_factor": [1.0 + 2.0 * i for i in range(8)]},
            "original_max_position_embeddings": original}


CASES = {
    "llama": ("llama", {}),
    "llama3-rope": ("llama", {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0}),
    "llama-tied-sharded": ("llama", {"tie": True, "shards": 2}),
    "qwen2": ("qwen2", {}),
    "qwen2-tied": ("qwen2", {"tie": True}),
    "qwen2-sliding-upper-layer": ("qwen2", {"extra_config": {"use_sliding_window": True, "sliding_window": 5,
                                                             "max_window_layers": 1}}),
    "qwen3": ("qwen3", {"shards": 3}),
    "qwen3-tied": ("qwen3", {"tie": True, "head_dim": 32}),
    "mistral": ("mistral", {}),
    "mistral-sliding-window": ("mistral", {"extra_config": {"sliding_window": 6}}),
    "phi3": ("phi3", {}),
    "phi3-sliding-window-tied": ("phi3", {"tie": True, "extra_config": {"sliding_window": 7}}),
    # The context is the original one: LongRoPE's short factors (transformers' choice for every sequence here).
    "phi3-longrope-short": ("phi3", {"max_position_embeddings": 2048, "extra_config": longrope(2048)}),
    # Local and global layers alternate (window 4, RoPE bases 100 and 10000), query_pre_attn_scalar != head_dim.
    "gemma3": ("gemma3", {"rope_theta": 10000.0, "extra_config": {"query_pre_attn_scalar": 24}}),
    # (Tied, a random tiny Gemma repeats its input token: the scaled embedding outweighs the post-normed blocks.)
    "gemma3-softcap-linear-rope": ("gemma3", {"rope_scaling": {"rope_type": "linear", "factor": 4.0},
                                              "extra_config": {"final_logit_softcapping": 3.0}}),
    "gemma3-rope-per-layer-type": ("gemma3", {"extra_config": {"rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}}}}),
}

PROMPTS = [[1, 17, 99, 200, 7], [1] + list(range(30, 53)), [42], [1, 300, 301, 302, 5, 6, 7, 8, 9, 10, 11]]


class Runner:
    """Our model over a paged KV cache: sequence i owns a shuffled set of blocks, the cache persists across steps."""

    def __init__(self, model, cfg, n_seqs: int, max_len: int = 64):
        self.model, self.backend = model, TorchReferenceBackend()
        per_seq = -(-max_len // BLOCK_SIZE)
        self.tables = torch.randperm(n_seqs * per_seq, generator=torch.Generator().manual_seed(0)).view(n_seqs, -1)
        self.kv = KVCache.allocate(cfg.num_hidden_layers, n_seqs * per_seq, BLOCK_SIZE, cfg.num_key_value_heads,
                                   cfg.head_dim, torch.float32, "cpu")
        self.lens = [0] * n_seqs

    def prepare(self, chunks: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Append chunks[i] to sequence i (may be empty): (input_ids, positions, meta) of one ragged batch."""
        ids, pos, slots, qsl = [], [], [], [0]
        for i, chunk in enumerate(chunks):
            for p in range(self.lens[i], self.lens[i] + len(chunk)):
                pos.append(p)
                slots.append(int(self.tables[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE)
            ids += chunk
            self.lens[i] += len(chunk)
            qsl.append(len(ids))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(self.lens, dtype=torch.int32), block_tables=self.tables.int(),
            max_query_len=max(map(len, chunks)), max_seq_len=max(self.lens),
            query_start_loc_host=qsl, seq_lens_host=list(self.lens))
        return torch.tensor(ids), torch.tensor(pos), meta

    @torch.no_grad()
    def forward(self, chunks: list[list[int]], aux_layer_ids: tuple[int, ...] = ()) -> ForwardResult:
        ids, pos, meta = self.prepare(chunks)
        return self.model(ids, pos, self.kv, meta, self.backend, aux_layer_ids)

    def step(self, chunks: list[list[int]]) -> list[torch.Tensor]:
        """Run one ragged batch; return each chunk's logits [len, V]."""
        logits = self.model.compute_logits(self.forward(chunks).hidden)
        bounds = [0, *itertools.accumulate(map(len, chunks))]
        return [logits[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tiny_checkpoint):
    arch, kwargs = CASES[request.param]
    path = tiny_checkpoint(arch, **kwargs)
    ours, cfg = load_model(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours, cfg, hf


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()


def test_ragged_batch_logits_match_hf(pair):
    ours, cfg, hf = pair
    got = Runner(ours, cfg, len(PROMPTS)).step(PROMPTS)
    for ids, logits in zip(PROMPTS, got):
        torch.testing.assert_close(logits, hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_two_steps_through_the_cache_match_hf(pair):
    ours, cfg, hf = pair
    runner = Runner(ours, cfg, len(PROMPTS))
    cuts = [2, 13, 0, 10]  # the third sequence joins in the second step, the last continues with one token
    runner.step([ids[:c] for ids, c in zip(PROMPTS, cuts)])
    got = runner.step([ids[c:] for ids, c in zip(PROMPTS, cuts)])
    for ids, c, logits in zip(PROMPTS, cuts, got):
        torch.testing.assert_close(logits, hf_logits(hf, ids)[c:], atol=1e-4, rtol=0)


def test_greedy_generation_matches_hf_generate(pair):
    ours, cfg, hf = pair
    n_new, prompts = 16, PROMPTS[:3]
    runner = Runner(ours, cfg, len(prompts))
    outs: list[list[int]] = [[] for _ in prompts]
    chunks = prompts
    for _ in range(n_new):  # one ragged batch: prefills first, then one decode token per sequence
        logits = runner.step(chunks)
        chunks = [[int(lg[-1].argmax())] for lg in logits]
        for out, chunk in zip(outs, chunks):
            out += chunk
    for ids, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, eos_token_id=None)
        assert out == ref[0, len(ids):].tolist()
    assert len(set(outs[0])) > 4, "random tiny model degenerated into repeating one token"


def test_aux_hidden_is_the_cat_of_layer_outputs(pair):
    ours, cfg, hf = pair
    ids = PROMPTS[1]
    out = Runner(ours, cfg, 1).forward([ids], aux_layer_ids=(0, cfg.num_hidden_layers - 1))
    hidden, aux = out.hidden, out.aux_hidden
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states  # [i + 1] = output of layer i
    assert aux.shape == (len(ids), 2 * cfg.hidden_size)
    torch.testing.assert_close(aux[:, :cfg.hidden_size], ref[1][0], atol=1e-4, rtol=0)
    torch.testing.assert_close(aux[:, cfg.hidden_size:], hidden)


def test_phi3_longrope_past_the_original_context_matches_hf(tiny_checkpoint):
    """A context past the original one takes the long factors and the attention factor (sqrt(1 + ln 256 / ln 8));
    transformers takes them for any sequence longer than the original context, as these prompts are."""
    path = tiny_checkpoint("phi3", max_position_embeddings=2048, extra_config=longrope(8))
    ours, cfg = load_model(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [p + [5] * max(0, 9 - len(p)) for p in PROMPTS]
    for ids, logits in zip(prompts, Runner(ours, cfg, len(prompts)).step(prompts)):
        torch.testing.assert_close(logits, hf_logits(hf, ids), atol=1e-4, rtol=0)
    runner, outs, chunks = Runner(ours, cfg, 2), [[], []], prompts[:2]
    for _ in range(12):
        chunks = [[int(lg[-1].argmax())] for lg in runner.step(chunks)]
        for out, chunk in zip(outs, chunks):
            out += chunk
    for ids, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=12, min_new_tokens=12, do_sample=False, eos_token_id=None)
        assert out == ref[0, len(ids):].tolist()


def test_gemma3_multimodal_checkpoint_serves_its_language_model(tmp_path):
    """A Gemma3ForConditionalGeneration checkpoint as transformers saves it (text_config; the language model under
    language_model., a vision tower beside it): our text model computes what transformers computes for text."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    text = Gemma3TextConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                            sliding_window=4, sliding_window_pattern=2, max_position_embeddings=256)
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=32, patch_size=8)
    torch.manual_seed(0)
    hf = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                                     image_token_index=500, boi_token_index=498,
                                                     eoi_token_index=499)).eval()
    with torch.no_grad():  # transformers initialises tiny weights and zero norms: logits would say little
        for name, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * (0.5 if p.dim() == 1 else p.shape[-1] ** -0.5))
    hf.save_pretrained(tmp_path)
    ours, cfg = load_model(tmp_path)
    assert cfg.architecture == "Gemma3ForConditionalGeneration" and cfg.layer_types[1] == "full_attention"
    for ids, logits in zip(PROMPTS, Runner(ours, cfg, len(PROMPTS)).step(PROMPTS)):
        torch.testing.assert_close(logits, hf_logits(hf, ids), atol=1e-4, rtol=0)
