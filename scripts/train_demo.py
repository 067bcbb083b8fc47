#!/usr/bin/env python3
"""Train outrider's bundled demo model family on Python source, reproducibly.

What it builds, all sharing one byte-level BPE tokenizer:
  target/  a Qwen3ForCausalLM checkpoint (HF layout) with a Qwen3.5-style MTP layer stored in it (`mtp.*`)
  draft/   a smaller Qwen3ForCausalLM draft model (distilled from the target)
  dflash/  a DFlashDraftModel drafter (block diffusion on the target's frozen hidden states)
  eagle3/  an EAGLE-3 head (EAGLE reference layout, LlamaForCausalLMEagle3) over three target taps, with a reduced
           draft vocabulary
plus metrics.json (losses, offline acceptance proxies, T = 0 samples, timings, corpus fingerprints),
eval_prompts.json and train_log.txt.

Data: every `.py` file of the running interpreter's standard library (site-packages excluded). A fixed 5 % of the
files, chosen by a hash of their relative path, is held out for evaluation and never trained on; the tokenizer
learns from the rest. The training text adds, up to a cap, the `.py` files of the interpreter's installed packages
(its site-packages / dist-packages directories, or --site-packages), less duplicates and copies of the stdlib.

Usage (the shipped artifacts; one H200, about 7.5 minutes with the EAGLE-3 stage (6.5 without it, as published);
each training stage has a time cap, so the whole run stays under about 9 minutes even on a slower device):
    python3 scripts/train_demo.py --out outrider/demo --seed 0
On a device run that returns files from $OUT (at most 8 files of 16 MiB): train into a scratch directory and
--pack the family as two tar files plus metrics.json and train_log.txt, to unpack into outrider/demo (packed
again after every stage, so a run stopped from outside still returns the stages it finished):
    python3 scripts/train_demo.py --out /tmp/demo --seed 0 --pack $OUT
CPU smoke run of the whole pipeline with tiny sizes (< 1 minute):
    python scripts/train_demo.py --smoke --out /tmp/demo-smoke
Drafter stages alone against an existing family (its target and tokenizer as they are; the corpus and the target's
generations rebuilt as a full run builds them): --out gets the stages' directories plus the family's metrics.json
and train_log.txt with the stages added, drop-in replacements. The EAGLE-3 head for the shipped family (one H200,
about 2.5 minutes; scripts/gpu_run.sh train-eagle3), then `tar -xf $OUT/demo-eagle3.tar -C outrider/demo` and copy
metrics.json and train_log.txt there:
    python3 scripts/train_demo.py --stages eagle3 --family outrider/demo --out /tmp/demo-eagle3 --seed 0 --pack $OUT
--set FIELD=VALUE overrides a profile field for a trial (e.g. --set "eagle3_train=(5, 64, 2e-3, 2)").

Formats follow shared/reference/speculative-decoding.md: MTP = `mtp.fc [H, 2H]` over
concat[pre_fc_norm_embedding(emb(t_{i+1})), pre_fc_norm_hidden(h_i)] with h_i the target's post-final-norm hidden
state, one decoder layer `mtp.layers.0`, `mtp.norm`; recursion feeds the post-`mtp.norm` output back. DFlash =
`fc [H, n_taps*H]` over the outputs of target blocks `target_layer_ids`, `hidden_norm`, non-causal Qwen3 layers
whose context K/V are `k_norm(k_proj(ctx))`/`v_proj(ctx)`, final `norm`, the target's embedding and lm_head.
EAGLE-3 = outrider/speculative/eagle3.py's: `fc [H, 3H]` over target block outputs (the config's
`eagle_aux_hidden_state_layer_ids` are those blocks + 1), `midlayer` one Llama layer whose q/k/v read
[input_layernorm(emb(t_{i+1})) ; hidden_norm(h)] over a residual stream from h (h = fc(taps_i), then the chain's
own pre-norm output), `norm`, `lm_head [draft_vocab, H]`, `d2t`, `t2d`, the target's embedding.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import json
import logging
import math
import platform
import random
import re
import sys
import sysconfig
import tarfile
import textwrap
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")
EOT_ID, IM_START_ID, IM_END_ID, MASK_ID = 0, 1, 2, 3
EOS_IDS = [EOT_ID, IM_END_ID]
ROPE_THETA = 10000.0
RMS_EPS = 1e-6
MAX_POSITIONS = 2048

CHAT_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "{%- set content = message['content'] if message['content'] is string else '' -%}\n"
    "{{- '<|im_start|>' ~ message['role'] ~ '\\n' ~ content ~ '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}\n"
)


# T = 0 completions recorded in metrics.json ("samples"): the README's prompt, more `def` and `class` lines, and a
# chat turn in the chat template's format
SAMPLE_PROMPTS = (
    "def fibonacci(n):",
    "def is_prime(n):",
    "class Stack:",
    "<|im_start|>user\nWrite a Python function `reverse_words(text)`: Return the words of text in reverse order."
    "<|im_end|>\n<|im_start|>assistant\n",
)


# ----------------------------------------------------------------------------------------------------------------
# Sizes


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int

    @classmethod
    def from_config(cls, cfg: dict) -> Shape:
        """The shape of a checkpoint's config.json (a Qwen3 LM's, a DFlash drafter's or an EAGLE-3 head's)."""
        return cls(cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
                   cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"])


@dataclass(frozen=True)
class Profile:
    vocab: int
    seq: int
    target: Shape
    draft: Shape
    dflash: Shape  # hidden must equal the target's
    dflash_taps: tuple[int, ...]
    eagle3: Shape  # the EAGLE-3 head's layer (layers unused: one); hidden must equal the target's
    eagle3_taps: tuple[int, ...]  # target block outputs fc reads, low to high (the config stores them + 1)
    eagle3_vocab: int  # draft vocabulary: the most frequent target tokens of the drafters' training mix
    eagle3_steps: int  # K chained steps in training ("training-time test")
    eagle3_beta: float
    block_size: int
    dflash_gamma: float
    dflash_anchors: int  # blocks per training sequence
    mtp_steps: int  # K recursive steps in training
    mtp_beta: float
    dropout: float
    # (steps, batch, lr, warmup) per stage
    target_train: tuple[int, int, float, int]
    draft_train: tuple[int, int, float, int]
    mtp_train: tuple[int, int, float, int]
    dflash_train: tuple[int, int, float, int]
    eagle3_train: tuple[int, int, float, int]
    eval_every: int
    val_windows: int  # held-out windows for the final loss
    gen_prompts: int
    gen_prompt_len: int
    gen_new: int
    gen_batch: int
    eval_prompts: int  # per kind (def-line prompts, context-window prompts)
    eval_new: int
    max_files: int | None = None  # smoke: a subset of files
    max_file_bytes: int = 1_000_000
    max_chat: int = 4000  # per kind: documented functions, documented methods
    package_bytes: int = 80_000_000  # cap on the installed packages' source added to the training text
    # Per-stage caps in seconds. A stage that reaches its cap still completes its learning-rate decay (the
    # schedule follows the larger of step and time progress), so a slower GPU gets fewer steps, not a cut-off run.
    # On one H200 the step counts bind, not these.
    stage_seconds: dict = field(default_factory=dict)


# One H200, about 6.5 minutes for the whole family without EAGLE-3 (outrider/demo/README.md gives the split by
# stage), about 7.5 with it; at most about 9 if every stage cap binds. The 7-layer target trains 1,800 steps x 96 x
# 512 = 88 M tokens, about 3 passes over the stdlib plus up to 80 MB of installed packages' source: the run before
# it, 4,000 steps over the stdlib alone (55 passes), overfit from step 600 on. With 3 passes there is nothing for
# dropout to do but slow learning. The drafters' stages are trimmed (MTP 1,500 -> 1,200 steps, DFlash 3,000 ->
# 2,000) to fit the device call.
# The EAGLE-3 head has what the 20 MB budget leaves, about 0.85 MB: fc [256, 768] alone is 393 KB, so one attention
# head of 32, a 32-wide MLP and 384 draft tokens (765 KB with its config). In a CPU trial the 384 most frequent
# tokens covered 88 % of the target's generations and 70 % of the corpus (256: 80 % and 63 %), the cap on what the
# head can draft. Short CPU runs (1,000 steps x 16 x 256 on cached target features) of this shape and of the others
# near the budget (head 64, MLP 96, vocabulary 256 or 512) came within 0.15 of each other and not in the order of
# their sizes (offline EAL 1.82-2.04): too close to choose by, so the choice follows coverage.
FULL = Profile(
    vocab=4096, seq=512,
    target=Shape(256, 7, 4, 2, 64, 640),
    draft=Shape(128, 2, 2, 1, 64, 512),
    dflash=Shape(256, 2, 4, 2, 64, 640),
    dflash_taps=(1, 3, 5), block_size=8, dflash_gamma=4.0, dflash_anchors=64,
    eagle3=Shape(256, 1, 1, 1, 32, 32), eagle3_taps=(1, 3, 5), eagle3_vocab=384, eagle3_steps=4, eagle3_beta=0.8,
    mtp_steps=3, mtp_beta=0.6, dropout=0.0,
    target_train=(1800, 96, 2e-3, 150),
    draft_train=(1500, 64, 3e-3, 100),
    mtp_train=(1200, 64, 1.5e-3, 100),
    dflash_train=(2000, 64, 1.5e-3, 100),
    eagle3_train=(1500, 64, 2e-3, 100),
    eval_every=100, val_windows=256,
    gen_prompts=8192, gen_prompt_len=64, gen_new=256, gen_batch=2048,
    eval_prompts=32, eval_new=128,
    stage_seconds={"target": 120, "draft": 60, "mtp": 75, "dflash": 95, "eagle3": 75},
)

SMOKE = Profile(
    vocab=512, seq=64,
    target=Shape(64, 4, 2, 1, 32, 128),  # 4 layers: EAGLE-3 taps 3 distinct outputs of layers 0..L-2
    draft=Shape(32, 1, 1, 1, 32, 64),
    dflash=Shape(64, 1, 2, 1, 32, 128),
    dflash_taps=(0, 1), block_size=4, dflash_gamma=2.0, dflash_anchors=8,
    eagle3=Shape(64, 1, 2, 1, 16, 32), eagle3_taps=(0, 1, 2), eagle3_vocab=128, eagle3_steps=3, eagle3_beta=0.8,
    mtp_steps=2, mtp_beta=0.6, dropout=0.0,
    target_train=(30, 8, 3e-3, 5),
    draft_train=(15, 8, 3e-3, 3),
    mtp_train=(15, 8, 3e-3, 3),
    dflash_train=(15, 8, 3e-3, 3),
    eagle3_train=(15, 8, 3e-3, 3),
    eval_every=10, val_windows=8,
    gen_prompts=16, gen_prompt_len=16, gen_new=24, gen_batch=16,
    eval_prompts=3, eval_new=24,
    max_files=40, max_file_bytes=20_000, max_chat=50, package_bytes=200_000,
    stage_seconds={"target": 60, "draft": 60, "mtp": 60, "dflash": 60, "eagle3": 60},
)


# ----------------------------------------------------------------------------------------------------------------
# Model code: plain PyTorch with Hugging Face Qwen3 parameter names and semantics


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = RMS_EPS):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope(positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [..., T, head_dim] for integer positions [..., T] (rotate-half layout, as HF)."""
    inv = 1.0 / ROPE_THETA ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    freqs = positions.float()[..., None] * inv
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, h, T, d]; cos/sin [T, d] or [B, T, d]
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, s: Shape, in_features: int | None = None, qk_norm: bool = True):
        """in_features: what q/k/v read (default s.hidden); qk_norm: Qwen3's per-head q/k RMSNorm (Llama: none)."""
        super().__init__()
        self.s = s
        n_in = in_features or s.hidden
        self.q_proj = nn.Linear(n_in, s.heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(n_in, s.kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(n_in, s.kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False)
        self.q_norm = RMSNorm(s.head_dim) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(s.head_dim) if qk_norm else nn.Identity()

    def project_q(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.s.heads, self.s.head_dim)).transpose(1, 2)
        return apply_rope(q, cos, sin)

    def project_kv(self, x, cos, sin):
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, self.s.kv_heads, self.s.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.s.kv_heads, self.s.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def attend(self, q, k, v, mask=None, causal=False):
        rep = self.s.heads // self.s.kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        dt = q.dtype
        o = F.scaled_dot_product_attention(q, k.to(dt), v.to(dt), attn_mask=mask, is_causal=causal and mask is None)
        B, _, T, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden, s.ffn, bias=False)
        self.up_proj = nn.Linear(s.hidden, s.ffn, bias=False)
        self.down_proj = nn.Linear(s.ffn, s.hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, s: Shape, dropout: float = 0.0, attention: Attention | None = None):
        super().__init__()
        self.self_attn = attention or Attention(s)
        self.mlp = MLP(s)
        self.input_layernorm = RMSNorm(s.hidden)
        self.post_attention_layernorm = RMSNorm(s.hidden)
        self.dropout = dropout

    def forward(self, x, cos, sin, *, causal=True, mask=None, prefix_kv=None, cache=None, start=0):
        """prefix_kv: (k, v) keys prepended to this layer's own (MTP chain, DFlash context).
        cache: (k_buf, v_buf) [B, kv, maxlen, d] written at [start, start+T) and attended over [0, start+T).
        Returns (output, (k, v)) where (k, v) are this call's own keys/values."""
        return self.block(x, self.input_layernorm(x), cos, sin, causal=causal, mask=mask, prefix_kv=prefix_kv,
                          cache=cache, start=start)

    def block(self, x, xn, cos, sin, *, causal=True, mask=None, prefix_kv=None, cache=None, start=0):
        """The layer with residual stream x and attention input xn (forward: input_layernorm(x))."""
        q = self.self_attn.project_q(xn, cos, sin)
        k, v = self.self_attn.project_kv(xn, cos, sin)
        own = (k, v)
        if cache is not None:
            T = x.shape[1]
            cache[0][:, :, start:start + T] = k.to(cache[0].dtype)
            cache[1][:, :, start:start + T] = v.to(cache[1].dtype)
            k, v = cache[0][:, :, :start + T], cache[1][:, :, :start + T]
            causal = T > 1  # prefill from 0 is causal; a single decode token sees everything before it
        if prefix_kv is not None:
            k = torch.cat([prefix_kv[0].to(k.dtype), k], dim=2)
            v = torch.cat([prefix_kv[1].to(v.dtype), v], dim=2)
        a = self.self_attn.attend(q.to(k.dtype), k, v, mask=mask, causal=causal)
        h = x + F.dropout(a, self.dropout, self.training)
        h = h + F.dropout(self.mlp(self.post_attention_layernorm(h)), self.dropout, self.training)
        return h, own


