"""Fused small ops with one signature for every device: Triton on CUDA, plain torch elsewhere.

The torch versions are the semantics (they round like the Hugging Face modules); the Triton versions in
outrider.kernels.fused match them up to reduction order and collapse 3-7 kernel launches into one. `linear` can
send decode-sized projections to outrider.kernels.gemm (SKINNY_GEMM).
Safe to import on CPU: Triton is imported only when a CUDA tensor arrives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from outrider.kernels.launch import FOLD_MAX_ROWS, SKINNY_MAX_ROWS, in_graph_capture, is_power_of_two, use_pdl
from outrider.kernels.launch import graph_capture  # noqa: F401  (callers capture through ops.graph_capture)

# Route decode and verify projections (M <= SKINNY_MAX_ROWS) inside captured CUDA graphs to Triton's skinny GEMM
# (kernels/gemm.py) instead of cuBLAS. Only there: an eager Triton launch costs 40-140 us of host time, several
# times cuBLAS's, which short prefills would pay per projection (its effect on decode: docs/benchmarks.md).
# (A constant so that tests can compare both routes.)
SKINNY_GEMM = True


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and x.stride(-1) == 1


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    summed = x + residual if residual is not None else None
    h = summed if summed is not None else x
    hf = h.float()
    hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hf.to(h.dtype), summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm(x [+ residual]) * weight -> (normed, x + residual, or None when no residual is given)."""
    if _use_triton(x) and (residual is None or residual.stride(-1) == 1):
        from outrider.kernels import fused

        return fused.rms_norm(x, weight, eps, residual)
    return torch_rms_norm(x, weight, eps, residual)


def torch_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up; gate/up may be the halves of one packed gate_up output (`gu.chunk(2, -1)`)."""
    if _use_triton(gate) and up.stride(-1) == 1:
        from outrider.kernels import fused

        return fused.silu_mul(gate, up)
    return torch_silu_mul(gate, up)


def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """o [T, H, D] * sigmoid(gate [T, H, D]), the gate being the second half of each head's [query | gate] (Qwen3.5's
    and Qwen3-Next's attention output gate)."""
    fits = gate.stride(-1) == 1 and gate.stride(-2) == 2 * gate.shape[-1] and o.is_contiguous()
    if _use_triton(o) and fits and is_power_of_two(o.shape[-2]) and is_power_of_two(o.shape[-1]):
        from outrider.kernels import fused

        return fused.sigmoid_gate(o, gate)
    return o * torch.sigmoid(gate)


