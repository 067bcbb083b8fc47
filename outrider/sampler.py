"""Vectorised, seeded sampling for a batch of logits rows.

Each row goes through llama.cpp's default chain, so a llama-server user gets the same distribution:
logit_bias (+ engine bans) -> penalties (repeat/presence/frequency over the last repeat_last_n tokens of
`history`) -> DRY (dry.py, over the last dry_penalty_last_n) -> grammar (a row's allowed tokens,
structured/grammar.py) -> top_k -> typical_p -> top_p -> min_p -> XTC -> temperature -> draw. Note that
temperature comes last, as in llama.cpp: the filters see the T=1 distribution. temperature <= 0 is greedy: the
argmax after bias, penalties, DRY and grammar, and its processed distribution is one-hot.

Randomness is counter-based: the noise for (seed, step, stream, token id) is a murmur-style hash computed
with integer tensor ops, and tokens are drawn by Gumbel-max over the processed log-probs. A seeded row
therefore draws the same tokens whatever else shares its batch. Stream 0 is plain sampling (verification draws the
target's token there too, so a seeded request gives the same tokens with or without drafts), stream 1 XTC's coin;
speculative/verify.py draws on streams 2 and 3 for drafts that came with their own distribution.

Usage, once per step (no host sync until the runner copies `token_ids` back):
    batch = sampler.prepare([RowSpec(params, seed, step, history) for each logits row])
    out = sampler.sample(logits, batch)  # out.token_ids [N] int64 on the logits' device
The runner passes SamplingRows instead: the same rows by column, over a ParamTable it keeps across steps, so a
step's host work is a gather rather than a pass over every row's parameters.
Speculative verification (speculative/verify.py) uses `processed` (the sparse processed distribution), `uniform`
and `gumbel_argmax`, and `with_logprobs` for the tokens it commits; `greedy` alone when every row is greedy and
the drafts are argmax ones.

Log-probs reported for n_probs (`top_logprobs`, `chosen_logprob`) are log_softmax of the logits after logit
bias and penalties, before truncation and temperature (llama-server's n_probs uses the raw model logits; we
include bias and penalties so banned tokens show as -inf).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from outrider.dry import dry_penalties
from outrider.params import SamplingParams
from outrider.request_fields import COLUMNS
from outrider.structured.masks import TokenMasks
from outrider.upload import to_device

if TYPE_CHECKING:
    from outrider.dry import Breakers
    from outrider.engine.request import Request

# Independent noise streams per (seed, step): plain draws, XTC's coin, and the two of speculative verification
# with drafts that came with their own distribution (speculative/verify.py).
STREAM_SAMPLE, STREAM_XTC, STREAM_ACCEPT, STREAM_RESIDUAL = 0, 1, 2, 3
NUM_STREAMS = 4

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


@dataclass(slots=True)
class RowSpec:
    """What the sampler needs to know about one logits row."""

    params: SamplingParams
    seed: int
    step: int  # index of the output token this row samples: the RNG counter
    history: Sequence[int] = ()  # tokens before this row's position (prompt, outputs, earlier drafts)


class _Columns:
    """Named rows of a ParamTable array: the request fields' columns (request_fields.FIELDS) after the
    sampler's own."""

    def __init__(self, *names: str) -> None:
        self.names = names
        for i, name in enumerate(names):
            setattr(self, name, i)


_F = _Columns("divisor", *COLUMNS["float"])  # float32: the temperature a sampled row divides by (1 when greedy)
# int64: flags, top_k as a limit and as the width it asks for, n_probs, the first output index EOG is allowed at,
# and the seed's hash state
_I = _Columns("flags", "top_k_limit", "top_k_width", "n_probs", "eog_banned_until", "seed_key", *COLUMNS["int"])
_FILTERS = [_F.temperature, _F.divisor, _F.top_p, _F.min_p, _F.typical_p, _F.xtc_probability, _F.xtc_threshold]
_PENALTIES = [_F.repeat_penalty, _F.presence_penalty, _F.frequency_penalty]
_NO_LIMIT = np.iinfo(np.int64).max