class Qwen3LM(nn.Module):
    """Qwen3ForCausalLM with tied embeddings; parameter names are HF's."""

    def __init__(self, s: Shape, vocab: int, dropout: float = 0.0):
        super().__init__()
        self.s = s
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, s.hidden)
        self.model.layers = nn.ModuleList([DecoderLayer(s, dropout) for _ in range(s.layers)])
        self.model.norm = RMSNorm(s.hidden)
        self.lm_head = nn.Linear(s.hidden, vocab, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight
        init_weights(self)

    def forward(self, ids, taps=(), cache=None, start=0, positions=None, mask=None):
        """Returns (post-final-norm hidden [B, T, H], [outputs of decoder blocks in `taps`]). positions [B, T] and
        mask [B, 1, T, keys] (True = attend) serve left-padded batches; by default row positions are
        start..start+T-1 and attention is causal."""
        T = ids.shape[1]
        pos = torch.arange(start, start + T, device=ids.device) if positions is None else positions
        cos, sin = rope(pos, self.s.head_dim)
        h = self.model.embed_tokens(ids)
        tapped = []
        for i, layer in enumerate(self.model.layers):
            h, _ = layer(h, cos, sin, mask=mask, cache=None if cache is None else cache[i], start=start)
            if i in taps:
                tapped.append(h)
        return self.model.norm(h), tapped

    def logits(self, hidden):
        return self.lm_head(hidden).float()

    def new_cache(self, batch, maxlen, dtype, device):
        shape = (batch, self.s.kv_heads, maxlen, self.s.head_dim)
        return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                for _ in range(self.s.layers)]


class MTPHead(nn.Module):
    """Qwen3.5-style MTP module; saved under the `mtp.` prefix inside the target checkpoint."""

    def __init__(self, s: Shape, dropout: float = 0.0):
        super().__init__()
        self.s = s
        self.fc = nn.Linear(2 * s.hidden, s.hidden, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(s.hidden)
        self.pre_fc_norm_hidden = RMSNorm(s.hidden)
        self.layers = nn.ModuleList([DecoderLayer(s, dropout)])
        self.norm = RMSNorm(s.hidden)
        init_weights(self)

    def unroll(self, target: Qwen3LM, hidden, ids, steps):
        """Teacher-forced recursive MTP over a whole sequence (unroll_chain), from the target's post-norm hidden
        [B, T, H]; the recursion feeds the post-`mtp.norm` output back. Returns those outputs [B, N, H] per step."""

        def step(tokens, prev, cos, sin, **attention):
            emb = target.model.embed_tokens(tokens)
            x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(prev)], dim=-1))
            out, kv = self.layers[0](x, cos, sin, **attention)
            return self.norm(out), kv

        return unroll_chain(step, hidden, ids, steps, self.s.head_dim)


def unroll_chain(step, hidden, ids, steps: int, head_dim: int) -> list[torch.Tensor]:
    """Teacher-forced chain drafting over a whole sequence with the attention pattern of serving: one decoder layer
    fed its own output back (MTP and EAGLE-3 heads; outrider/speculative/chain.py).

    hidden: the head's first-step hidden input [B, >= N, H]; ids [B, T]. Index i (0 <= i < N = T-1-steps) at step
    k (1-based) reads token t_{i+k} and, for k = 1, hidden_i (for k > 1, what its step k-1 fed back), sits at
    position i+k-1 and predicts t_{i+k+1}. A step-k query sees the step-1 keys of indices <= i (what the head's KV
    cache holds for committed tokens) plus its own chain's step 2..k keys.
    step(tokens [B, N], hidden [B, N, H], cos, sin, **attention) -> (what is fed back [B, N, H], (k, v)) runs the
    head once; `attention` is the DecoderLayer.block keywords. Returns the fed-back states of each step."""
    N = ids.shape[1] - 1 - steps
    prev = hidden[:, :N]
    chain_k, chain_v, outs = [], [], []
    causal = torch.ones(N, N, dtype=torch.bool, device=ids.device).tril()
    eye = torch.eye(N, dtype=torch.bool, device=ids.device)
    for k in range(1, steps + 1):
        cos, sin = rope(torch.arange(N, device=ids.device) + (k - 1), head_dim)
        if k == 1:
            attention = {"causal": True}
        else:
            attention = {"causal": False, "mask": torch.cat([causal] + [eye] * (k - 1), dim=1),
                         "prefix_kv": (torch.cat(chain_k, 2), torch.cat(chain_v, 2))}
        prev, (key, value) = step(ids[:, k:k + N], prev, cos, sin, **attention)
        chain_k.append(key)
        chain_v.append(value)
        outs.append(prev)
    return outs


class Eagle3Layer(DecoderLayer):
    """EAGLE-3's decoder layer as outrider/speculative/eagle3.py runs it: Llama attention (no q/k norm) whose q/k/v
    read [input_layernorm(emb) ; hidden_norm(hidden)] (2H), over a residual stream that starts from the hidden
    input (from hidden_norm(hidden) with norm_before_residual)."""

    def __init__(self, s: Shape, norm_before_residual: bool = False):
        super().__init__(s, attention=Attention(s, 2 * s.hidden, qk_norm=False))
        self.hidden_norm = RMSNorm(s.hidden)
        self.norm_before_residual = norm_before_residual

    def forward(self, emb, hidden, cos, sin, **attention):
        """Returns (the layer's output before the final norm, (k, v))."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        return self.block(residual, torch.cat([self.input_layernorm(emb), normed], dim=-1), cos, sin, **attention)


class Eagle3Head(nn.Module):
    """An EAGLE-3 head in the EAGLE reference layout (`LlamaForCausalLMEagle3`): fc over the concatenated outputs
    of target blocks `taps`, one Eagle3Layer saved as `midlayer.*`, `norm`, an lm_head over the draft vocabulary
    `draft_ids` (target ids), d2t (draft id i -> target id i + d2t[i]) and t2d (the target ids covered). It reads
    the target's token embedding; its pre-norm output is the next chain step's hidden input."""

    def __init__(self, s: Shape, target_hidden: int, n_taps: int, draft_ids: torch.Tensor, vocab: int,
                 norm_before_residual: bool = False):
        super().__init__()
        self.s = s
        self.fc = nn.Linear(n_taps * target_hidden, s.hidden, bias=False)
        self.midlayer = Eagle3Layer(s, norm_before_residual)
        self.norm = RMSNorm(s.hidden)
        self.lm_head = nn.Linear(s.hidden, len(draft_ids), bias=False)
        self.register_buffer("d2t", draft_ids.long() - torch.arange(len(draft_ids)))
        self.register_buffer("t2d", torch.zeros(vocab, dtype=torch.bool).index_fill_(0, draft_ids.long(), True))
        init_weights(self)

    def draft_ids(self) -> torch.Tensor:
        """The target id of each draft id."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def unroll(self, target: Qwen3LM, taps_cat, ids, steps):
        """Teacher-forced chain over a whole sequence (unroll_chain) from fc(taps_cat), taps_cat [B, T, n*H] the
        target's tapped block outputs concatenated in layer order. Returns the pre-norm outputs per step."""

        def step(tokens, prev, cos, sin, **attention):
            return self.midlayer(target.model.embed_tokens(tokens), prev, cos, sin, **attention)

        N = ids.shape[1] - 1 - steps
        return unroll_chain(step, self.fc(taps_cat[:, :N]), ids, steps, self.s.head_dim)

    def logits(self, y):
        """float32 logits over the draft vocabulary."""
        return self.lm_head(self.norm(y)).float()

    def drafts(self, y):
        """Argmax drafts as target ids."""
        return self.draft_ids()[self.logits(y).argmax(-1)]