def torch_qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                       q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if q_weight is not None:
        q = torch_rms_norm(q, q_weight, eps)[0]
        k = torch_rms_norm(k, k_weight, eps)[0]
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)

    def rot(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    return rot(q), rot(k)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                 q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                 eps: float = 1e-6, order: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Optional per-head RMSNorm (Qwen3 q_norm/k_norm) then rotate-half RoPE at `positions`, of q's and k's head
    dimensions (and the norm weights) read in `order` (None: as they are).

    q [T, Hq, D], k [T, Hkv, D]; inv_freq [D/2] float32 on q's device (RotaryEmbedding.inv_freq)."""
    if _use_triton(q) and k.stride(-1) == 1:
        from outrider.kernels import fused

        return fused.qk_norm_rope(q, k, positions, inv_freq, q_weight, k_weight, eps, order)
    if order is not None:
        q, k = q.index_select(-1, order), k.index_select(-1, order)
        if q_weight is not None:
            q_weight, k_weight = q_weight[order], k_weight[order]
    return torch_qk_norm_rope(q, k, positions, inv_freq, q_weight, k_weight, eps)


def torch_argmax_confidence(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    top, tokens = logits.max(dim=-1)
    return tokens, torch.exp(top.float() - torch.logsumexp(logits.float(), dim=-1))


def argmax_confidence(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A drafter's greedy pick per row of logits [T, N] and the probability softmax gives it: (tokens [T] int64,
    probabilities [T] float32). The maximum's probability is exp(max - logsumexp): no [T, N] softmax is written."""
    if _use_triton(logits) and logits.dim() == 2:
        from outrider.kernels import fused

        return fused.argmax_confidence(logits)
    return torch_argmax_confidence(logits)


def _use_skinny_gemm(x: torch.Tensor, weight: torch.Tensor, fold: bool = False) -> bool:
    """SKINNY_GEMM on, inside graph capture, a contiguous 2-D CUDA x and a row-major weight of its dtype, with up
    to FOLD_MAX_ROWS rows (`fold`: a norm or activation goes into the kernel) or up to SKINNY_MAX_ROWS 16-bit ones:
    where the Triton skinny GEMM replaces cuBLAS."""
    rows = x.shape[0] if x.dim() == 2 else 0
    limit = SKINNY_MAX_ROWS if not fold and x.dtype in (torch.float16, torch.bfloat16) else FOLD_MAX_ROWS
    return (SKINNY_GEMM and in_graph_capture() and x.is_cuda and 0 < rows <= limit and x.is_contiguous()
            and weight.is_contiguous() and weight.dtype == x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) with the result in out_dtype (LM heads ask float32), on the Triton skinny GEMM
    where _use_skinny_gemm says so. `out`: a row-major [M, N] tensor of out_dtype to write the result into.

    A float32 result of 16-bit inputs keeps cuBLAS's float32 accumulator (mm's out_dtype, CUDA), as the skinny GEMM
    does at decode: rounded to bfloat16 first, logits of 8-32 lie 0.06-0.125 apart, so a verify row's argmax broke
    near-ties that a decode row's resolves, and greedy rounds left plain decoding's tokens for no reason.
    A weight that is no tensor (quant/weight.py's QuantizedWeight) computes the product itself (its kernels read the
    quantized blocks)."""
    if not isinstance(weight, torch.Tensor):
        return weight.linear(x, bias, out_dtype=out_dtype, out=out)
    if _use_skinny_gemm(x, weight):
        from outrider.kernels import gemm

        return gemm.skinny_gemm(x, weight, bias, out_dtype=out_dtype, pdl=use_pdl(x), out=out)
    if out_dtype is torch.float32 and x.is_cuda and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16):
        y = torch.mm(x, weight.t(), out_dtype=torch.float32)
        if bias is not None:
            y += bias
        return y if out is None else out.copy_(y)
    if out is not None and out.dtype == x.dtype and x.dim() == 2 and out.stride(1) == 1:
        # cuBLAS writes a row-major out whose rows are wider (a column slice of a packed output) in place
        return torch.mm(x, weight.t(), out=out) if bias is None else torch.addmm(bias, x, weight.t(), out=out)
    y = F.linear(x, weight, bias)
    if out is not None:
        return out.copy_(y)  # (the cast to out's dtype is this copy: no extra kernel)
    return y if out_dtype is None else y.to(out_dtype)


def rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(RMSNorm(x [+ residual]) * norm_weight, weight, bias), x + residual (x itself without residual)).

    On the skinny GEMM the norm (and the residual add) happen as the kernel loads x: at decode a pre-norm
    projection is one launch instead of two (the normed row is then not rounded to x's dtype before the product:
    gemm.RowNorm). LM heads do not use it: every program of a GEMM that wide re-reading x and the norm weight
    cost Qwen3-8B's 10 us, several times a separate norm kernel (H200). A QuantizedWeight whose parts read x as
    int8 groups makes the normed row as it quantizes it (QuantizedWeight.takes_prologue); others get the normed x."""
    fold_quantized = not isinstance(weight, torch.Tensor) and weight.takes_prologue(x)
    if ((fold_quantized or (isinstance(weight, torch.Tensor) and _use_skinny_gemm(x, weight, fold=True)))
            and (residual is None or residual.is_contiguous())):
        from outrider.kernels import gemm

        summed = None if residual is None else torch.empty_like(x)
        norm = gemm.RowNorm(norm_weight, eps, residual, summed)
        y = (weight.linear(x, bias, norm=norm) if fold_quantized
             else gemm.skinny_gemm(x, weight, bias, norm=norm, pdl=use_pdl(x)))
        return y, (x if summed is None else summed)
    normed, summed = rms_norm(x, norm_weight, eps, residual)
    y = linear(normed, weight, bias)
    return y, (summed if summed is not None else x)


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear(silu_mul(gate, up), weight, bias) for the packed gate_up [T, 2I] = [gate | up] (SwiGLU's down_proj).

    On the skinny GEMM the kernel forms silu(gate) * up as it loads x, so the activation costs no launch of its
    own (a kernel boundary is ~1 us of dead time in a batch-1 decode graph). A QuantizedWeight whose parts read x as
    int8 groups forms it as it quantizes x (QuantizedWeight.takes_prologue); others get silu(gate) * up."""
    if not isinstance(weight, torch.Tensor) and weight.takes_prologue(gate_up):
        return weight.linear(gate_up, bias, silu_mul=True)
    if isinstance(weight, torch.Tensor) and _use_skinny_gemm(gate_up, weight, fold=True):
        from outrider.kernels import gemm

        return gemm.skinny_gemm(gate_up, weight, bias, silu_mul=True, pdl=use_pdl(gate_up))
    return linear(silu_mul(*gate_up.chunk(2, dim=-1)), weight, bias)
