"""Vectorised, seeded sampling for a batch of logits rows.

Each row goes through llama.cpp's default chain, so a llama-server user gets the same distribution:
logit_bias (+ engine bans) -> penalties (repeat/presence/frequency over the last repeat_last_n tokens of
`history`) -> top_k -> typical_p -> top_p -> min_p -> temperature -> draw. Note that temperature comes last,
as in llama.cpp: the filters see the T=1 distribution. temperature <= 0 is greedy: the argmax after bias and
penalties, and its processed distribution is one-hot.

Randomness is counter-based: the noise for (seed, step, stream, token id) is a murmur-style hash computed
with integer tensor ops, and tokens are drawn by Gumbel-max over the processed log-probs. A seeded row
therefore draws the same tokens whatever else shares its batch. Stream 0 is plain sampling; spec/verify.py
draws on streams 1 and 2.

Usage, once per step (no host sync until the runner copies `token_ids` back):
    batch = sampler.prepare([RowSpec(params, seed, step, history) for each logits row])
    out = sampler.sample(logits, batch)  # out.token_ids [N] int64 on the logits' device
Speculative verification (spec/verify.py) uses `processed` (the sparse processed distribution), `uniform`
and `gumbel_argmax` on its own streams, and `with_logprobs` for the tokens it commits.

Log-probs reported for n_probs (`top_logprobs`, `chosen_logprob`) are log_softmax of the logits after logit
bias and penalties, before truncation and temperature (llama-server's n_probs uses the raw model logits; we
include bias and penalties so banned tokens show as -inf).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from outrider.engine.upload import to_device
from outrider.params import SamplingParams

# Independent noise streams per (seed, step): plain draws, and speculative verification's two (spec/verify.py).
STREAM_SAMPLE, STREAM_ACCEPT, STREAM_RESIDUAL = 0, 1, 2
NUM_STREAMS = 3

_M32 = 0xFFFFFFFF
_SALT = 0x243F6A88  # arbitrary start state (pi's fraction bits)

# The hash below uses operators only, so it runs on int64 torch tensors (device noise), uint64 numpy arrays and
# Python ints (host stream keys) alike, with the same results.
Ints = torch.Tensor | np.ndarray | int


def _mulmod32(x: Ints, c: int) -> Ints:
    """x * c mod 2^32 for x < 2^32."""
    if isinstance(x, (int, np.ndarray)):  # exact: Python ints hold anything, uint64 holds the product
        return (x * c) & _M32
    # int64 torch tensors: products stay below 2^49 (int64 overflow is undefined behaviour in torch)
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _fmix32(x: Ints) -> Ints:
    """Murmur3's finaliser on int64 arrays holding 32-bit values: every output bit depends on every input bit."""
    x = x ^ (x >> 16)
    x = _mulmod32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mulmod32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def _absorb(h: Ints | int, word: Ints | int) -> Ints:
    """Mix one 32-bit word into a well-mixed hash state h (one finaliser: this runs per vocab entry)."""
    return _fmix32(h ^ _mulmod32(word & _M32, 0x9E3779B9))


def _to_unit(bits: torch.Tensor) -> torch.Tensor:
    """32-bit hashes -> float32 uniforms in the open interval (0, 1); 23 bits keep 1 - u exact."""
    return ((bits >> 9).to(torch.float32) + 0.5) * 2.0**-23


@dataclass(slots=True)  # not frozen: a frozen dataclass costs ~3x to build, and the runner builds one per row
class RowSpec:
    """What the sampler needs to know about one logits row."""

    params: SamplingParams
    seed: int
    step: int  # index of the output token this row samples: the RNG counter
    history: Sequence[int] = ()  # tokens before this row's position (prompt, outputs, earlier drafts)
    banned: Sequence[int] = ()  # engine-imposed bans (ignore_eos, min_tokens): bias -inf


@dataclass
class SamplingBatch:
    """Device tensors for one step, built by `Sampler.prepare`; host flags pick the work to do."""

    num_rows: int
    # The filter tensors are None in an all-greedy batch prepared with sample_only.
    greedy: torch.Tensor | None  # [N] bool
    temperature: torch.Tensor | None  # [N] float32 (1 for greedy rows, never used there)
    top_k: torch.Tensor | None  # [N] int64, `width` when disabled
    top_p: torch.Tensor | None  # [N] float32
    min_p: torch.Tensor | None
    typical_p: torch.Tensor | None
    stream_keys: torch.Tensor | None  # [NUM_STREAMS, N] int64: hash of (seed, step, stream)
    width: int  # candidate columns kept after top-k (the vocab when some sampled row disables top-k)
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, token ids, values
    penalties: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None
    # ^ rows, token ids (one entry per occurrence), repeat, presence, frequency [N]
    n_probs: int  # max n_probs over the rows (0 = no log-probs)
    use_typical: bool
    all_greedy: bool


