"""outrider's model modules run the way training needs them: whole sequences in a batch [B, T], dense attention
(causal, or an explicit mask, optionally over extra keys in front or a dense KV cache), autograd, no paged cache.

The parameters are the server modules' own (outrider.models.decoder's decoder layers with their packed qkv_proj and
gate_up_proj, speculative/mtp.py's QwenMTP, dflash.py's DFlashModel, eagle3.py's Eagle3Model), so a trained module
is loaded by the server as it is. The maths is outrider.kernels.ops' torch reference (the semantics its Triton
kernels match), called directly: those kernels have no backward, and the dispatching ops would pick them on CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from outrider.kernels.ops import torch_qk_norm_rope, torch_rms_norm, torch_silu_mul


def norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An outrider RMSNorm module applied to x."""
    return torch_rms_norm(x, module.weight, module.eps)[0]


def linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, module.weight, module.bias)


def qkv(attn: nn.Module, x: torch.Tensor, positions: torch.Tensor,
        inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An outrider Attention's q [B, Hq, T, D], k and v [B, Hkv, T, D] for x [B, T, in], q and k normed (Qwen3)
    and roped at positions [T] or [B, T]."""
    B, T, _ = x.shape
    q, k, v = attn.split_qkv(linear(attn.qkv_proj, x).reshape(B * T, -1))
    weights = (attn.q_norm.weight, attn.k_norm.weight) if attn.qk_norm else (None, None)
    q, k = torch_qk_norm_rope(q, k, positions.expand(B, T).reshape(-1), inv_freq, *weights, attn.eps)
    return tuple(t.reshape(B, T, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))


def attend(attn: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
           causal: bool = False) -> torch.Tensor:
    """o_proj(softmax(q k^T * scale) v) [B, T, H]; mask [B or 1, 1, T, keys] (True = attend)."""
    rep = attn.n_heads // attn.n_kv_heads
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                       is_causal=causal and mask is None, scale=attn.scale)
    B, _, T, _ = o.shape
    return linear(attn.o_proj, o.transpose(1, 2).reshape(B, T, -1))


def mlp(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An outrider GatedMLP (SwiGLU, gate and up packed)."""
    return linear(module.down_proj, torch_silu_mul(*linear(module.gate_up_proj, x).chunk(2, dim=-1)))


def block(layer: nn.Module, x: torch.Tensor, xn: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, *,
          causal: bool = True, mask: torch.Tensor | None = None,
          prefix_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
          cache: tuple[torch.Tensor, torch.Tensor] | None = None,
          start: int = 0) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """A decoder layer (self_attn, mlp, post_attention_layernorm) over the residual stream x, its attention reading
    xn. prefix_kv: keys and values in front of the layer's own (a chain's earlier steps, DFlash's context). cache:
    dense (k, v) buffers [B, Hkv, max_len, D], written at [start, start + T) and attended over [0, start + T).
    Returns (the stream after the layer, this call's own (k, v))."""
    q, k, v = qkv(layer.self_attn, xn, positions, inv_freq)
    own = (k, v)
    if cache is not None:
        T = x.shape[1]
        cache[0][:, :, start:start + T] = k.to(cache[0].dtype)
        cache[1][:, :, start:start + T] = v.to(cache[1].dtype)
        k, v = cache[0][:, :, :start + T], cache[1][:, :, :start + T]
        causal = T > 1  # a prefill from 0 is causal; one decode token sees everything before it
    if prefix_kv is not None:
        k = torch.cat([prefix_kv[0].to(k.dtype), k], dim=2)
        v = torch.cat([prefix_kv[1].to(v.dtype), v], dim=2)
    h = x + attend(layer.self_attn, q.to(k.dtype), k, v, mask=mask, causal=causal)
    return h + mlp(layer.mlp, norm(layer.post_attention_layernorm, h)), own


def decoder_layer(layer: nn.Module, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                  **attention) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """An outrider DecoderLayer (pre-norm): block over x with input_layernorm(x)."""
    return block(layer, x, norm(layer.input_layernorm, x), positions, inv_freq, **attention)


class DenseLM:
    """An outrider CausalLM (the shared decoder: Llama, Qwen2, Qwen3, ...) run densely. Holds no parameters of its own: train, save
    and load `model`."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    @property
    def config(self):
        return self.model.config

    @property
    def inv_freq(self) -> torch.Tensor:
        return self.model.model.rotary_emb.inv_freq

    def __call__(self, ids: torch.Tensor, taps: tuple[int, ...] = (), cache: list | None = None, start: int = 0,
                 positions: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """ids [B, T] -> (post-final-norm hidden [B, T, H], [outputs of the decoder layers in `taps`]). positions
        [B, T] and mask [B, 1, T, keys] (True = attend) serve left-padded batches; by default row positions are
        start..start+T-1 and attention is causal. cache: new_cache's buffers."""
        T = ids.shape[1]
        pos = torch.arange(start, start + T, device=ids.device) if positions is None else positions
        h = self.embed(ids)
        tapped = []
        for i, layer in enumerate(self.model.model.layers):
            h, _ = decoder_layer(layer, h, pos, self.inv_freq, mask=mask, cache=None if cache is None else cache[i],
                                 start=start)
            if i in taps:
                tapped.append(h)
        return norm(self.model.model.norm, h), tapped

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of post-norm hidden states."""
        return linear(self.model.lm_head, hidden).float()

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device) -> list:
        cfg = self.config
        shape = (batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                for _ in range(cfg.num_hidden_layers)]


def unroll_chain(step, hidden: torch.Tensor, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Teacher-forced chain drafting over a whole sequence with the attention pattern of serving: one decoder layer
    fed its own output back (MTP and EAGLE-3 heads; outrider/speculative/chain.py).

    hidden: the head's first-step hidden input [B, >= N, H]; ids [B, T]. Index i (0 <= i < N = T-1-steps) at step
    k (1-based) reads token t_{i+k} and, for k = 1, hidden_i (for k > 1, what its step k-1 fed back), sits at
    position i+k-1 and predicts t_{i+k+1}. A step-k query sees the step-1 keys of indices <= i (what the head's KV
    cache holds for committed tokens) plus its own chain's step 2..k keys.
    step(tokens [B, N], hidden [B, N, H], positions [N], **attention) -> (what is fed back [B, N, H], (k, v)) runs
    the head once; `attention` is block's keywords. Returns the fed-back states of each step."""
    N = ids.shape[1] - 1 - steps
    prev = hidden[:, :N]
    chain_k, chain_v, outs = [], [], []
    causal = torch.ones(N, N, dtype=torch.bool, device=ids.device).tril()
    eye = torch.eye(N, dtype=torch.bool, device=ids.device)
    for k in range(1, steps + 1):
        if k == 1:
            attention = {"causal": True}
        else:
            attention = {"causal": False, "mask": torch.cat([causal] + [eye] * (k - 1), dim=1),
                         "prefix_kv": (torch.cat(chain_k, 2), torch.cat(chain_v, 2))}
        prev, (key, value) = step(ids[:, k:k + N], prev, torch.arange(N, device=ids.device) + (k - 1), **attention)
        chain_k.append(key)
        chain_v.append(value)
        outs.append(prev)
    return outs


def mtp_unroll(head: nn.Module, target: DenseLM, hidden: torch.Tensor, ids: torch.Tensor,
               steps: int) -> list[torch.Tensor]:
    """outrider's QwenMTP chained over a sequence (unroll_chain) from the target's post-norm hidden [B, T, H]; the
    chain feeds the post-`norm` output back. Returns those outputs [B, N, H] per step."""

    def step(tokens, prev, positions, **attention):
        x = linear(head.fc, torch.cat([norm(head.pre_fc_norm_embedding, target.embed(tokens)),
                                       norm(head.pre_fc_norm_hidden, prev)], dim=-1))
        out, kv = decoder_layer(head.layers[0], x, positions, target.inv_freq, **attention)
        return norm(head.norm, out), kv

    return unroll_chain(step, hidden, ids, steps)


def eagle3_unroll(head: nn.Module, inv_freq: torch.Tensor, embed, taps_cat: torch.Tensor, ids: torch.Tensor,
                  steps: int) -> list[torch.Tensor]:
    """outrider's Eagle3Model chained over a sequence (unroll_chain) from fc(taps_cat), taps_cat [B, T, n*H] the
    target's tapped layer outputs concatenated in layer order; embed: the target's embedding. Its layer's q/k/v read
    [input_layernorm(emb) ; hidden_norm(hidden)] over a residual stream from hidden (from hidden_norm(hidden) with
    norm_before_residual). Returns the pre-norm outputs per step."""
    layer = head.layers[0]

    def step(tokens, prev, positions, **attention):
        normed = norm(layer.hidden_norm, prev)
        residual = normed if layer.norm_before_residual else prev
        xn = torch.cat([norm(layer.input_layernorm, embed(tokens)), normed], dim=-1)
        return block(layer, residual, xn, positions, inv_freq, **attention)

    N = ids.shape[1] - 1 - steps
    return unroll_chain(step, linear(head.fc, taps_cat[:, :N]), ids, steps)


def dflash_forward(model: nn.Module, inv_freq: torch.Tensor, taps_cat: torch.Tensor, block_emb: torch.Tensor,
                   block_pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """outrider's DFlashModel: taps_cat [B, T, n*H] (context at positions 0..T-1) enters each layer as keys and
    values (k_norm(k_proj(ctx)) roped, v_proj(ctx)) of ctx = hidden_norm(fc(taps_cat)); the block block_emb [B, Q, H]
    at block_pos [B, Q] attends over them and itself under mask [B, 1, Q, T+Q] (True = attend). Returns the
    post-`norm` block hidden states [B, Q, H]."""
    ctx = norm(model.hidden_norm, linear(model.fc, taps_cat))
    ctx_pos = torch.arange(ctx.shape[1], device=ctx.device)
    h = block_emb
    for layer in model.layers:
        _, k, v = qkv(layer.self_attn, ctx, ctx_pos, inv_freq)
        h, _ = decoder_layer(layer, h, block_pos, inv_freq, causal=False, mask=mask, prefix_kv=(k, v))
    return norm(model.norm, h)
