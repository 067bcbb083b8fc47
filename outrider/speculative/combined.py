"""Several drafter kinds behind one Drafter (llama-server's comma-separated --spec-type).

The rule: for each request, the weightless kinds (n-gram lookup) are asked first, in the order configured, and
the first that drafts wins; only the requests none of them drafted for go to the model drafter (at most one: a
draft model, MTP, DFlash or EAGLE-3). An n-gram draft exists only where the context repeats itself, where the
target accepts long runs of it, and it costs nothing on the device; the model drafter's forwards are then spent
only where lookup has nothing to offer. llama-server gives draftless kinds the same precedence.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from outrider.attention import KVCache
from outrider.speculative.drafter import Commit, Drafter, Proposals

if TYPE_CHECKING:
    from outrider.engine.request import Request


def has_pool(drafter: Drafter) -> bool:
    return drafter.kv_shape[0] > 0


class CombinedDrafter:
    def __init__(self, members: Sequence[Drafter]) -> None:
        models = [m for m in members if has_pool(m)]
        if len(models) > 1:
            raise ValueError(f"at most one model drafter can be combined; got {', '.join(m.kind for m in models)}")
        self.members = list(members)
        self.model = models[0] if models else None
        self.order = [m for m in members if not has_pool(m)] + models  # who is asked first
        self.kind = ",".join(m.kind for m in members)
        self.aux_layer_ids = self.model.aux_layer_ids if self.model else ()
        self.reads_hidden = any(m.reads_hidden for m in members)
        self.learns = any(m.learns for m in members)
        self.stages_on_device = False  # (members' proposals are merged on the host)
        self.drafts_ahead = False
        self.max_draft = max(m.max_draft for m in members)
        self.step_cost = max(m.step_cost for m in members)  # the dearest member bounds what a round may cost
        self.kv_shape = self.model.kv_shape if self.model else (0, 0, 0)
        self.kv: KVCache | None = self.model.kv if self.model else None

    def lookahead(self, k: int) -> int:
        return max(m.lookahead(k) for m in self.members)

    def may_propose(self, request: Request) -> bool:
        return any(m.may_propose(request) for m in self.members)

    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> Proposals:
        n = len(requests)
        out = Proposals([[] for _ in range(n)], [[] for _ in range(n)], [None] * n, [self.order[0].kind] * n)
        left = list(range(n))
        for member in self.order:
            if not left:
                break
            props = member.propose([requests[i] for i in left], [ks[i] for i in left])
            for j, i in enumerate(left):
                if props.tokens[j]:
                    out.tokens[i], out.confidence[i], out.kinds[i] = props.tokens[j], props.confidence[j], member.kind
                    out.probs[i] = props.probs[j] if props.probs is not None else None
            left = [i for j, i in enumerate(left) if not props.tokens[j]]
        if all(q is None for q in out.probs):
            out.probs = None
        return out

    def on_commit(self, commits: Sequence[Commit], hidden: torch.Tensor | None,
                  aux_hidden: torch.Tensor | None) -> None:
        for m in self.members:
            m.on_commit(commits, hidden, aux_hidden)

    def release(self, request_id: int) -> None:
        for m in self.members:
            m.release(request_id)

    def capture_graphs(self, max_batch: int, max_model_len: int, pool) -> None:
        for m in self.members:
            m.capture_graphs(max_batch, max_model_len, pool)