def draft_vocabulary(streams: list[torch.Tensor], vocab: int, size: int) -> torch.Tensor:
    """The `size` most frequent target tokens of equally weighted `streams` (the drafters' 1:1 training mix of
    corpus windows and target generations), as sorted target ids. Ties go to the lower id."""
    freq = sum(torch.bincount(s.long().cpu(), minlength=vocab).double() / max(1, len(s)) for s in streams)
    order = torch.sort(freq, descending=True, stable=True).indices
    return order[:size].sort().values


def step_weights(beta: float, steps: int) -> list[float]:
    """Per-step loss weights beta^(k-1), normalised to sum 1."""
    w = torch.tensor([beta ** i for i in range(steps)])
    return (w / w.sum()).tolist()


class DFlashDrafter(nn.Module):
    """DFlashDraftModel: fc + hidden_norm over target taps, non-causal Qwen3 layers, norm (no embed/lm_head)."""

    def __init__(self, s: Shape, n_taps: int, dropout: float = 0.0):
        super().__init__()
        self.s = s
        self.fc = nn.Linear(n_taps * s.hidden, s.hidden, bias=False)
        self.hidden_norm = RMSNorm(s.hidden)
        self.layers = nn.ModuleList([DecoderLayer(s, dropout) for _ in range(s.layers)])
        self.norm = RMSNorm(s.hidden)
        init_weights(self)

    def forward(self, taps_cat, block_emb, block_pos, mask):
        """taps_cat [B, T, n_taps*H] (context at positions 0..T-1); block_emb [B, Q, H] at block_pos [B, Q];
        mask [B, 1, Q, T+Q] (True = attend). Returns the post-`norm` block hidden states [B, Q, H]."""
        ctx = self.hidden_norm(self.fc(taps_cat))
        cos_c, sin_c = rope(torch.arange(ctx.shape[1], device=ctx.device), self.s.head_dim)
        cos_b, sin_b = rope(block_pos, self.s.head_dim)
        h = block_emb
        for layer in self.layers:
            ctx_kv = layer.self_attn.project_kv(ctx, cos_c, sin_c)
            h, _ = layer(h, cos_b, sin_b, causal=False, mask=mask, prefix_kv=ctx_kv)
        return self.norm(h)


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, std)


def dflash_block(ids, anchors, block_size, mask_id=MASK_ID):
    """Block token ids [B, N*Bk] = per anchor [x_a, MASK * (Bk-1)], positions a..a+Bk-1, and the attention mask
    [B, 1, N*Bk, T + N*Bk]: context keys strictly before the anchor, plus the block's own Bk keys."""
    B, T = ids.shape
    N = anchors.shape[1]
    slot = torch.arange(block_size, device=ids.device)
    block_ids = torch.full((B, N, block_size), mask_id, dtype=ids.dtype, device=ids.device)
    block_ids[:, :, 0] = ids.gather(1, anchors)
    pos = (anchors[:, :, None] + slot).reshape(B, N * block_size)
    q_anchor = anchors.repeat_interleave(block_size, dim=1)  # [B, Q]
    ctx_mask = torch.arange(T, device=ids.device)[None, None, :] < q_anchor[:, :, None]  # [B, Q, T]
    blk = torch.arange(N, device=ids.device).repeat_interleave(block_size)
    own_mask = (blk[:, None] == blk[None, :]).expand(B, -1, -1)  # [B, Q, Q]
    mask = torch.cat([ctx_mask, own_mask], dim=2)[:, None]
    return block_ids.reshape(B, N * block_size), pos, mask


def dflash_weights(block_size, gamma, device):
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def random_anchors(bsz, T, n, block_size, gen, device, allowed=None):
    """n distinct anchors per row in [1, T - block_size], sorted. allowed [bsz, T - block_size] (column a - 1 for
    anchor a) limits each row to its True columns; a row must allow at least n."""
    r = torch.rand(bsz, T - block_size, generator=gen)
    if allowed is not None:
        r = r.masked_fill(~allowed, -1.0)
    return (r.topk(n, dim=1).indices + 1).sort(dim=1).values.to(device)


def dflash_outputs(drafter, target, x, anchors, block_size, taps, mask_id=MASK_ID):
    """(drafter logits, teacher logits), each [B, N, block_size - 1, V], for one block per anchor of ids x [B, T].
    target: the frozen target, called as target(x, taps=taps) -> (post-norm hidden, [tapped layer outputs]), with
    model.embed_tokens and logits(hidden)."""
    with torch.no_grad():
        th, tapped = target(x, taps=taps)
    block_ids, pos, mask = dflash_block(x, anchors, block_size, mask_id)
    with torch.no_grad():
        bemb = target.model.embed_tokens(block_ids)
    hid = drafter(torch.cat(tapped, -1), bemb, pos, mask)
    B, N = anchors.shape
    hid = hid.view(B, N, block_size, -1)[:, :, 1:]
    # slot k predicts x_{a+k}; the teacher is the target at a+k-1 (given the true prefix)
    tpos = anchors[:, :, None] + torch.arange(0, block_size - 1, device=x.device)  # [B, N, Bk-1]
    th_sel = th.gather(1, tpos.reshape(B, -1, 1).expand(-1, -1, th.shape[-1])).view(B, N, block_size - 1, -1)
    return target.logits(hid), target.logits(th_sel)


def eagle3_outputs(head, target, x, taps, steps):
    """Per chain step k: (the head's logits [B, N, Vd], the target's logits on the draft vocabulary, the target's
    argmax [B, N]) for ids x [B, T]. Step k at index i predicts t_{i+k+1}; its teacher is the target at index i+k
    (given the true prefix). target: the frozen target, called as target(x, taps=taps)."""
    with torch.no_grad():
        th, tapped = target(x, taps=taps)
        teacher = target.logits(th)
        on_vocab, best = teacher[..., head.draft_ids()], teacher.argmax(-1)
    outs = head.unroll(target, torch.cat(tapped, -1), x, steps)
    N = x.shape[1] - 1 - steps
    return [(head.logits(y), on_vocab[:, k:k + N], best[:, k:k + N]) for k, y in enumerate(outs, start=1)]


def eagle3_scores(head, dl, tl, best):
    """(loss, agreement) of one chain step (eagle3_outputs): EAGLE-3's loss, the soft CE of the draft logits to the
    target's distribution on the draft vocabulary where the target's argmax is in it; and the share of positions
    whose draft is the target's argmax (what greedy verification accepts)."""
    keep = head.t2d[best].float()
    loss = (soft_ce(dl, tl) * keep).sum() / keep.sum().clamp(min=1.0)
    agree = (head.draft_ids()[dl.argmax(-1)] == best).float().mean()
    return loss, agree


def dflash_loss(dl, tl, weights):
    """Soft CE of the drafts to the teacher, block slot k weighted by weights[k - 1] (dflash_weights)."""
    return (soft_ce(dl, tl) * weights).sum(-1).mean() / weights.sum()


def dflash_scores(dl, tl, weights) -> dict:
    """val (dflash_loss), agree1 (slot 1's argmax agreement) and eal (the expected acceptance length those
    per-slot agreements give)."""
    acc = (dl.argmax(-1) == tl.argmax(-1)).float().mean(dim=(0, 1))
    eal = torch.cumprod(acc, 0).sum().item() + 1
    return {"val": dflash_loss(dl, tl, weights).item(), "agree1": acc[0].item(), "eal": eal}


# ----------------------------------------------------------------------------------------------------------------
# Data


LOG = logging.getLogger("train_demo")


def log(msg: str) -> None:
    LOG.info(msg)


def log_to(path: Path, append: bool = False) -> None:
    """Log lines go to stdout and to `path` (the run's train_log.txt, appended to with `append`), each stamped with
    the time."""
    stamp = logging.Formatter("[%(asctime)s] %(message)s", "%H:%M:%S")
    LOG.handlers.clear()
    LOG.setLevel(logging.INFO)
    LOG.propagate = False
    file = logging.FileHandler(path, mode="a" if append else "w", encoding="utf-8")
    for handler in (logging.StreamHandler(sys.stdout), file):
        handler.setFormatter(stamp)
        LOG.addHandler(handler)