class _Flag:
    """A slot's flags, what its rows need: a batch ORs them (some row needs it) and ANDs them (every row does)."""

    GREEDY = 1  # temperature <= 0 as float32 (what the device holds: a positive one that rounds to 0 is greedy)
    TOP_P = 2  # sampled with top_p < 1 (a greedy row ignores every filter)
    MIN_P = 4  # sampled with min_p > 0
    TYPICAL = 8  # sampled with typical_p < 1
    NO_TOP_K = 16  # sampled with top-k disabled
    PENALIZED = 32  # repeat/presence/frequency penalties
    BIASED = 64  # a logit bias
    LOGPROBS = 128  # n_probs > 0
    DRY = 256
    XTC = 512  # sampled with XTC on (a chance > 0, a threshold <= 0.5: llama.cpp's "off" above it)
    HISTORY = PENALIZED | DRY  # reads the recent tokens


class ParamTable:
    """Sampling parameters and seeds by slot, as columns that a step gathers its rows from.

    The runner keeps one across steps, a slot per scheduler slot: a slot mirrors one request, recognised by
    identity, and is rewritten only when another request takes it (parameters and seed never change)."""

    def __init__(self, size: int = 0) -> None:
        self.floats = np.zeros((len(_F.names), size), dtype=np.float32)
        self.ints = np.zeros((len(_I.names), size), dtype=np.int64)
        self.logit_bias: list[tuple[tuple[int, float], ...]] = [()] * size
        self.breakers: list[Breakers | None] = [None] * size  # DRY's sequence breakers in token form
        self._owners: list[object | None] = [None] * size  # the request each slot mirrors

    def sync(self, reqs: Sequence[Request]) -> None:
        """Mirror these running requests at their slots (id_slot)."""
        for req in reqs:
            slot = req.id_slot
            if slot >= len(self._owners) or self._owners[slot] is not req:
                self.write(slot, req.params, req.seed, owner=req)

    def write(self, slot: int, params: SamplingParams, seed: int, owner: object | None = None) -> None:
        """Set a slot's parameters and seed, for `owner` (the request it mirrors)."""
        if slot >= len(self._owners):
            self._grow(slot + 1)
        p, f, i = params, self.floats[:, slot], self.ints[:, slot]
        for name in COLUMNS["float"]:
            f[getattr(_F, name)] = getattr(p, name)
        for name in COLUMNS["int"]:
            i[getattr(_I, name)] = getattr(p, name)
        sampled = bool(f[_F.temperature] > 0)
        f[_F.divisor] = p.temperature if sampled else 1.0
        bias = p.logit_bias
        flags = {_Flag.GREEDY: not sampled, _Flag.TOP_P: sampled and f[_F.top_p] < 1.0,
                 _Flag.MIN_P: sampled and f[_F.min_p] > 0.0, _Flag.TYPICAL: sampled and f[_F.typical_p] < 1.0,
                 _Flag.NO_TOP_K: sampled and p.top_k <= 0, _Flag.PENALIZED: p.sampler_on("penalties"),
                 _Flag.DRY: p.sampler_on("dry"), _Flag.BIASED: bool(bias),
                 _Flag.LOGPROBS: p.n_probs > 0,
                 _Flag.XTC: sampled and f[_F.xtc_probability] > 0.0 and f[_F.xtc_threshold] <= 0.5}
        i[_I.flags] = sum(flag for flag, on in flags.items() if on)
        i[_I.top_k_limit] = p.top_k if p.top_k > 0 else _NO_LIMIT  # a row keeps min(this, width) candidates
        i[_I.top_k_width] = p.top_k if sampled and p.top_k > 0 else 1  # the width it asks for
        i[_I.n_probs] = p.n_probs
        # llama-server bans EOG with ignore_eos, or before min_tokens
        i[_I.eog_banned_until] = _NO_LIMIT if p.ignore_eos else p.min_tokens
        i[_I.seed_key] = _seed_key(seed)
        self.logit_bias[slot] = bias
        self.breakers[slot] = p.token_form("dry_sequence_breakers")
        self._owners[slot] = owner

    def penalized(self, slots: Sequence[int]) -> bool:
        """True when a penalty (DRY among them) reads the history of a row at these slots."""
        return bool(np.bitwise_or.reduce(self.ints[_I.flags, slots]) & _Flag.HISTORY) if len(slots) else False

    def _grow(self, size: int) -> None:
        old = len(self._owners)
        size = max(size, 2 * old)
        self.floats = np.concatenate([self.floats, np.zeros((len(_F.names), size - old), dtype=np.float32)], axis=1)
        self.ints = np.concatenate([self.ints, np.zeros((len(_I.names), size - old), dtype=np.int64)], axis=1)
        self.logit_bias += [()] * (size - old)
        self.breakers += [None] * (size - old)
        self._owners += [None] * (size - old)


