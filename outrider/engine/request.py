"""Request: one generation stream. It owns its tokens, block table, stop state and timing record."""

from __future__ import annotations

import enum
import itertools
import sys
from dataclasses import dataclass, field

import torch

from outrider.params import SamplingParams
from outrider.structured.grammar import Constraint
from outrider.timing import RequestTiming

_ids = itertools.count()


class Status(enum.Enum):
    """Where a request stands with the scheduler."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS/EOG token, stop token id or stop string
    LENGTH = "length"  # max_tokens reached
    CONTEXT = "context"  # context window full (reported as "length" by the OpenAI routes)
    ABORT = "abort"  # cancelled (client gone) or failed
    ERROR = "error"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass(frozen=True)
class PromptLogprob:
    """(engine/prompt_logprobs.py) A prompt token's log-probability given the tokens before it, its rank among the vocabulary (1 = the most
    probable), and the top-n (token id, log-prob), best first."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class Pooled:
    """A request's pooling so far, on the host (engine/pooling.py)."""

    mode: str
    rows: list[torch.Tensor] = field(default_factory=list)  # float32 [n, H] parts: sums (mean) or rows
    count: int = 0  # prompt rows seen

    def result(self) -> torch.Tensor:
        """[H] for mean, cls and last; [prompt, H] for none."""
        stacked = torch.cat(self.rows)
        if self.mode == "mean":
            return stacked.sum(0) / self.count
        return stacked if self.mode == "none" else stacked[0]


@dataclass(frozen=True)
class PromptProgress:
    """Prefill progress (llama-server's `prompt_progress`): prompt tokens in all, from the cache, and scheduled
    so far (the cached ones included), at time `t` (timing.now)."""

    total: int
    cache: int
    processed: int
    t: float


@dataclass
class RequestOutput:
    """What one engine step tells the owner of a request (delivered in order, one per commit)."""

    request_id: int
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_type: str = "none"  # llama-server: none | eos | word | limit
    stopping_word: str = ""
    logprobs: list[TokenLogprob] | None = None
    # How many of new_token_ids, from the first, are drafts the target accepted; the rest are the target's own
    # tokens (a correction or the bonus token). 0 without speculation.
    accepted_drafts: int = 0
    # The request's live record (AsyncEngine hands its consumers a snapshot as of this output); render with
    # to_timings().
    timing: RequestTiming | None = None
    error: str | None = None
    # The text each of new_token_ids added, in order (one per token; "" inside a multi-byte character or while a
    # stop string may still match: held-back text arrives with a later token).
    token_texts: list[str] = field(default_factory=list)
    progress: PromptProgress | None = None  # on prefill reports of a request with return_progress

    @property
    def text(self) -> str:
        """The new text, safe to show (complete UTF-8, nothing a stop string may still claim)."""
        return "".join(self.token_texts)


@dataclass(eq=False)  # identity: the scheduler's queue operations compare requests, never their contents
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: int = field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)  # block table, in order
    num_computed: int = 0  # tokens whose K/V are in the cache or being written by a launched step
    # Sampled tokens not yet on the host. With overlap scheduling the next step is launched (feeding the
    # pending token from device memory) before the previous step's token arrives, so briefly there are two.
    num_pending: int = 0
    # Outputs the request may produce: max_tokens, capped by what fits in the context (set by Engine.add_request).
    # Commit stops a request when its outputs reach it; the scheduler, when its outputs and pending token do.
    max_output_tokens: int = sys.maxsize
    sample_row: int = -1  # row of its token in the sampled ids of the last step launched for it (ModelRunner)
    finish_reason: FinishReason | None = None
    timing: RequestTiming = field(default_factory=RequestTiming)
    seed: int = 0  # resolved seed (engine fills it when params.seed is None)
    num_preemptions: int = 0
    id_slot: int = -1  # llama-server slot id that serves this request (set by the engine)
    slot_wanted: int = -1  # llama-server `id_slot`: the only slot this request may run in (-1: any)
    return_progress: bool = False  # report prefill progress (outputs with `progress`, and no tokens until the first)
    # Per prompt position, once its prefill row ran (params.prompt_logprobs; engine/prompt_logprobs.py): None at
    # position 0, which no row predicts
    prompt_logprobs: list[PromptLogprob | None] | None = None
    pooled: Pooled | None = None  # the prompt's pooled hidden states (params.pooling; engine/pooling.py)
    # Prefix-cache publishing progress (BlockPool.commit_full_blocks): leading blocks already walked, the chain
    # hash of the last of them, and blocks whose hash another block held (published once that one is gone).
    num_hashed_blocks: int = 0
    last_block_hash: int | None = None
    unpublished: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)
    # The matcher of params.grammar, at the committed outputs (None: unconstrained). Made with the request, when
    # the HTTP layer validates it: a grammar's cost is paid before the engine sees the request.
    constraint: Constraint | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.constraint is None and self.params.grammar is not None:
            self.constraint = Constraint(self.params.grammar)

    @property
    def all_ids(self) -> list[int]:
        """A new list of every token (prompt + outputs): O(length), so hot paths use token_slice."""
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, stop: int) -> list[int]:
        """all_ids[start:stop] without building all_ids (0 <= start <= stop)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n : stop - n]
        if stop <= n:
            return self.prompt_ids[start:stop]
        return self.prompt_ids[start:] + self.output_ids[: stop - n]

    @property
    def outputs_left(self) -> int:
        """Outputs the request may still produce beyond those known and pending (0: the limit is reached)."""
        return self.max_output_tokens - len(self.output_ids) - self.num_pending

    @property
    def num_tokens(self) -> int:
        """Sequence length, counting a pending token (token_slice and all_ids hold only the known ones)."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    def limit_outputs(self, max_model_len: int) -> None:
        """Set max_output_tokens: max_tokens (-1: no limit), capped by what fits in a context of max_model_len."""
        context_left = max_model_len - self.num_prompt
        max_tokens = self.params.max_tokens
        self.max_output_tokens = context_left if max_tokens < 0 else min(max_tokens, context_left)

    def limit_reason(self, num_outputs: int) -> FinishReason:
        """Which limit num_outputs (>= max_output_tokens) reached: max_tokens (LENGTH), else the context."""
        return FinishReason.LENGTH if 0 <= self.params.max_tokens <= num_outputs else FinishReason.CONTEXT

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)