def stdlib_files(root: Path, max_files: int | None, max_bytes: int) -> list[tuple[str, str]]:
    """(relative path, text) of every UTF-8 .py file under the stdlib, site-packages excluded, sorted."""
    paths = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if not ("site-packages" in rel or "dist-packages" in rel or "__pycache__" in rel):
            try:
                if path.stat().st_size <= max_bytes:
                    paths.append((rel, path))
            except OSError:
                continue
    if max_files is not None:  # smoke: a deterministic spread of the files, a few of them held out
        held = [f for f in paths if is_held_out(f[0])]
        kept = [f for f in paths if not is_held_out(f[0])]
        paths = sorted(kept[:: max(1, len(kept) // max_files)][:max_files] +
                       held[:: max(1, len(held) // 4)][: max(2, max_files // 10)])
    out = []
    for rel, path in paths:
        try:
            data = path.read_bytes()
            if not data.strip():
                continue
            out.append((rel, data.decode("utf-8")))
        except (OSError, UnicodeDecodeError):
            continue
    return out


def is_held_out(rel: str) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 20 == 0


def site_dirs() -> list[Path]:
    """This interpreter's package directories: the site-packages / dist-packages entries of sys.path."""
    return sorted({Path(e).resolve() for e in sys.path
                   if Path(e).name in ("site-packages", "dist-packages") and Path(e).is_dir()})


# A line counts toward the stdlib-copy test when it is this long once stripped: short lines (`return x`, `else:`)
# occur in any Python file.
DISTINCTIVE_LINE = 30
GENERATED_LINE = 1000  # a file with a longer line is generated data (tables, blobs), not code to learn from


@dataclass(frozen=True)
class PackageCorpus:
    """Training-only source from installed packages. files: (root index:relative path, text) in the order taken."""
    files: list
    cap_bytes: int
    skipped_duplicates: int  # the same text as an earlier package file or as a stdlib file
    skipped_stdlib_copies: int  # half or more of its distinctive lines occur in the stdlib (backports, vendoring)
    skipped_generated: int


def package_files(roots: list[Path], stdlib: list[tuple[str, str]], cap_bytes: int,
                  max_bytes: int) -> PackageCorpus:
    """UTF-8 .py files under `roots`, taken in a fixed pseudo-random order (sha1 of the root-relative path, so no
    one package crowds out the rest) until their text reaches `cap_bytes`. Left out: files over `max_bytes`,
    generated files, exact duplicates, and copies of the stdlib, so that nothing held out leaks in through a
    backport or a vendored module."""
    candidates = []
    for index, root in enumerate(roots):
        for path in root.rglob("*.py"):
            rel = path.relative_to(root).as_posix()
            if "__pycache__" not in rel:
                candidates.append((hashlib.sha1(rel.encode()).digest(), index, rel, path))
    candidates.sort(key=lambda c: c[:3])
    seen = {hashlib.sha256(text.encode()).digest() for _, text in stdlib}
    stdlib_lines = {line for _, text in stdlib for line in distinctive_lines(text)}
    files, total, duplicates, copies, generated = [], 0, 0, 0, 0
    for _, index, rel, path in candidates:
        try:
            if path.stat().st_size > max_bytes:
                continue
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not text.strip():
            continue
        digest = hashlib.sha256(text.encode()).digest()
        lines = distinctive_lines(text)
        if digest in seen:
            duplicates += 1
        elif lines and 2 * sum(line in stdlib_lines for line in lines) >= len(lines):
            copies += 1
        elif any(len(line) > GENERATED_LINE for line in text.splitlines()):
            generated += 1
        elif total + len(text.encode()) > cap_bytes:
            break
        else:
            seen.add(digest)
            files.append((f"{index}:{rel}", text))
            total += len(text.encode())
    return PackageCorpus(files, cap_bytes, duplicates, copies, generated)


def distinctive_lines(text: str) -> list[str]:
    return [s for s in (line.strip() for line in text.splitlines()) if len(s) >= DISTINCTIVE_LINE]


def fingerprint(files: list[tuple[str, str]]) -> str:
    fp = hashlib.sha256()
    for rel, text in files:
        fp.update(rel.encode() + b"\0" + text.encode() + b"\0")
    return fp.hexdigest()


@dataclass(frozen=True)
class CodeRequest:
    """A request for a documented function or method, by signature and the first docstring line, and its source."""
    ask: str
    source: str  # dedented


def code_requests(files: list[tuple[str, str]], methods: bool = False) -> list[CodeRequest]:
    """One CodeRequest per documented public top-level function of `files` (or, with methods, per documented
    public method of their public top-level classes) of at most 1500 characters, in file order."""
    out = []
    for rel, text in files:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = SOURCE_LINE.findall(text)
        for owner, node in documented_defs(tree, methods):
            doc = ast.get_docstring(node)
            src = source_segment(lines, node)
            if not doc or not doc.strip() or not src or len(src) > 1500:
                continue
            summary = doc.strip().splitlines()[0].strip()
            if len(summary) < 8:
                continue
            args = ast.unparse(node.args)
            ask = (f"Write the method `{owner}.{node.name}({args})`: {summary}" if owner else
                   f"Write a Python function `{node.name}({args})`: {summary}")
            out.append(CodeRequest(ask, textwrap.dedent(src)))
    return out


# A line as the ast module splits source: ended by \r\n, \r or \n (str.splitlines would also split at \f and others)
SOURCE_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+")


def source_segment(lines: list[str], node: ast.AST) -> str:
    """ast.get_source_segment(text, node, padded=True) over SOURCE_LINE.findall(text), split once per file (the ast
    function splits the whole text again at every call, in pure Python). Padded: a method's first line keeps its
    indent."""
    first, last = node.lineno - 1, node.end_lineno - 1
    if first == last:
        return lines[first].encode()[node.col_offset:node.end_col_offset].decode()
    head = lines[first].encode()
    pad = "".join(c if c in "\f\t" else " " for c in head[:node.col_offset].decode())
    return "".join([pad + head[node.col_offset:].decode(), *lines[first + 1:last],
                    lines[last].encode()[:node.end_col_offset].decode()])


def chat_examples(files: list[tuple[str, str]], limit: int, seed: int, methods: bool = False) -> list[str]:
    """ChatML documents from code_requests: the ask, answered with the source in a code fence. Shuffled by the
    seed, the first `limit` kept."""
    out = [f"<|im_start|>user\n{r.ask}<|im_end|>\n<|im_start|>assistant\n```python\n{r.source}\n```<|im_end|>\n"
           for r in code_requests(files, methods)]
    rng = random.Random(seed + (1 if methods else 0))
    rng.shuffle(out)
    return out[:limit]


def documented_defs(tree: ast.Module, methods: bool):
    """(owner class name or "", FunctionDef) of the public top-level functions, or of the public methods of the
    public top-level classes."""
    for node in tree.body:
        if methods and isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            yield from ((node.name, m) for m in node.body
                        if isinstance(m, ast.FunctionDef) and not m.name.startswith("_"))
        elif not methods and isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            yield "", node


@dataclass(frozen=True)
class Corpus:
    """The stdlib split into training and held-out files, the training-only extras, the tokenizer and the
    encoded streams. Adding package files changes neither the held-out stream nor the tokenizer."""
    root: Path
    files: list  # every stdlib (relative path, text), sorted
    train_files: list
    held_files: list
    chats: list
    method_chats: list
    package_roots: list
    packages: PackageCorpus
    tok: object
    train_stream: torch.Tensor
    val_stream: torch.Tensor

    def summary(self) -> dict:
        """metrics.json -> corpus."""
        held_bytes = sum(len(t.encode()) for _, t in self.held_files)
        return {
            "root": str(self.root), "python": platform.python_version(), "files": len(self.files),
            "train_files": len(self.train_files), "held_out_files": len(self.held_files),
            "bytes": sum(len(t.encode()) for _, t in self.files), "sha256": fingerprint(self.files),
            "chat_examples": len(self.chats), "method_chat_examples": len(self.method_chats),
            "train_tokens": len(self.train_stream), "held_out_tokens": len(self.val_stream),
            "held_out_bytes_per_token": round(held_bytes / max(1, len(self.val_stream) - len(self.held_files)), 3),
            "packages": {"what": "training only: .py files of installed packages (never held out, not in the "
                                 "tokenizer's text); a file is named 'index of its root:path under the root'",
                         "roots": [str(r) for r in self.package_roots], "cap_bytes": self.packages.cap_bytes,
                         "files": len(self.packages.files),
                         "bytes": sum(len(t.encode()) for _, t in self.packages.files),
                         "sha256": fingerprint(self.packages.files),
                         "skipped_duplicates": self.packages.skipped_duplicates,
                         "skipped_stdlib_copies": self.packages.skipped_stdlib_copies,
                         "skipped_generated": self.packages.skipped_generated},
        }


def build_corpus(root: Path, package_roots: list[Path], p: Profile, seed: int, tok=None) -> Corpus:
    """tok: a tokenizer to encode with (an existing family's) instead of training one."""
    files = stdlib_files(root, p.max_files, p.max_file_bytes)
    train_files = [f for f in files if not is_held_out(f[0])]
    held_files = [f for f in files if is_held_out(f[0])]
    chats = chat_examples(train_files, p.max_chat, seed)
    method_chats = chat_examples(train_files, p.max_chat, seed, methods=True)
    packages = package_files(package_roots, files, p.package_bytes, p.max_file_bytes)
    train_docs = [t for _, t in train_files] + chats + method_chats + [t for _, t in packages.files]
    random.Random(seed).shuffle(train_docs)
    # The tokenizer learns from the same text as the first published family's (no method examples, no packages),
    # so it is the same tokenizer and held-out losses per token compare directly across families.
    tok = tok or train_tokenizer([t for _, t in train_files] + chats, p.vocab)
    return Corpus(root, files, train_files, held_files, chats, method_chats, list(package_roots), packages, tok,
                  encode_stream(tok, train_docs), encode_stream(tok, [t for _, t in held_files]))


def train_tokenizer(texts: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    # Encoding with special tokens prepends <|endoftext|>, the document separator seen before every training file.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{SPECIAL_TOKENS[0]} $A", pair=f"{SPECIAL_TOKENS[0]} $A {SPECIAL_TOKENS[0]} $B",
        special_tokens=[(SPECIAL_TOKENS[0], EOT_ID)])
    return tok


def load_tokenizer(path: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path / "tokenizer.json"))


def write_tokenizer(tok, path: Path, pretty: bool = True) -> None:
    tok.save(str(path / "tokenizer.json"), pretty=pretty)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[0],
        "pad_token": SPECIAL_TOKENS[0],
        "add_bos_token": True,
        "add_eos_token": False,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def encode_stream(tok, docs: list[str], chunk: int = 1024) -> torch.Tensor:
    """Documents joined into one token stream, each preceded by <|endoftext|>. Encoded in chunks of documents,
    without offsets where the tokenizers version can: tens of MB of text at once would hold gigabytes of them."""
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    parts = []
    for i in range(0, len(docs), chunk):
        for enc in encode(docs[i:i + chunk], add_special_tokens=False):
            parts.append(torch.tensor([EOT_ID, *enc.ids], dtype=torch.int32))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32)


def sample_windows(stream: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """`batch` random windows of `length` tokens (offsets drawn on the CPU generator, so runs are seeded)."""
    starts = torch.randint(0, len(stream) - length, (batch,), generator=gen)
    idx = starts[:, None] + torch.arange(length)[None]
    return stream[idx.to(stream.device)].long()


def fixed_windows(stream: torch.Tensor, count: int, length: int) -> torch.Tensor:
    n = min(count, len(stream) // length)
    return stream[: n * length].view(n, length).long()


# ----------------------------------------------------------------------------------------------------------------
# Training helpers


class Ctx:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.cuda else torch.autocast("cpu", enabled=False)


def start_run(device_name: str, seed: int, smoke: bool) -> Ctx:
    """The run's device (auto: CUDA when there is one), torch and random seeded, TF32 matmuls on CUDA, and one CPU
    thread for smoke sizes (tiny tensors: threads only add overhead)."""
    auto = device_name == "auto"
    ctx = Ctx(torch.device("cuda" if auto and torch.cuda.is_available() else ("cpu" if auto else device_name)))
    torch.manual_seed(seed)
    random.seed(seed)
    if ctx.cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if smoke:
        torch.set_num_threads(1)
    return ctx


def lr_at(step: int, progress: float, lr: float, warmup: int) -> float:
    """Linear warmup over `warmup` steps, then linear decay to zero at progress 1. Decaying to zero beats cosine
    to 10 % of the peak, and more so the more tokens per parameter (Bergsma et al. 2025, "Straight to Zero"):
    the demo target trains on about 15 tokens per parameter."""
    return lr * min((step + 1) / warmup, max(0.0, 1.0 - progress))


def train_loop(name, module, params, steps, lr, warmup, loss_fn, eval_fn, eval_every, ctx, max_seconds):
    """AdamW (0.9, 0.95), wd 0.1 on matrices, clip 1.0, lr_at's schedule over the larger of step progress and
    time progress against max_seconds; evaluates every eval_every steps and at the end, and keeps the weights of
    the best evaluation."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), fused=ctx.cuda)
    best, best_state, best_step, history = float("inf"), None, -1, []
    t0 = time.time()
    step, loss = 0, None

    def evaluate():
        nonlocal best, best_state, best_step
        module.eval()
        with torch.no_grad(), ctx.autocast():
            metrics = eval_fn()
        history.append({"step": step, "train_loss": round(loss.item(), 4), **metrics})
        log(f"{name} step {step}/{steps} train {loss.item():.4f} " +
            " ".join(f"{k} {v:.4f}" for k, v in metrics.items()) + f" ({time.time() - t0:.0f}s)")
        if metrics["val"] < best:
            best, best_step = metrics["val"], step
            best_state = {k: v.detach().clone() for k, v in module.state_dict().items()}

    while True:
        progress = max(step / steps, (time.time() - t0) / max_seconds)
        if progress >= 1.0 and step > 0:
            break
        rate = lr_at(step, progress, lr, warmup)
        for g in opt.param_groups:
            g["lr"] = rate
        module.train()
        with ctx.autocast():
            loss = loss_fn(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % eval_every == 0:
            evaluate()
    if step % eval_every:
        evaluate()
    stopped_by_time = step < steps
    if stopped_by_time:
        log(f"{name}: the {max_seconds}s cap ended the schedule at step {step} of {steps}")
    module.load_state_dict(best_state)
    module.eval()
    return {"steps_run": step, "best_step": best_step, "best_val": round(best, 4), "history": history,
            "seconds": round(time.time() - t0, 1), "stopped_by_time": stopped_by_time}


def soft_ce(student_logits, teacher_logits):
    """Cross-entropy against the teacher's softmax (= KL up to the teacher's entropy), per position."""
    return -(teacher_logits.float().softmax(-1) * student_logits.float().log_softmax(-1)).sum(-1)


@torch.no_grad()
def generate(model: Qwen3LM, prompts: torch.Tensor, n_new: int, ctx: Ctx, temperature=None, gen=None, pad=None):
    """prompts [B, P] -> generated ids [B, n_new]. temperature: None = greedy, or a per-row tensor [B] (0 = greedy).
    pad [B]: row b is left-padded with pad[b] filler tokens that no real token attends to and that do not count
    as positions (None: no padding)."""
    model.eval()
    B, P = prompts.shape
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    cache = model.new_cache(B, P + n_new, dtype, prompts.device)
    keys = torch.arange(P + n_new, device=prompts.device)

    def forward(ids, start):
        if pad is None:
            return model(ids, cache=cache, start=start)
        q = keys[start:start + ids.shape[1]]
        k = keys[:start + ids.shape[1]]
        real = (k[None] >= pad[:, None])[:, None, :]  # [B, 1, S]
        # a filler row attends to itself only, so that it stays finite; real rows never see fillers
        mask = (real & (k[None, :] <= q[:, None])[None]) | (k[None, :] == q[:, None])[None]
        return model(ids, cache=cache, start=start, positions=q[None] - pad[:, None], mask=mask[:, None])

    out = []
    with ctx.autocast():
        h, _ = forward(prompts, 0)
        for t in range(n_new):
            logits = model.logits(h[:, -1])
            nxt = logits.argmax(-1)
            if temperature is not None:
                probs = (logits / temperature.clamp(min=1e-4)[:, None]).softmax(-1)
                sampled = torch.multinomial(probs, 1, generator=gen).squeeze(1)
                nxt = torch.where(temperature > 0, sampled, nxt)
            out.append(nxt)
            if t + 1 < n_new:
                h, _ = forward(nxt[:, None], P + t)
    return torch.stack(out, dim=1)


def greedy_continuations(model: Qwen3LM, prompts: list[list[int]], n_new: int, ctx: Ctx, device) -> list[list[int]]:
    """Greedy continuations of prompts of any lengths in one left-padded batch, each cut after its first EOS (as
    the engine stops)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[EOT_ID] * (width - len(p)) + p for p in prompts], device=device)
    pad = torch.tensor([width - len(p) for p in prompts], device=device)
    outs = []
    for row in generate(model, ids, n_new, ctx, pad=pad).tolist():
        stop = next((j for j, t in enumerate(row) if t in EOS_IDS), len(row) - 1)
        outs.append(row[:stop + 1])
    return outs


# ----------------------------------------------------------------------------------------------------------------
# Writing checkpoints


def layer_fields(s: Shape, vocab: int) -> dict:
    """The config fields of Qwen3 decoder layers of shape `s` (a target's, or a DFlash drafter's)."""
    return {
        "vocab_size": vocab,
        "hidden_size": s.hidden,
        "intermediate_size": s.ffn,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
    }


def qwen3_config(s: Shape, vocab: int, **extra) -> dict:
    cfg = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **layer_fields(s, vocab),
        "initializer_range": 0.02,
        "rms_norm_eps": RMS_EPS,
        "rope_theta": ROPE_THETA,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": s.layers,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": EOT_ID,
        "eos_token_id": EOS_IDS,
        "pad_token_id": EOT_ID,
        "torch_dtype": "bfloat16",
    }
    cfg.update(extra)
    return cfg


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    out = {k: v.detach().to("cpu", torch.bfloat16 if v.is_floating_point() else v.dtype).contiguous()
           for k, v in sorted(tensors.items())}  # (EAGLE-3's d2t and t2d keep their integer and bool types)
    save_file(out, str(path), metadata={"format": "pt"})


def write_checkpoint(path: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """An HF-style checkpoint directory: model.safetensors and config.json."""
    path.mkdir(parents=True, exist_ok=True)
    save_safetensors(tensors, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_lm(path: Path, model: Qwen3LM, vocab: int, tok, extra_config=None, extra_tensors=None,
             pretty_tokenizer: bool = True) -> None:
    tensors = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    tensors.update(extra_tensors or {})
    write_checkpoint(path, tensors, qwen3_config(model.s, vocab, **(extra_config or {})))
    gen_cfg = {"bos_token_id": EOT_ID, "eos_token_id": EOS_IDS, "pad_token_id": EOT_ID}
    (path / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    write_tokenizer(tok, path, pretty_tokenizer)


def write_dflash(path: Path, drafter: DFlashDrafter, *, block_size: int, target_layers: int, taps, mask_id: int,
                 vocab: int) -> None:
    """The DFlash checkpoint outrider/speculative/dflash.py loads; its layers are Qwen3 layers of drafter.s, with
    this script's RoPE and norm constants."""
    write_checkpoint(path, drafter.state_dict(), {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": block_size,
        "num_target_layers": target_layers,
        "dflash_config": {"mask_token_id": mask_id, "target_layer_ids": list(taps)},
        **layer_fields(drafter.s, vocab),
        "rms_norm_eps": RMS_EPS,
        "rope_theta": ROPE_THETA,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_cache": False,
        "is_causal": False,
        "torch_dtype": "bfloat16",
    })


def write_eagle3(path: Path, head: Eagle3Head, *, taps, vocab: int) -> None:
    """The EAGLE-3 head in the EAGLE reference layout that outrider/speculative/eagle3.py (and vLLM, SGLang) load:
    a Llama layer config plus draft_vocab_size, target_hidden_size, norm_before_residual and the taps as layer
    inputs (`eagle_aux_hidden_state_layer_ids`: id j is the output of block j - 1)."""
    write_checkpoint(path, head.state_dict(), {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        **layer_fields(head.s, vocab),
        "num_hidden_layers": 1,
        "draft_vocab_size": len(head.d2t),
        "target_hidden_size": head.fc.in_features // len(taps),
        "norm_before_residual": head.midlayer.norm_before_residual,
        "eagle_config": {"use_aux_hidden_state": True,
                         "eagle_aux_hidden_state_layer_ids": [t + 1 for t in sorted(taps)]},
        "rms_norm_eps": RMS_EPS,
        "rope_theta": ROPE_THETA,
        "rope_scaling": None,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    })


def n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


# ----------------------------------------------------------------------------------------------------------------
# Offline acceptance simulation (greedy; exact for teacher-forced drafters on the target's own greedy output)


def walk(matches: list[list[bool]], start: int, end: int, k: int) -> list[int]:
    """Speculative greedy decode over positions: at committed last index n the drafts for n+1..n+k are accepted
    while they match. matches[n][j] says whether draft j+1 proposed at n equals token n+j+1. Returns the
    acceptance length of every full step (n + k <= end)."""
    taus, n = [], start
    while n + k <= end:
        m = 0
        while m < k and matches[n][m]:
            m += 1
        taus.append(m + 1)
        n += m + 1
    return taus


REPEAT_NGRAM = 8


def repeated_tokens(seq: list[int], start: int, n: int = REPEAT_NGRAM) -> int:
    """How many tokens from index `start` on end an n-gram already present earlier in seq."""
    seen, repeated = set(), 0
    for i in range(n - 1, len(seq)):
        gram = tuple(seq[i - n + 1:i + 1])
        repeated += i >= start and gram in seen
        seen.add(gram)
    return repeated


def summarize(taus: list[int]) -> dict:
    if not taus:
        return {"mean_tau": None, "steps": 0}
    return {"mean_tau": round(sum(taus) / len(taus), 3), "steps": len(taus)}


# ----------------------------------------------------------------------------------------------------------------
# Main


STAGES = ("target", "draft", "mtp", "dflash", "eagle3")
STAGE_DIRS = {"target": "target", "draft": "draft", "mtp": "target", "dflash": "dflash", "eagle3": "eagle3"}


def parse_stages(text: str) -> list[str]:
    """A comma-separated subset of STAGES, in the order they run."""
    names = [s for s in text.split(",") if s]
    unknown = [s for s in names if s not in STAGES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: stages are a comma-separated subset of {','.join(STAGES)}")
    return [s for s in STAGES if s in names]


def with_overrides(p: Profile, items: list[str]) -> Profile:
    """The profile with FIELD=VALUE items applied, VALUE a Python literal: a dict merges into the field's dict
    (stage_seconds), a tuple gives a Shape field its values."""
    fields = {f.name for f in dataclasses.fields(Profile)}
    changes = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or name not in fields:
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE with FIELD one of {', '.join(sorted(fields))}")
        value, current = ast.literal_eval(text), getattr(p, name)
        if isinstance(current, dict):
            value = {**current, **value}
        elif isinstance(current, Shape):
            value = Shape(*value)
        changes[name] = value
    return dataclasses.replace(p, **changes)


def load_lm(path: Path, device) -> Qwen3LM:
    """A Qwen3 LM this script wrote (a target, its MTP tensors left out, or a draft model), frozen, in float32."""
    from safetensors.torch import load_file

    cfg = json.loads((path / "config.json").read_text())
    model = Qwen3LM(Shape.from_config(cfg), cfg["vocab_size"])
    state = {k: v.float() for k, v in load_file(str(path / "model.safetensors")).items() if not k.startswith("mtp.")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing != ["lm_head.weight"] or unexpected:  # (tied to the embedding)
        raise ValueError(f"{path}: not a checkpoint of this script's Qwen3LM ({missing}, {unexpected})")
    return model.to(device).eval().requires_grad_(False)


def load_eagle3_head(path: Path, device="cpu") -> tuple[Eagle3Head, tuple[int, ...]]:
    """An EAGLE-3 head write_eagle3 wrote, frozen, in float32, and the target block outputs it taps."""
    from safetensors.torch import load_file

    cfg = json.loads((path / "config.json").read_text())
    state = {k: v.float() if v.is_floating_point() else v
             for k, v in load_file(str(path / "model.safetensors")).items()}
    taps = tuple(sorted(j - 1 for j in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]))
    head = Eagle3Head(Shape.from_config(cfg), cfg["target_hidden_size"], len(taps),
                      torch.arange(len(state["d2t"])) + state["d2t"], cfg["vocab_size"], cfg["norm_before_residual"])
    head.load_state_dict(state)
    return head.to(device).eval().requires_grad_(False), taps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "outrider" / "demo")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, a few steps, CPU-friendly (< 1 minute)")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    ap.add_argument("--stdlib", type=Path, default=None, help="override the corpus root (default: this interpreter's)")
    ap.add_argument("--site-packages", type=Path, action="append", default=None, metavar="DIR",
                    help="a package directory for the training-only part of the corpus (repeatable; default: this "
                         "interpreter's site-packages / dist-packages directories)")
    ap.add_argument("--reuse-target", type=Path, default=None,
                    help="load the target from a previous run's target/ directory instead of training it")
    ap.add_argument("--stages", type=parse_stages, default=list(STAGES), metavar="S[,S...]",
                    help=f"the stages to run, of {','.join(STAGES)} (default: all). Without target, --family "
                         "gives the target and tokenizer, and --out gets only the stages' directories")
    ap.add_argument("--family", type=Path, default=None,
                    help="an existing family directory (e.g. outrider/demo) to train drafter --stages against: its "
                         "target and tokenizer are used as they are, the corpus and the target's generations are "
                         "rebuilt as a full run builds them, and metrics.json and train_log.txt are the family's "
                         "with this run's stages added (drop-in replacements)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a profile field for a trial run (repeatable; VALUE a Python literal), e.g. "
                         "eagle3_train='(5, 64, 2e-3, 2)' or stage_seconds=\"{'eagle3': 30}\"")
    ap.add_argument("--pack", type=Path, default=None,
                    help="also write the family into this directory as tar files of at most 16 MiB each (what a "
                         "device run may return), plus copies of metrics.json and train_log.txt")
    args = ap.parse_args(argv)
    stages, family = args.stages, args.family
    if ("target" in stages) == (family is not None):
        ap.error("--family goes with --stages that leave out target (and those need it)")

    t_start = time.time()
    p = with_overrides(SMOKE if args.smoke else FULL, args.set)
    ctx = start_run(args.device, args.seed, args.smoke)
    device = ctx.device
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if family:  # the family's log goes on with this run's lines
        (out / "train_log.txt").write_text((family / "train_log.txt").read_text())
    log_to(out / "train_log.txt", append=family is not None)
    run: dict = {"seed": args.seed, "profile": "smoke" if args.smoke else "full", "device": str(device),
                 "torch": torch.__version__, "python": platform.python_version(),
                 "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:]))}
    if args.set:
        run["profile_overrides"] = args.set
    if ctx.cuda:
        run["gpu"] = torch.cuda.get_device_name(0)
    # A full run's metrics start with the run; a run against a family adds its stages (each with the run) to the
    # family's metrics.
    metrics: dict = json.loads((family / "metrics.json").read_text()) if family else dict(run)
    timed = run if family else metrics  # where "seconds" goes
    if family:
        run["family"] = str(family)
        log(f"--- stages {','.join(stages)} against the family in {family}: {run['command']}")
    stage_t = {}
    pack_parts = {f"demo-{d}.tar": (d,) for d in dict.fromkeys(STAGE_DIRS[s] for s in stages)} if family else \
        PACK_PARTS

    def save_metrics():
        """Writes metrics.json and, with --pack, packs what exists so far: a run stopped from outside (a device
        call's time limit) still returns every stage it finished."""
        timed["seconds"] = {**stage_t, "total": round(time.time() - t_start, 1)}
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        if args.pack:
            return pack(out, args.pack, pack_parts)
        return []

    def drafter_done(name: str, t0: float, res: dict, fields: dict) -> None:
        """A drafter stage's end: its metrics (the stage's fields, the training loop's results with the history
        last, and with --family this run's record), its time, and metrics.json saved (and packed)."""
        metrics[name] = {**fields, **{k: v for k, v in res.items() if k != "history"}, "history": res["history"],
                         **({"run": run} if family else {})}
        stage_t[name] = round(time.time() - t0, 1)
        save_metrics()

    # ---- data + tokenizer (a family's own tokenizer: ids must be its target's)
    t0 = time.time()
    root = args.stdlib or Path(sysconfig.get_paths()["stdlib"])
    family_tok = load_tokenizer(family / "target") if family else None
    corpus = build_corpus(root, args.site_packages or site_dirs(), p, args.seed, tok=family_tok)
    tok, train_stream, val_stream, held_files = corpus.tok, corpus.train_stream, corpus.val_stream, corpus.held_files
    vocab = tok.get_vocab_size()
    summary = corpus.summary()
    if family:
        was = metrics.get("corpus", {})
        run["corpus_matches_family"] = same = (summary["sha256"] == was.get("sha256") and
                                               summary["packages"]["sha256"] == was.get("packages", {}).get("sha256"))
        if not same:
            log(f"warning: this corpus (stdlib {summary['sha256'][:8]}, packages "
                f"{summary['packages']['sha256'][:8]}) is not the family's (stdlib {was.get('sha256', '?')[:8]}, "
                f"packages {was.get('packages', {}).get('sha256', '?')[:8]}): another interpreter or packages")
    else:
        metrics["corpus"] = summary
        metrics["vocab_size"] = vocab
    stage_t["data"] = round(time.time() - t0, 1)
    log(f"corpus {summary} vocab {vocab} ({stage_t['data']}s)")

    train_stream_d = train_stream.to(device)
    val = fixed_windows(val_stream, p.val_windows, p.seq + 1).to(device)
    val_small = val[: max(8, min(64, len(val)))]

    def lm_eval(model, windows):
        tot, correct, n = 0.0, 0, 0
        for i in range(0, len(windows), 32):
            x = windows[i:i + 32]
            h, _ = model(x[:, :-1])
            lg = model.logits(h)
            tot += F.cross_entropy(lg.view(-1, vocab), x[:, 1:].reshape(-1), reduction="sum").item()
            correct += (lg.argmax(-1) == x[:, 1:]).sum().item()
            n += x[:, 1:].numel()
        return {"val": tot / n, "top1": correct / n}

    # ---- target
    if family:
        target = load_lm(family / "target", device)
        log(f"target from {family / 'target'} ({n_params(target)} parameters)")
    else:
        t0 = time.time()
        # unigram baseline on the same held-out targets
        counts = torch.bincount(train_stream.long(), minlength=vocab).double() + 1.0
        logp = (counts / counts.sum()).log()
        unigram = -logp[val[:, 1:].reshape(-1).cpu()].mean().item()
        torch.manual_seed(args.seed + 1)
        target = Qwen3LM(p.target, vocab, p.dropout).to(device)
        steps, batch, lr, warmup = p.target_train
        g = torch.Generator().manual_seed(args.seed + 11)

        def target_loss(step):
            x = sample_windows(train_stream_d, batch, p.seq + 1, g)
            h, _ = target(x[:, :-1])
            return F.cross_entropy(target.logits(h).view(-1, vocab), x[:, 1:].reshape(-1))

        if args.reuse_target:
            target = load_lm(args.reuse_target, device)
            res = {"reused": str(args.reuse_target), "history": []}
        else:
            res = train_loop("target", target, list(target.parameters()), steps, lr, warmup, target_loss,
                             lambda: lm_eval(target, val_small), p.eval_every, ctx, p.stage_seconds["target"])
        target.requires_grad_(False)
        with torch.no_grad(), ctx.autocast():
            final = lm_eval(target, val)
        bits_per_byte = final["val"] / math.log(2) / metrics["corpus"]["held_out_bytes_per_token"]
        metrics["target"] = {"params": n_params(target), "shape": asdict(p.target), "steps_planned": steps,
                             "batch": batch, "seq": p.seq, "lr": lr, "schedule": "linear warmup, linear decay to 0",
                             "dropout": p.dropout, **{k: v for k, v in res.items() if k != "history"},
                             "held_out_loss": round(final["val"], 4), "held_out_top1": round(final["top1"], 4),
                             "held_out_bits_per_byte": round(bits_per_byte, 4),
                             "held_out_tokens_scored": int(val[:, 1:].numel()),
                             "unigram_loss": round(unigram, 4), "history": res["history"]}
        stage_t["target"] = round(time.time() - t0, 1)
        log(f"target held-out loss {final['val']:.4f} (top-1 {final['top1']:.3f}, {bits_per_byte:.3f} bits/byte) "
            f"vs unigram {unigram:.4f}")
        write_lm(out / "target", target, vocab, tok)  # rewritten with the MTP tensors below
        texts = greedy_continuations(target, [tok.encode(s).ids for s in SAMPLE_PROMPTS], p.eval_new, ctx, device)
        metrics["samples"] = [{"prompt": s, "completion": tok.decode(t, skip_special_tokens=False)}
                              for s, t in zip(SAMPLE_PROMPTS, texts)]
        for sample in metrics["samples"]:
            log(f"T = 0 sample:\n{sample['prompt']}{sample['completion']}")
        save_metrics()
    drafters = [s for s in stages if s != "target"]

    # ---- target-generated data (greedy, plus 25 % sampled at T = 0.8) for all drafters
    t0 = time.time()
    gg = torch.Generator().manual_seed(args.seed + 21)
    g_sample = torch.Generator(device=device).manual_seed(args.seed + 22)
    gen_seqs = []
    for i in range(0, p.gen_prompts if drafters else 0, p.gen_batch):
        b = min(p.gen_batch, p.gen_prompts - i)
        prompts = sample_windows(train_stream_d, b, p.gen_prompt_len, gg)
        temp = torch.where(torch.rand(b, generator=gg) < 0.25, 0.8, 0.0).to(device)
        new = generate(target, prompts, p.gen_new, ctx, temperature=temp, gen=g_sample)
        gen_seqs.append(torch.cat([prompts, new], 1).cpu())
    gen_seqs = torch.cat(gen_seqs) if gen_seqs else torch.zeros(0, p.gen_prompt_len + p.gen_new, dtype=torch.long)
    gen_stream = torch.cat([torch.zeros(len(gen_seqs), 1, dtype=torch.long), gen_seqs], 1).reshape(-1)
    gen_stream = gen_stream.to(torch.int32).to(device)  # each sequence preceded by <|endoftext|>
    # held-out generations for drafter validation: greedy continuations of held-out prefixes
    vprompts = fixed_windows(val_stream, max(8, p.val_windows // 4), p.gen_prompt_len).to(device)
    vgen_windows = torch.cat([vprompts, generate(target, vprompts, p.gen_new, ctx)], 1)  # [n, P + new]
    generated = {"sequences": len(gen_seqs), "tokens": int(gen_seqs.numel()), "prompt_len": p.gen_prompt_len,
                 "new_tokens": p.gen_new, "sampled_fraction": 0.25, "temperature": 0.8}
    if family:
        run["generated"] = generated
    else:
        metrics["generated"] = generated
    stage_t["generate"] = round(time.time() - t0, 1)
    log(f"generated {gen_seqs.numel()} tokens ({stage_t['generate']}s)")

    def drafter_batch(batch_size, gen):
        half = batch_size // 2
        return torch.cat([sample_windows(train_stream_d, half, p.seq, gen),
                          sample_windows(gen_stream, batch_size - half, p.seq, gen)])

    def target_view(x):
        with torch.no_grad():
            h, tapped = target(x)
        return h, tapped

    def chained_stage(step_losses, weights, batch_size, gen):
        """train_loop's loss and eval functions for a chain head: step_losses(ids) -> ([loss per step], [draft
        agreement with the target's argmax per step]), the loss weighted over the steps."""

        def loss_fn(step):
            losses, _ = step_losses(drafter_batch(batch_size, gen))
            return sum(w * l for w, l in zip(weights, losses))

        def eval_fn():
            losses, accs = step_losses(vgen_windows)
            return {"val": sum(w * l.item() for w, l in zip(weights, losses)),
                    **{f"agree{k + 1}": a.item() for k, a in enumerate(accs)}}

        return loss_fn, eval_fn

    # ---- draft model: forward KL to the target + 0.2 CE
    if "draft" in stages:
        t0 = time.time()
        torch.manual_seed(args.seed + 2)
        draft = Qwen3LM(p.draft, vocab, 0.0).to(device)
        steps, batch, lr, warmup = p.draft_train
        gd = torch.Generator().manual_seed(args.seed + 12)

        def draft_loss(step):
            x = drafter_batch(batch, gd)
            th, _ = target_view(x)
            dh, _ = draft(x[:, :-1])
            dl = draft.logits(dh)
            kd = soft_ce(dl, target.logits(th[:, :-1])).mean()
            ce = F.cross_entropy(dl.reshape(-1, vocab), x[:, 1:].reshape(-1))
            return kd + 0.2 * ce

        def draft_eval():
            x = vgen_windows
            th, _ = target(x)
            tl = target.logits(th[:, :-1])
            dh, _ = draft(x[:, :-1])
            dl = draft.logits(dh)
            lm = lm_eval(draft, val_small)
            return {"val": soft_ce(dl, tl).mean().item(),
                    "agree": (dl.argmax(-1) == tl.argmax(-1)).float().mean().item(),
                    "code_loss": lm["val"]}

        res = train_loop("draft", draft, list(draft.parameters()), steps, lr, warmup, draft_loss, draft_eval,
                         p.eval_every, ctx, p.stage_seconds["draft"])
        draft.requires_grad_(False)
        with torch.no_grad(), ctx.autocast():
            dfinal = lm_eval(draft, val)
        # The draft's tokenizer copy only serves the engine's vocabulary check (outrider/speculative/compat.py):
        # compact JSON, 156 KB less of the demo's 20 MB.
        write_lm(out / "draft", draft, vocab, tok, pretty_tokenizer=False)
        drafter_done("draft", t0, res, {"params": n_params(draft), "shape": asdict(p.draft), "batch": batch,
                                        "lr": lr, "loss": "forward KL to target + 0.2 CE",
                                        "held_out_loss": round(dfinal["val"], 4)})

    # ---- MTP: recursive K steps, weights beta^(k-1) normalised, soft CE to the target's next-token distribution
    K = p.mtp_steps
    if "mtp" in stages:
        t0 = time.time()
        torch.manual_seed(args.seed + 3)
        mtp = MTPHead(p.target, 0.0).to(device)
        wk = step_weights(p.mtp_beta, K)
        steps, batch, lr, warmup = p.mtp_train
        gm = torch.Generator().manual_seed(args.seed + 13)

        def mtp_step_losses(x):
            th, _ = target_view(x)
            outs = mtp.unroll(target, th, x, K)
            N = x.shape[1] - 1 - K
            losses, accs = [], []
            for k, y in enumerate(outs, start=1):
                ml = target.logits(y)
                tl = target.logits(th[:, k:k + N])  # target at index i+k predicts t_{i+k+1}
                losses.append(soft_ce(ml, tl).mean())
                accs.append((ml.argmax(-1) == tl.argmax(-1)).float().mean())
            return losses, accs

        mtp_loss, mtp_eval = chained_stage(mtp_step_losses, wk, batch, gm)
        res = train_loop("mtp", mtp, list(mtp.parameters()), steps, lr, warmup, mtp_loss, mtp_eval,
                         p.eval_every, ctx, p.stage_seconds["mtp"])
        mtp.requires_grad_(False)
        mtp_tensors = {f"mtp.{k}": v for k, v in mtp.state_dict().items()}
        write_lm(out / "target", target, vocab, tok,
                 extra_config={"mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False},
                 extra_tensors=mtp_tensors)
        drafter_done("mtp", t0, res, {
            "params": n_params(mtp), "layout": "qwen3_5 (mtp.fc / pre_fc_norm_* / layers.0 / norm)",
            "hidden_input": "target post-final-norm hidden; recursion feeds post-mtp.norm output",
            "train_steps_K": K, "step_weights": [round(w, 3) for w in wk], "batch": batch, "lr": lr})

    # ---- DFlash: block diffusion on the frozen target's tapped hidden states
    Bk = p.block_size
    if "dflash" in stages:
        t0 = time.time()
        torch.manual_seed(args.seed + 4)
        dflash = DFlashDrafter(p.dflash, len(p.dflash_taps), 0.0).to(device)
        dw = dflash_weights(Bk, p.dflash_gamma, device)
        steps, batch, lr, warmup = p.dflash_train
        gf = torch.Generator().manual_seed(args.seed + 14)

        def train_step_loss(step):
            x = drafter_batch(batch, gf)
            anchors = random_anchors(batch, p.seq, p.dflash_anchors, Bk, gf, device)
            return dflash_loss(*dflash_outputs(dflash, target, x, anchors, Bk, p.dflash_taps), dw)

        def dflash_eval():
            x = vgen_windows
            ge = torch.Generator().manual_seed(1234)
            anchors = random_anchors(len(x), x.shape[1], min(p.dflash_anchors, (x.shape[1] - Bk) // 2), Bk, ge,
                                     device)
            return dflash_scores(*dflash_outputs(dflash, target, x, anchors, Bk, p.dflash_taps), dw)

        res = train_loop("dflash", dflash, list(dflash.parameters()), steps, lr, warmup, train_step_loss,
                         dflash_eval, p.eval_every, ctx, p.stage_seconds["dflash"])
        dflash.requires_grad_(False)
        write_dflash(out / "dflash", dflash, block_size=Bk, target_layers=target.s.layers, taps=p.dflash_taps,
                     mask_id=MASK_ID, vocab=vocab)
        drafter_done("dflash", t0, res, {
            "params": n_params(dflash), "shape": asdict(p.dflash), "block_size": Bk,
            "target_layer_ids": list(p.dflash_taps), "mask_token_id": MASK_ID, "gamma": p.dflash_gamma,
            "anchors_per_seq": p.dflash_anchors, "batch": batch, "lr": lr})

    # ---- EAGLE-3: fc over three target taps, one layer chained on its own output (training-time test), a reduced
    # vocabulary; soft CE to the target's distribution on that vocabulary, weights beta^(k-1) normalised
    K3 = p.eagle3_steps
    if "eagle3" in stages:
        t0 = time.time()
        torch.manual_seed(args.seed + 5)
        ids3 = draft_vocabulary([train_stream, gen_stream], vocab, p.eagle3_vocab)
        eagle3 = Eagle3Head(p.eagle3, target.s.hidden, len(p.eagle3_taps), ids3, vocab).to(device)
        w3 = step_weights(p.eagle3_beta, K3)
        steps, batch, lr, warmup = p.eagle3_train
        g3 = torch.Generator().manual_seed(args.seed + 15)

        def eagle3_step_losses(x):
            scores = [eagle3_scores(eagle3, *o) for o in eagle3_outputs(eagle3, target, x, p.eagle3_taps, K3)]
            return [s for s, _ in scores], [a for _, a in scores]

        eagle3_loss, eagle3_eval = chained_stage(eagle3_step_losses, w3, batch, g3)
        res = train_loop("eagle3", eagle3, list(eagle3.parameters()), steps, lr, warmup, eagle3_loss, eagle3_eval,
                         p.eval_every, ctx, p.stage_seconds["eagle3"])
        eagle3.requires_grad_(False)
        covered = {name: round(eagle3.t2d[stream.long()].float().mean().item(), 4)
                   for name, stream in (("corpus", train_stream_d), ("generated", gen_stream))}
        write_eagle3(out / "eagle3", eagle3, taps=p.eagle3_taps, vocab=vocab)
        log(f"eagle3 draft vocabulary of {p.eagle3_vocab} covers {covered}")
        drafter_done("eagle3", t0, res, {
            "params": n_params(eagle3), "shape": asdict(p.eagle3),
            "layout": "EAGLE reference (LlamaForCausalLMEagle3: fc / midlayer / norm / lm_head / d2t / t2d; the "
                      "target's embedding)",
            "target_layer_ids": list(p.eagle3_taps),
            "eagle_aux_hidden_state_layer_ids": [t + 1 for t in p.eagle3_taps],
            "draft_vocab_size": p.eagle3_vocab, "draft_vocab_covers": covered,
            "hidden_input": "fc(taps) at the first step; the chain feeds the pre-norm output back",
            "train_steps_K": K3, "step_weights": [round(w, 3) for w in w3], "batch": batch, "lr": lr})

    # ---- offline acceptance proxy on held-out prompts (greedy; exact under teacher forcing)
    t0 = time.time()
    if family:  # the published prompts
        prompts = json.loads((family / "eval_prompts.json").read_text())
    else:
        prompts = make_eval_prompts(held_files, p.eval_prompts, args.seed)
        (out / "eval_prompts.json").write_text(json.dumps(prompts, indent=1) + "\n")
    names = {"draft": [f"draft_k{k}" for k in (3, 4, 5)], "mtp": [f"mtp_k{k}" for k in range(1, K + 1)],
             "dflash": ["dflash"], "eagle3": [f"eagle3_k{k}" for k in range(1, K3 + 1)]}
    taus = {n: [] for s in drafters for n in names[s]}
    per_kind = {kind: {n: [] for n in taus} for kind in ("def", "window")}
    prompt_ids = [tok.encode(pr["prompt"]).ids for pr in prompts]
    continuations = greedy_continuations(target, prompt_ids, p.eval_new, ctx, device)
    repeated = sum(repeated_tokens(ids + gen, len(ids)) for ids, gen in zip(prompt_ids, continuations))
    taps_needed = tuple(sorted(set(p.dflash_taps) | set(p.eagle3_taps)))
    with torch.no_grad(), ctx.autocast():
        for pr, ids, gen_ids in zip(prompts, prompt_ids, continuations):
            toks = ids + gen_ids
            seq = torch.tensor([toks], device=device)
            P, L = len(ids), len(toks)
            end = L - 1  # last index
            if L - P < 4:
                continue
            kind = per_kind[pr["kind"]]

            def record(name, pred, k):
                # pred(n, j): the token drafter proposes for index n+j+1 when the last committed index is n
                m = [[n + j + 1 <= end and pred(n, j) == toks[n + j + 1] for j in range(k)] for n in range(L)]
                tk = walk(m, P, end, k)
                taus[name] += tk
                kind[name] += tk

            th, tapped = target(seq, taps=taps_needed)
            taps = dict(zip(taps_needed, tapped))  # concatenated in layer order, as in training and serving

            def chain_record(kind_name, preds, steps):
                # chain index i = n-1; step j+1 predicts index n+j+1
                for k in range(1, steps + 1):
                    record(f"{kind_name}_k{k}", lambda n, j: preds[j][n - 1] if n - 1 < len(preds[j]) else -1, k)

            if "draft" in stages:
                # teacher-forced argmax at index i predicts i+1 (exact: accepted drafts = target tokens)
                dh, _ = draft(seq)
                da = draft.logits(dh).argmax(-1)[0].tolist()
                for k in (3, 4, 5):
                    record(f"draft_k{k}", lambda n, j: da[n + j], k)
            if "mtp" in stages:
                chain_record("mtp", [target.logits(y).argmax(-1)[0].tolist()
                                     for y in mtp.unroll(target, th, seq, K)], K)
            if "eagle3" in stages:
                taps3 = torch.cat([taps[t] for t in sorted(p.eagle3_taps)], -1)
                chain_record("eagle3", [eagle3.drafts(y)[0].tolist() for y in eagle3.unroll(target, taps3, seq, K3)],
                             K3)
            if "dflash" in stages and L - Bk >= 1:
                # one block per anchor a in [1, L - Bk]; slot j+1 predicts index a+j+1
                anchors = torch.arange(1, L - Bk + 1, device=device)[None]
                block_ids, pos, mask = dflash_block(seq, anchors, Bk)
                hid = dflash(torch.cat([taps[t] for t in sorted(p.dflash_taps)], -1),
                             target.model.embed_tokens(block_ids), pos, mask)
                fa = target.logits(hid).argmax(-1)[0].view(-1, Bk).tolist()  # [anchor - 1][slot]
                record("dflash", lambda n, j: fa[n - 1][j + 1] if 1 <= n <= L - Bk else -1, Bk - 1)
    proxy = {
        "what": "offline greedy acceptance length tau (accepted drafts + 1) simulated with this script's own "
                "model code on the target's greedy continuations of held-out prompts (eval_prompts.json, "
                f"{p.eval_new} new tokens, stop at EOS); full-length steps only. Exact for greedy verification "
                "up to numerics; NOT the engine's measurement.",
        "all": {n: summarize(v) for n, v in taus.items()},
        **{kind: {n: summarize(v) for n, v in d.items()} for kind, d in per_kind.items()},
        "dflash_block_size": Bk,
        "greedy_repeated_share": round(repeated / max(1, sum(map(len, continuations))), 3),
        "greedy_repeated_share_what": f"share of the target's generated tokens that end a {REPEAT_NGRAM}-gram "
                                      "already present earlier in the prompt or continuation (greedy loops)",
    }
    if family:  # the family's numbers for the other drafters stay
        for part in ("all", "def", "window"):
            metrics.setdefault("acceptance_proxy", {}).setdefault(part, {}).update(proxy[part])
    else:
        metrics["acceptance_proxy"] = proxy
    stage_t["acceptance_proxy"] = round(time.time() - t0, 1)
    log("acceptance proxy: " + json.dumps(proxy["all"]))

    # the family's files as they will be: this run's directories, and the family's for the others
    sizes = {}
    for d in ("target", "draft", "dflash", "eagle3"):
        base = out if (out / d).is_dir() or not family else family
        sizes.update({f"{d}/{f.name}": f.stat().st_size for f in sorted((base / d).glob("*")) if f.is_file()})
    metrics["files"] = sizes
    metrics["total_bytes"] = sum(sizes.values())
    log(f"wrote {out} ({metrics['total_bytes'] / 1e6:.2f} MB of model files with the family's) in "
        f"{time.time() - t_start:.0f}s")
    for path in save_metrics():
        log(f"packed {path} ({path.stat().st_size / 1e6:.2f} MB)")
    return 0


# The family as the device returns it: tar files relative to outrider/demo, none over the 16 MiB a file may be.
PACK_PARTS = {"demo-target.tar": ("target",),
              "demo-drafters.tar": ("draft", "dflash", "eagle3", "metrics.json", "eval_prompts.json",
                                    "train_log.txt")}
PACK_FILE_LIMIT = 16 << 20


def pack(out: Path, dest: Path, parts: dict = PACK_PARTS) -> list[Path]:
    """Write `parts` (tar file name -> members; default PACK_PARTS, the family) of `out` into `dest`, and plain
    copies of metrics.json and train_log.txt to read without unpacking. Members not written yet are left out (a
    part with none is skipped), and each file replaces its previous version in one rename, so a run killed while
    packing leaves the last complete pack. Raises if a part is over PACK_FILE_LIMIT."""
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for name, members in parts.items():
        present = [m for m in members if (out / m).exists()]
        if present:
            with tarfile.open(dest / f".{name}.partial", "w") as tar:
                for member in present:
                    tar.add(out / member, arcname=member)
            written.append((dest / f".{name}.partial").replace(dest / name))
    for name in ("metrics.json", "train_log.txt"):
        (dest / f".{name}.partial").write_bytes((out / name).read_bytes())
        written.append((dest / f".{name}.partial").replace(dest / name))
    too_big = [f"{p.name}: {p.stat().st_size} bytes" for p in written if p.stat().st_size > PACK_FILE_LIMIT]
    if too_big:
        raise RuntimeError(f"over the {PACK_FILE_LIMIT} bytes a returned file may have: {', '.join(too_big)}")
    return written


def make_eval_prompts(held_files, per_kind: int, seed: int) -> list[dict]:
    """Held-out prompts: `def` lines (dedented, no newline, like the README's `def fibonacci(n):`) and ~400-char
    windows of held-out files ending at a line break."""
    rng = random.Random(seed + 99)
    defs, windows = [], []
    for rel, text in held_files:
        lines = text.splitlines(keepends=True)
        for line in lines:
            s = line.strip()
            if re.match(r"def [A-Za-z_]\w*\(.*\)( -> .+)?:$", s) and len(s) < 80:
                defs.append({"kind": "def", "file": rel, "prompt": s})
        if len(lines) > 20:
            for _ in range(2):
                i = rng.randrange(0, len(lines) - 10)
                chunk = ""
                while i < len(lines) and len(chunk) < 400:
                    chunk += lines[i]
                    i += 1
                if chunk.strip():
                    windows.append({"kind": "window", "file": rel, "prompt": chunk})
    rng.shuffle(defs)
    rng.shuffle(windows)
    # A short file can yield the same window twice (the published eval_prompts.json has one such pair, indices 35
    # and 36). Dropping repeats after the shuffle keeps every other choice of this seed as it was.
    def first_of_each(items):
        seen = set()
        return [x for x in items if not (x["prompt"] in seen or seen.add(x["prompt"]))]

    return first_of_each(defs)[:per_kind] + first_of_each(windows)[:per_kind]


if __name__ == "__main__":
    sys.exit(main())