@dataclass
class SamplingRows:
    """A batch's logits rows by column: row r samples with the parameters and seed at `table` slot slots[r], as
    output index steps[r] (its RNG counter)."""

    table: ParamTable
    slots: np.ndarray  # [N] int64
    steps: np.ndarray  # [N] int64
    # per row, the tokens before it (None: no row is penalised); rows at one slot are one request's positions in
    # order, so each history is a prefix of the next one's
    histories: Sequence[Sequence[int]] | None = None
    allowed: TokenMasks | None = None  # None: no row is constrained

    @classmethod
    def of(cls, specs: Sequence[RowSpec]) -> SamplingRows:
        """The rows of these specs, each with its own table slot."""
        table = ParamTable(len(specs))
        for i, r in enumerate(specs):
            table.write(i, r.params, r.seed)
        return cls(table, np.arange(len(specs)), np.array([r.step for r in specs], dtype=np.int64),
                   [r.history for r in specs])


@dataclass
class SamplingBatch:
    """Device tensors for one step, built by `Sampler.prepare`. A filter's tensor is None when no row needs it
    (every step pays a few microseconds of host time per device op it launches)."""

    num_rows: int
    width: int  # candidate columns kept after top-k (the vocab when some sampled row disables top-k)
    n_probs: int  # max n_probs over the rows (0 = no log-probs)
    all_greedy: bool
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, token ids, values
    penalties: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # ^ rows, token ids (one entry per occurrence), repeat, presence, frequency [N]
    dry: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, token ids, penalties (one per pair)
    # EOG bans, added to the logits at the sampler's eog_ids [E]: -inf for every row (a 0-dim tensor) or per row
    # ([N, 1]: -inf or 0); None when no row bans them.
    eog_ban: torch.Tensor | None = None
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None  # TokenMasks on the device: rows [C], bits [C, W]
    # The filters and the noise keys: all None in an all-greedy batch prepared with sample_only.
    greedy: torch.Tensor | None = None  # [N] bool; None: no row is greedy
    temperature: torch.Tensor | None = None  # [N] float32 (1 for greedy rows, never used there)
    top_k: torch.Tensor | None = None  # [N] int64, `width` when disabled; None: every row keeps `width`
    top_p: torch.Tensor | None = None  # [N] float32; None: every row disables top-p (1.0)
    min_p: torch.Tensor | None = None  # None: every row disables min-p (0.0)
    typical_p: torch.Tensor | None = None  # None: no sampled row uses typical sampling
    xtc: tuple[torch.Tensor, torch.Tensor] | None = None  # [N] probability, threshold; None: no row uses XTC
    # [S, N] int64: hash of (seed, step, stream); with sample_only, the streams `sample` draws on
    stream_keys: torch.Tensor | None = None
    some_top_p_off: bool = False  # some rows disable top-p while others use it


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
        self._rank = torch.arange(vocab_size, device=self.device)  # candidate ranks: a view launches nothing
        self._neg_inf = torch.tensor(-math.inf, device=self.device)
        self._bit_shifts = torch.arange(32, dtype=torch.int32, device=self.device)  # unpacks TokenMasks words
        # End-of-generation ids the logits cover, on the device (None: none): banned, as llama-server does, for
        # rows with ignore_eos or short of min_tokens.
        self.eog_ids: torch.Tensor | None = None

    # --- building the step's tensors (host side, once per step) ---
    def prepare(self, rows: SamplingRows | Sequence[RowSpec], sample_only: bool = False,
                argmax_drafts: bool = False) -> SamplingBatch:
        """Device tensors for these rows, uploaded in one copy. With `sample_only` (the batch goes to `sample`,
        not `processed`), an all-greedy batch skips the filter tensors, whose upload is most of a small step's
        host time, and only the plain draws' noise stream is keyed. With `argmax_drafts` (the batch verifies
        drafts that were argmax picks), an all-greedy batch skips them too: it takes verify's greedy path."""
        if not isinstance(rows, SamplingRows):
            rows = SamplingRows.of(rows)
        floats, ints = rows.table.floats[:, rows.slots], rows.table.ints[:, rows.slots]
        some, every = int(np.bitwise_or.reduce(ints[_I.flags])), int(np.bitwise_and.reduce(ints[_I.flags]))
        banned = rows.steps < ints[_I.eog_banned_until] if self.eog_ids is not None else None
        some_banned = banned is not None and banned.any()
        ban_every_row = some_banned and banned.all()  # (the usual case, ignore_eos: nothing to upload)
        bias = self._bias(rows, ints, some)
        penalties = self._penalties(rows, floats, ints) if some & _Flag.PENALIZED else None
        dry = self._dry(rows, floats, ints) if some & _Flag.DRY else None
        parts: list[tuple] = [*(bias or ()), *(penalties or ()), *(dry or ())]
        if some_banned and not ban_every_row:
            parts.append((np.where(banned, -np.inf, 0.0), np.float32))
        if rows.allowed is not None:
            parts += [(rows.allowed.rows, np.int64), (rows.allowed.bits, np.int32)]
        all_greedy = bool(every & _Flag.GREEDY)
        filters = not (all_greedy and (sample_only or argmax_drafts))
        if filters:
            V = self.vocab_size
            width = V if some & _Flag.NO_TOP_K else min(V, int(ints[_I.top_k_width].max()))
            top_k = np.minimum(ints[_I.top_k_limit], width)
            streams = (STREAM_XTC + 1 if some & _Flag.XTC else STREAM_SAMPLE + 1) if sample_only else NUM_STREAMS
            keys = _stream_keys(ints[_I.seed_key], rows.steps, streams)
            parts += [(floats[_FILTERS], np.float32), (top_k, np.int64), (keys, np.int64)]
        dev = to_device(parts, self.device)
        if bias:
            bias, dev = tuple(dev[:3]), dev[3:]
        if penalties:
            (at, toks, coef), dev = dev[:3], dev[3:]
            penalties = (at, toks, coef[0], coef[1], coef[2])
        if dry:
            dry, dev = tuple(dev[:3]), dev[3:]
        eog_ban = None
        if some_banned:
            if ban_every_row:
                eog_ban = self._neg_inf
            else:
                eog_ban, dev = dev[0][:, None], dev[1:]
        allowed = None
        if rows.allowed is not None:
            allowed, dev = (dev[0], dev[1]), dev[2:]
        common = dict(num_rows=len(rows.slots), n_probs=int(ints[_I.n_probs].max()) if some & _Flag.LOGPROBS else 0,
                      bias=bias, penalties=penalties, dry=dry, eog_ban=eog_ban, allowed=allowed)
        if not filters:
            return SamplingBatch(width=self.vocab_size, all_greedy=True, **common)
        filt, top_k_dev, keys_dev = dev
        col = {c: j for j, c in enumerate(_FILTERS)}  # the uploaded filter rows, by ParamTable column
        xtc = some & _Flag.XTC
        return SamplingBatch(
            width=width,
            all_greedy=all_greedy,
            greedy=filt[col[_F.temperature]] <= 0 if some & _Flag.GREEDY else None,
            temperature=filt[col[_F.divisor]],
            top_k=top_k_dev if top_k.min() < width else None,
            top_p=filt[col[_F.top_p]] if some & _Flag.TOP_P else None,
            min_p=filt[col[_F.min_p]] if some & _Flag.MIN_P else None,
            typical_p=filt[col[_F.typical_p]] if some & _Flag.TYPICAL else None,
            # (a greedy row's chance is never used: greedy rows ignore every filter)
            xtc=(filt[col[_F.xtc_probability]], filt[col[_F.xtc_threshold]]) if xtc else None,
            stream_keys=keys_dev,
            some_top_p_off=not every & _Flag.TOP_P,
            **common,
        )

    def _bias(self, rows: SamplingRows, ints: np.ndarray, flags: int) -> list[tuple] | None:
        """Upload parts for (rows, token ids, values) of the logit bias; None if none."""
        at: list[int] = []
        toks: list[int] = []
        vals: list[float] = []
        if flags & _Flag.BIASED:
            for r in np.flatnonzero(ints[_I.flags] & _Flag.BIASED).tolist():
                for tok, b in rows.table.logit_bias[rows.slots[r]]:
                    at.append(r)
                    toks.append(tok)
                    vals.append(b)
            if toks and (min(toks) < 0 or max(toks) >= self.vocab_size):  # llama-server ignores bad ids too
                keep = [j for j, tok in enumerate(toks) if 0 <= tok < self.vocab_size]
                at, toks, vals = [at[j] for j in keep], [toks[j] for j in keep], [vals[j] for j in keep]
        return [(at, np.int64), (toks, np.int64), (vals, np.float32)] if toks else None

    def set_eog_ids(self, eog_ids: Sequence[int]) -> None:
        """The model's end-of-generation ids (once, at start-up); those outside the logits are ignored."""
        valid = sorted({i for i in eog_ids if 0 <= i < self.vocab_size})
        self.eog_ids = torch.tensor(valid, dtype=torch.int64, device=self.device) if valid else None

    def _penalties(self, rows: SamplingRows, floats: np.ndarray, ints: np.ndarray) -> list[tuple] | None:
        """Upload parts for (rows, token ids: one entry per occurrence in the window, [3, N] repeat, presence and
        frequency penalties); None if no row has a penalty."""
        if rows.histories is None:
            return None
        at: list[int] = []
        toks: list[int] = []
        for r in np.flatnonzero(ints[_I.flags] & _Flag.PENALIZED).tolist():
            window = _window(rows.histories[r], int(ints[_I.repeat_last_n, r]))
            window = [t for t in window if 0 <= t < self.vocab_size]
            at += [r] * len(window)
            toks += window
        if not toks:
            return None
        return [(at, np.int64), (toks, np.int64), (floats[_PENALTIES], np.float32)]

    def _dry(self, rows: SamplingRows, floats: np.ndarray, ints: np.ndarray) -> list[tuple] | None:
        """Upload parts for DRY's (rows, token ids, penalties to subtract); None if nothing is penalised. The repeat
        search runs here, per row (dry.py)."""
        if rows.histories is None:
            return None
        at, toks, vals = [], [], []
        dry_rows = np.flatnonzero(ints[_I.flags] & _Flag.DRY).tolist()
        # One array per request: its rows' histories are prefixes of its last row's (SamplingRows.histories).
        last = {int(rows.slots[r]): r for r in dry_rows}
        arrays = {slot: np.asarray(rows.histories[r], dtype=np.int64) for slot, r in last.items()}
        for r in dry_rows:
            history = arrays[int(rows.slots[r])][: len(rows.histories[r])]
            ids, pen = dry_penalties(_window(history, int(ints[_I.dry_penalty_last_n, r])),
                                     float(floats[_F.dry_multiplier, r]), float(floats[_F.dry_base, r]),
                                     int(ints[_I.dry_allowed_length, r]), rows.table.breakers[rows.slots[r]])
            keep = ids < self.vocab_size
            at.append(np.full(int(keep.sum()), r, dtype=np.int64))
            toks.append(ids[keep])
            vals.append(pen[keep])
        if not at or not sum(len(a) for a in at):
            return None
        return [(np.concatenate(at), np.int64), (np.concatenate(toks), np.int64), (np.concatenate(vals), np.float32)]

    # --- device side ---
    def adjusted_logits(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Logits after logit bias, bans, penalties, DRY and grammars (a new tensor; the input is left alone)."""
        if (batch.bias is None and batch.eog_ban is None and batch.penalties is None and batch.dry is None
                and batch.allowed is None):
            return logits.float()  # nothing to adjust (compute_logits already returns float32: no copy)
        out = logits.float().clone()
        if batch.bias is not None:
            rows, toks, vals = batch.bias
            out.index_put_((rows, toks), vals, accumulate=True)
        if batch.eog_ban is not None:  # (added, as a bias of -inf is)
            eog = self.eog_ids
            out.index_add_(1, eog, batch.eog_ban.expand(len(out), len(eog)))
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
        if batch.dry is not None:
            rows, toks, vals = batch.dry
            out.index_put_((rows, toks), -vals, accumulate=True)
        if batch.allowed is not None:
            rows, bits = batch.allowed
            allowed = (bits[:, :, None] >> self._bit_shifts).flatten(1)[:, : out.shape[1]] & 1
            out[rows] = out[rows].masked_fill(allowed == 0, -math.inf)
        return out

    def processed(self, logits: torch.Tensor, batch: SamplingBatch) -> Processed:
        """The distribution each row samples from, in sparse form over its top-`width` candidates."""
        adjusted = self.adjusted_logits(logits, batch)
        # Best first. A full sort beats topk when every column is kept (some row has no top-k).
        full = batch.width == adjusted.shape[-1]
        vals, ids = adjusted.sort(dim=-1, descending=True) if full else adjusted.topk(batch.width, dim=-1)
        rank = self._rank[: batch.width]
        # Each filter narrows `keep`, the candidates still in (None: all of them); filters no row uses are skipped.
        keep = rank[None, :] < batch.top_k[:, None] if batch.top_k is not None else None
        if batch.typical_p is not None:
            keep = _and(keep, _typical_keep(vals, keep, batch.typical_p))
        if batch.top_p is not None:
            probs = torch.softmax(_masked(vals, keep), dim=-1)
            before = torch.cumsum(probs, dim=-1) - probs  # mass of better tokens: top-p keeps the one crossing p
            in_top_p = before < batch.top_p[:, None]
            if batch.some_top_p_off:
                in_top_p |= batch.top_p[:, None] >= 1.0
            keep = _and(keep, in_top_p)
        if batch.min_p is not None:  # min-p relative to the best token
            keep = _and(keep, vals >= vals[:, :1] + torch.log(batch.min_p)[:, None])
        if batch.xtc is not None:
            keep = _and(keep, _xtc_keep(vals, keep, rank, *batch.xtc, self.uniform(batch, STREAM_XTC)))
        logp = torch.log_softmax(_masked(vals, keep) / batch.temperature[:, None], dim=-1)
        if batch.greedy is None:
            return Processed(adjusted, logp, ids)
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
            return self.greedy(logits, batch)
        proc = self.processed(logits, batch)
        tokens = self.gumbel_argmax(proc.logp, proc.ids, batch, STREAM_SAMPLE)
        return self.with_logprobs(SampleOutput(tokens), proc.adjusted, batch)

    def greedy(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        """Every row's argmax after bias, bans, penalties and grammar (what a greedy row's processed distribution
        is one-hot at), plus the top-n log-probs when any row asked for them."""
        adjusted = self.adjusted_logits(logits, batch)
        return self.with_logprobs(SampleOutput(adjusted.argmax(dim=-1)), adjusted, batch)

    def with_logprobs(self, out: SampleOutput, adjusted: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        """Fill the n_probs fields of `out` for its token_ids (no-op when no row asked for log-probs)."""
        if batch.n_probs > 0:
            raw = torch.log_softmax(adjusted, dim=-1)
            out.top_logprobs, out.top_ids = raw.topk(min(batch.n_probs, raw.shape[-1]), dim=-1)
            out.chosen_logprob = raw.gather(1, out.token_ids[:, None])[:, 0]
        return out

    def gumbel_argmax(self, logp: torch.Tensor, ids: torch.Tensor, batch: SamplingBatch,
                      stream: int) -> torch.Tensor:
        """Draw from each row of `logp` (unnormalised is fine) with counter-based noise -> token ids [N].

        `ids` [N, C] names the vocab id of each column. Noise is keyed on the vocab id, so the draw does not
        depend on which columns a batch happens to carry."""
        # torch.compile specialises sizes and storage offsets of 0 and 1, and each new variant compiles for
        # seconds inside a request. So the keys are a fresh tensor (the view into the step's upload buffer has an
        # offset that varies), and a lone row (the last request of a batch) or a single candidate (top_k = 1)
        # is padded to 2 rows and columns: every call stays on the variant the warm-up compiled.
        keys = batch.stream_keys[stream][:, None].clone()
        n, c = ids.shape
        if n > 1 and c > 1:
            noise = self._noise(keys, ids)
        else:
            pad_rows, pad_cols = 2 if n == 1 else 1, 2 if c == 1 else 1
            noise = self._noise(keys.repeat(pad_rows, 1), ids.repeat(pad_rows, pad_cols))[:n, :c]
        col = (logp + noise).argmax(dim=-1, keepdim=True)
        return ids.gather(1, col)[:, 0]

    def uniform(self, batch: SamplingBatch, stream: int) -> torch.Tensor:
        """One float32 uniform in (0, 1) per row for (seed, step, stream); the word 2^32-1 is no token id,
        so it is independent of every token's noise on any stream."""
        return _to_unit(_absorb(batch.stream_keys[stream], _M32))