@dataclass
class SampleOutput:
    token_ids: torch.Tensor  # [N] int64
    top_ids: torch.Tensor | None = None  # [N, n_probs] int64, best first
    top_logprobs: torch.Tensor | None = None  # [N, n_probs] float32
    chosen_logprob: torch.Tensor | None = None  # [N] float32


@dataclass
class Processed:
    """A batch's processed distributions: row i puts exp(logp[i, j]) on token ids[i, j] (zero elsewhere)."""

    adjusted: torch.Tensor  # [N, V] logits after bias and penalties (what n_probs reports on)
    logp: torch.Tensor  # [N, W] log-probs, -inf for filtered candidates
    ids: torch.Tensor  # [N, W] int64 vocab ids (greedy rows repeat their argmax; only column 0 counts)

    def dense(self) -> torch.Tensor:
        """[N, V] log-probs; amax keeps the one finite entry where a greedy row repeats an id."""
        out = torch.full_like(self.adjusted, -math.inf)
        return out.scatter_reduce_(1, self.ids, self.logp, reduce="amax")


class Sampler:
    """Turns logits into tokens and processed distributions for a batch of independent rows."""

    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        # On CUDA the ~30 integer ops of the noise hash fuse into one kernel; eager elsewhere.
        self._noise = torch.compile(_gumbel_noise, dynamic=True) if self.device.type == "cuda" else _gumbel_noise

    # --- building the step's tensors (host side, once per step) ---
    def prepare(self, rows: Sequence[RowSpec], sample_only: bool = False) -> SamplingBatch:
        """Device tensors for these rows, uploaded in one copy. With `sample_only` (the batch goes to `sample`,
        not `processed`), an all-greedy batch skips the filter tensors, whose upload is most of a small step's
        host time."""
        V = self.vocab_size
        ps = [r.params for r in rows]
        greedy = [p.temperature <= 0 for p in ps]
        bias, penalties = self._bias(rows), self._penalties(rows)
        parts: list[tuple] = [*(bias or ()), *(penalties or ())]
        filters = not (all(greedy) and sample_only)
        if filters:
            sampled = [p for p, g in zip(ps, greedy) if not g]
            width = min(V, max((p.top_k for p in sampled), default=1)) if all(p.top_k > 0 for p in sampled) else V
            # Rows: temperature as given (<= 0: greedy), the one logits are divided by (1 when greedy), top_p, ...
            floats = np.array([[p.temperature for p in ps], [1.0 if g else p.temperature for p, g in zip(ps, greedy)],
                               [p.top_p for p in ps], [p.min_p for p in ps], [p.typical_p for p in ps]],
                              dtype=np.float32)
            top_k = [p.top_k if 0 < p.top_k < width else width for p in ps]
            parts += [(floats, np.float32), (top_k, np.int64), (_stream_keys(rows), np.int64)]
        dev = to_device(parts, self.device)
        if bias:
            bias, dev = tuple(dev[:3]), dev[3:]
        if penalties:
            (at, toks, coef), dev = dev[:3], dev[3:]
            penalties = (at, toks, coef[0], coef[1], coef[2])
        n_probs = max((p.n_probs for p in ps), default=0)
        if not filters:
            return SamplingBatch(len(rows), None, None, None, None, None, None, None, V, bias, penalties, n_probs,
                                 False, True)
        floats, top_k, keys = dev
        return SamplingBatch(
            num_rows=len(rows),
            greedy=floats[0] <= 0,
            temperature=floats[1],
            top_k=top_k,
            top_p=floats[2],
            min_p=floats[3],
            typical_p=floats[4],
            stream_keys=keys,
            width=width,
            bias=bias,
            penalties=penalties,
            n_probs=n_probs,
            use_typical=any(p.typical_p < 1.0 for p in sampled),
            all_greedy=all(greedy),
        )

    def _bias(self, rows: Sequence[RowSpec]) -> list[tuple] | None:
        """Upload parts for (rows, token ids, values) of the logit bias and engine bans (-inf); None if none."""
        at: list[int] = []
        toks: list[int] = []
        vals: list[float] = []
        for i, r in enumerate(rows):
            for tok, b in r.params.logit_bias:
                at.append(i)
                toks.append(tok)
                vals.append(b)
            if r.banned:
                at += [i] * len(r.banned)
                toks += r.banned
                vals += [-math.inf] * len(r.banned)
        if toks and (min(toks) < 0 or max(toks) >= self.vocab_size):  # llama-server ignores bad ids too
            keep = [j for j, tok in enumerate(toks) if 0 <= tok < self.vocab_size]
            at, toks, vals = [at[j] for j in keep], [toks[j] for j in keep], [vals[j] for j in keep]
        return [(at, np.int64), (toks, np.int64), (vals, np.float32)] if toks else None

    def _penalties(self, rows: Sequence[RowSpec]) -> list[tuple] | None:
        """Upload parts for (rows, token ids: one entry per occurrence in the window, [3, N] repeat, presence and
        frequency penalties); None if no row has a penalty."""
        at: list[int] = []
        toks: list[int] = []
        for i, r in enumerate(rows):
            p = r.params
            n = p.repeat_last_n if p.repeat_last_n >= 0 else len(r.history)
            off = p.repeat_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
            if off or n == 0:
                continue
            window = [t for t in list(r.history[-n:]) if 0 <= t < self.vocab_size]
            at += [i] * len(window)
            toks += window
        if not toks:
            return None
        ps = [r.params for r in rows]
        coef = np.array([[p.repeat_penalty for p in ps], [p.presence_penalty for p in ps],
                         [p.frequency_penalty for p in ps]], dtype=np.float32)
        return [(at, np.int64), (toks, np.int64), (coef, np.float32)]

    # --- device side ---
    def adjusted_logits(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Logits after logit bias and penalties (a new tensor; the input is left alone)."""
        if batch.bias is None and batch.penalties is None:
            return logits.float()  # nothing to adjust (compute_logits already returns float32: no copy)
        out = logits.float().clone()
        if batch.bias is not None:
            rows, toks, vals = batch.bias
            out.index_put_((rows, toks), vals, accumulate=True)
        if batch.penalties is not None:
            rows, toks, repeat, presence, frequency = batch.penalties
            counts = torch.zeros_like(out)
            counts.index_put_((rows, toks), torch.ones_like(toks, dtype=out.dtype), accumulate=True)
            seen = counts > 0
            # llama.cpp: shrink seen logits towards zero, then subtract the additive penalties.
            rp = repeat[:, None]
            scaled = torch.where(out <= 0, out * rp, out / rp)
            scaled = scaled - counts * frequency[:, None] - seen * presence[:, None]
            out = torch.where(seen, scaled, out)
        return out

    def processed(self, logits: torch.Tensor, batch: SamplingBatch) -> Processed:
        """The distribution each row samples from, in sparse form over its top-`width` candidates."""
        adjusted = self.adjusted_logits(logits, batch)
        # Best first. A full sort beats topk when every column is kept (some row has no top-k).
        full = batch.width == adjusted.shape[-1]
        vals, ids = adjusted.sort(dim=-1, descending=True) if full else adjusted.topk(batch.width, dim=-1)
        rank = torch.arange(batch.width, device=vals.device)
        keep = rank[None, :] < batch.top_k[:, None]
        if batch.use_typical:
            keep &= _typical_keep(vals, keep, batch.typical_p)
        probs = torch.softmax(vals.masked_fill(~keep, -math.inf), dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of better tokens: top-p keeps the one crossing p
        keep &= (before < batch.top_p[:, None]) | (batch.top_p[:, None] >= 1.0)
        keep &= vals >= vals[:, :1] + torch.log(batch.min_p)[:, None]  # min-p relative to the best token
        logp = torch.log_softmax(vals.masked_fill(~keep, -math.inf) / batch.temperature[:, None], dim=-1)
        # Greedy rows: all mass on argmax (whose tie-break is defined, unlike topk's), in column 0.
        # (Built with where: writing one element of a device tensor from Python syncs the host.)
        greedy = batch.greedy[:, None]
        return Processed(adjusted, torch.where(greedy, torch.where(rank == 0, 0.0, -math.inf), logp),
                         torch.where(greedy, adjusted.argmax(-1, keepdim=True), ids))

    def process(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Log-probs [N, V] of the distribution each row samples from (one-hot at the argmax for greedy rows)."""
        return self.processed(logits, batch).dense()

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        """Draw one token per row (stream 0), plus the top-n log-probs when any row asked for them."""
        if batch.all_greedy:  # fast path, same result: skips the candidate filters
            adjusted = self.adjusted_logits(logits, batch)
            tokens = adjusted.argmax(dim=-1)
        else:
            proc = self.processed(logits, batch)
            adjusted, tokens = proc.adjusted, self.gumbel_argmax(proc.logp, proc.ids, batch, STREAM_SAMPLE)
        return self.with_logprobs(SampleOutput(tokens), adjusted, batch)

    def with_logprobs(self, out: SampleOutput, adjusted: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        """Fill the n_probs fields of `out` for its token_ids (no-op when no row asked for log-probs)."""
        if batch.n_probs > 0:
            raw = torch.log_softmax(adjusted, dim=-1)
            out.top_logprobs, out.top_ids = raw.topk(min(batch.n_probs, raw.shape[-1]), dim=-1)
            out.chosen_logprob = raw.gather(1, out.token_ids[:, None])[:, 0]
        return out

    def gumbel_argmax(self, logp: torch.Tensor, ids: torch.Tensor | None, batch: SamplingBatch,
                      stream: int) -> torch.Tensor:
        """Draw from each row of `logp` (unnormalised is fine) with counter-based noise -> token ids [N].

        `ids` [N, C] names the vocab id of each column (None: column j is token j). Noise is keyed on the
        vocab id, so the draw does not depend on which columns a batch happens to carry."""
        if ids is None:
            ids = torch.arange(logp.shape[-1], device=logp.device).expand_as(logp)
        col = (logp + self._noise(batch.stream_keys[stream][:, None], ids)).argmax(dim=-1, keepdim=True)
        return ids.gather(1, col)[:, 0]

    def uniform(self, batch: SamplingBatch, stream: int) -> torch.Tensor:
        """One float32 uniform in (0, 1) per row for (seed, step, stream); the word 2^32-1 is no token id,
        so it is independent of every token's noise on any stream."""
        return _to_unit(_absorb(batch.stream_keys[stream], _M32))


def _stream_keys(rows: Sequence[RowSpec]) -> np.ndarray:
    """[NUM_STREAMS, N] int64 hashes of (seed, step, stream), on the host. The hash uses operators only, so it
    runs on Python ints for a few rows and on numpy arrays for many: whichever costs less for the batch."""
    if len(rows) <= 8:
        keys = [_absorb(_absorb(_absorb(_SALT, r.seed & _M32), (r.seed >> 32) & _M32), r.step & _M32) for r in rows]
        return np.array([[_absorb(k, stream) for k in keys] for stream in range(NUM_STREAMS)], dtype=np.int64)
    seeds = np.array([r.seed & _M32 for r in rows] + [(r.seed >> 32) & _M32 for r in rows], dtype=np.uint64)
    steps = np.array([r.step & _M32 for r in rows], dtype=np.uint64)
    row = _absorb(_absorb(_absorb(_SALT, seeds[: len(rows)]), seeds[len(rows) :]), steps)
    return _absorb(row[None, :], np.arange(NUM_STREAMS, dtype=np.uint64)[:, None]).view(np.int64)  # (< 2^32)


def _gumbel_noise(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise for vocab `ids` [N, C] under per-row stream keys [N, 1]."""
    return -torch.log(-torch.log(_to_unit(_absorb(keys, ids))))


def _typical_keep(vals: torch.Tensor, keep: torch.Tensor, typical_p: torch.Tensor) -> torch.Tensor:
    """llama.cpp typical sampling: keep the tokens whose surprise is closest to the entropy, up to mass p."""
    logp = torch.log_softmax(vals.masked_fill(~keep, -math.inf), dim=-1)
    p = logp.exp()
    entropy = -(p * logp.masked_fill(~keep, 0.0)).sum(-1, keepdim=True)
    score = (-logp - entropy).abs().masked_fill(~keep, math.inf)
    order = score.argsort(dim=-1, stable=True)
    p_sorted = p.gather(1, order)
    before = torch.cumsum(p_sorted, dim=-1) - p_sorted
    kept_sorted = before <= typical_p[:, None]
    typical = torch.zeros_like(keep).scatter_(1, order, kept_sorted)
    return typical | (typical_p[:, None] >= 1.0)
