"""Continuous-batching policy: which requests run this step and how many tokens each feeds.

Pure CPU. Each step has a token budget; running requests go first (decodes, prefill chunks in progress,
speculative verify rows), then waiting requests are admitted while slots, budget and KV blocks allow. A
request whose prompt is longer than the remaining budget is prefilled in chunks across steps (chunked
prefill, mixed with the decodes of others). When KV blocks run out, the most recently admitted request is
preempted: its blocks are freed and it waits to recompute (prompt and outputs so far) later.

A hybrid model's requests also own a state slot (engine/linear_state.py) from admission to finish or preemption; a
prefill chunk ends at the block boundary where its state is snapshotted for prefix hits; and a step with a prompt
chunk verifies no drafts (a verify forward leaves the linear layers' slots alone, which a prompt chunk must advance):
its decoding requests feed their one token and draft again the step after.
"""

from __future__ import annotations

from collections import deque

from outrider.engine.kv_cache import BlockPool
from outrider.engine.linear_state import LinearStateSlots
from outrider.engine.request import Request
from outrider.steps import ScheduledRequest, Status, StepPlan


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 states: LinearStateSlots | None = None):
        """states: a hybrid model's state slots."""
        self.pool = pool
        self.states = states
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        # Replaced, never changed in place, when a request joins or leaves it: whoever kept it can tell the batch
        # is the same by identity, without reading it (the Speculator's dormant path).
        self.running: list[Request] = []
        self.free_slots = list(range(max_num_seqs))

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, req: Request) -> None:
        """Take a request out of the queues and give back its blocks and slot (finish or abort)."""
        if req in self.running:
            self.running = [r for r in self.running if r is not req]
        elif req in self.waiting:
            self.waiting.remove(req)
        self._free(req)
        if req.id_slot >= 0 and req.id_slot not in self.free_slots:
            self.free_slots.append(req.id_slot)
            self.free_slots.sort()
        # req.id_slot is kept: the final response reports the slot that served the request.

    def schedule(self, drafts: dict[int, list[int]] | None = None) -> StepPlan:
        """Plan one step. drafts maps request_id -> proposed tokens for requests that are decoding."""
        drafts = drafts or {}
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        admitted: list[Request] = []

        prompt_rows = False  # (a row whose outputs have begun and that feeds one token is past its prompt)
        queue = deque(self.running)  # served from the front; preemption victims come off the back
        while queue and budget > 0:
            req = queue.popleft()
            if req.num_pending and req.outputs_left <= 0:
                continue  # its token in flight is its last (overlap scheduling)
            todo = req.num_tokens - req.num_computed
            n = todo if todo < budget else budget  # (min() costs several times more, per request per step)
            if self.states is not None and n > 1:
                n = self.states.chunk_end(req, req.num_computed, n)
            draft = drafts.get(req.request_id) if drafts and todo == 1 else None  # drafts follow a decode's one token
            draft = draft[: max(0, min(budget - n, self.max_model_len - req.num_tokens))] if draft else []
            while not self.pool.ensure(req, req.num_computed + n + len(draft)):
                victim = queue.pop() if queue else req
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                scheduled.append(ScheduledRequest(req, req.num_computed, n, n == todo, draft))
                budget -= n + len(draft)
                prompt_rows = prompt_rows or todo > 1 or not req.output_ids

        passed = 0  # waiting requests passed over because the slot they asked for (id_slot) is busy
        while len(self.waiting) > passed and budget > 0 and self.free_slots and not preempted:
            req = self.waiting[passed]
            slot = self._slot_for(req)
            if slot is None:
                passed += 1  # it keeps its place; later requests may take other slots
                continue
            n = self.pool.admit(req, budget)
            if not n:
                break
            if self.states is not None:
                n = self.states.chunk_end(req, req.num_computed, n)
                self.states.admit(req, self._hit_hash(req))
            del self.waiting[passed]
            req.status = Status.RUNNING
            self.free_slots.remove(slot)
            req.id_slot = slot
            admitted.append(req)
            scheduled.append(ScheduledRequest(req, req.num_computed, n, req.num_computed + n == req.num_tokens))
            budget -= n
        if admitted:
            self.running = self.running + admitted
        if self.states is not None and drafts and any(s.num_new_tokens > 1 or not s.samples for s in scheduled):
            for s in scheduled:
                s.draft_tokens = []
        return StepPlan(scheduled, preempted, admitted, prompt_rows or bool(admitted))

    def recompute_states(self, requests: list[Request]) -> list[Request]:
        """After a failed step: preempt those of `requests` still running to recompute them, if their model keeps
        linear-attention states (a layer's state may have advanced part way); returns the ones preempted."""
        if self.states is None:
            return []
        requeued = [req for req in requests if req in self.running]
        for req in requeued:
            self._preempt(req)
        return requeued

    def _hit_hash(self, req: Request) -> int | None:
        """The hash of the last block of req's prefix hit (None: no hit)."""
        n = req.num_computed // self.pool.block_size
        return self.pool.blocks[req.block_ids[n - 1]].block_hash if n else None

    def _free(self, req: Request) -> None:
        """Give back req's blocks and state slot."""
        self.pool.free_request(req)
        if self.states is not None:
            self.states.release(req)

    def _slot_for(self, req: Request) -> int | None:
        """The free slot `req` would take (the one it asked for, else the lowest), or None."""
        if req.slot_wanted < 0:
            return self.free_slots[0]
        return req.slot_wanted if req.slot_wanted in self.free_slots else None

    def _preempt(self, req: Request) -> None:
        self.running = [r for r in self.running if r is not req]
        self._free(req)
        req.status = Status.WAITING
        req.num_preemptions += 1
        if req.id_slot >= 0:
            self.free_slots.append(req.id_slot)
            self.free_slots.sort()
            req.id_slot = -1
        self.waiting.appendleft(req)