def _seed_key(seed: int) -> int:
    """The hash state after a row's seed: _stream_keys continues it with the step and the stream."""
    return _absorb(_absorb(_SALT, seed & _M32), (seed >> 32) & _M32)


def _stream_keys(seed_keys: np.ndarray, steps: np.ndarray, streams: int) -> np.ndarray:
    """[streams, N] int64 hashes of (seed, step, stream), on the host. The hash uses operators only, so it runs
    on Python ints for a few rows and on numpy arrays for many: whichever costs less for the batch."""
    if len(steps) <= 8:
        keys = [_absorb(k, step) for k, step in zip(seed_keys.tolist(), steps.tolist())]
        return np.array([[_absorb(k, stream) for k in keys] for stream in range(streams)], dtype=np.int64)
    row = _absorb(seed_keys.astype(np.uint64), steps.astype(np.uint64))
    return _absorb(row[None, :], np.arange(streams, dtype=np.uint64)[:, None]).view(np.int64)  # (< 2^32)


def _masked(vals: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """vals with the candidates outside `keep` at -inf (None: all kept)."""
    return vals if keep is None else torch.where(keep, vals, -math.inf)


def _and(keep: torch.Tensor | None, more: torch.Tensor) -> torch.Tensor:
    return more if keep is None else keep & more


def _gumbel_noise(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise for vocab `ids` [N, C] under per-row stream keys [N, 1]."""
    return -torch.log(-torch.log(_to_unit(_absorb(keys, ids))))


def _window(history: Sequence[int], n: int) -> Sequence[int]:
    """The last n tokens of a history (-1: all of it)."""
    return history[-n:] if n > 0 else history if n < 0 else ()


def _xtc_keep(vals: torch.Tensor, keep: torch.Tensor | None, rank: torch.Tensor, probability: torch.Tensor,
              threshold: torch.Tensor, chance: torch.Tensor) -> torch.Tensor:
    """llama.cpp's XTC ("exclude top choices"): with probability `probability` (the row's `chance` below it), when
    at least two candidates have a probability >= threshold (over those still kept, at T=1), drop all of them but
    the least probable. Candidates are sorted best first, so those above the threshold lead."""
    probs = torch.softmax(_masked(vals, keep), dim=-1)
    above = (probs >= threshold[:, None]) & (probs > 0)  # (a token already out has probability 0)
    last = torch.where(above, rank, -1).amax(dim=-1, keepdim=True)  # the least probable one above
    on = (chance <= probability) & (threshold <= 0.5) & (probability > 0)
    return ~(above & (rank < last) & on[:, None])


def _typical_keep(vals: torch.Tensor, keep: torch.Tensor | None, typical_p: torch.Tensor) -> torch.Tensor:
    """llama.cpp typical sampling: keep the tokens whose surprise is closest to the entropy, up to mass p."""
    if keep is None:
        keep = torch.ones_like(vals, dtype=torch.bool)
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
