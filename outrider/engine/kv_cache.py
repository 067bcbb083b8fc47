"""BlockPool: the paged KV cache's block accounting, with reference counts and prefix caching.

Pure CPU bookkeeping; the tensors live in outrider.attention.KVCache. A full block whose tokens are all known
gets a chained hash (hash of the previous block's hash and its own tokens), so a later request whose prompt
starts with the same tokens reuses those blocks instead of recomputing them. Freed cached blocks stay
findable until their memory is needed (least recently freed first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from outrider.engine.request import Request


def chain_hash(prev: int | None, tokens: tuple[int, ...]) -> int:
    return hash((prev, tokens))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set once the block is full of committed tokens
    tokens: tuple[int, ...] = field(default=())  # kept with the hash so a collision can never alias blocks


class Snapshots(Protocol):
    """A hybrid model's state snapshots by block hash (engine/state_pool.py): a prefix hit must end at one."""

    def longest_snapshot(self, keys: Sequence[int]) -> int: ...

    def drop(self, key: int) -> None: ...


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 snapshots: Snapshots | None = None):
        """snapshots: a hybrid model's, which a prefix hit is cut to (no snapshot, no hit) and which leave with
        their blocks."""
        if num_blocks < 2:
            raise ValueError("the KV pool needs at least 2 blocks")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.snapshots = snapshots
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order (oldest first). Block 0 is reserved as the padding target.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.hits = 0  # prompt tokens served from the cache (lifetime)
        # Blocks holding target K/V whose drafter K/V was never written (the drafter slept through those rows): a
        # prefix hit on one must not hand the drafter what an earlier owner of the block left there.
        self.drafter_stale: set[int] = set()
        # While set, the drafter sleeps through every running request's rows (the Speculator's dormant path): the
        # blocks their decoding grows into are marked so as they are taken, not row by row.
        self.drafter_asleep = False

    # --- capacity ---
    @property
    def num_blocks(self) -> int:
        return len(self.blocks) - 1  # usable (block 0 is reserved)

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_needed(self, req: Request, num_tokens: int) -> int:
        """Blocks to add so that req's table covers num_tokens positions."""
        need = -(-num_tokens // self.block_size)
        return max(0, need - len(req.block_ids))

    # --- prefix cache ---
    def match_prefix(self, req: Request) -> list[int]:
        """Ids of cached blocks that hold a prefix of req's known tokens (always leaving one token to compute)."""
        if not (self.enable_prefix_caching and req.params.cache_prompt) or req.params.reads_every_prompt_row:
            return []
        if self.snapshots is not None and req.params.prompt_logprobs is not None:
            return []  # (a hybrid model cannot recompute the cached rows' hidden states their log-probs need)
        ids = req.all_ids
        bs = self.block_size
        matched: list[int] = []
        hashes: list[int] = []
        prev = None
        for start in range(0, len(ids) - 1 - bs + 1, bs):
            toks = tuple(ids[start : start + bs])
            h = chain_hash(prev, toks)
            bid = self.cached.get(h)
            if bid is None or self.blocks[bid].tokens != toks:
                break
            matched.append(bid)
            hashes.append(h)
            prev = h
        if self.snapshots is not None and matched:
            return matched[: self.snapshots.longest_snapshot(hashes)]
        return matched

    def admit(self, req: Request, budget: int) -> int:
        """Give a waiting request its cached prefix and room for its first chunk (the rest of its known tokens, at
        most `budget`); returns the chunk's size, or 0 (and nothing taken) if it does not fit."""
        matched = self.match_prefix(req)
        num_cached = len(matched) * self.block_size
        num_new_tokens = min(req.num_tokens - num_cached, budget)
        need = -(-(num_cached + num_new_tokens) // self.block_size) - len(matched)
        reusable_free = sum(1 for b in matched if self.blocks[b].ref_count == 0)
        if need > self.num_free - reusable_free:
            return 0
        for bid in matched:
            self._take(bid)
        self._set_blocks(req, matched)
        req.num_computed = num_cached
        self.hits += num_cached
        self._grow(req, need)
        return num_new_tokens

    def ensure(self, req: Request, num_tokens: int) -> bool:
        """Grow req's block table to cover num_tokens positions; False (and nothing taken) if no room."""
        if num_tokens <= len(req.block_ids) * self.block_size:  # the common case: a decode inside its last block
            return True
        need = self.blocks_needed(req, num_tokens)
        if need > self.num_free:
            return False
        self._grow(req, need)
        if self.drafter_asleep:
            self.drafter_stale.update(req.block_ids[-need:])
        return True

    def commit_full_blocks(self, req: Request, num_committed: int) -> None:
        """Publish the hashes of req's blocks that are now full of committed tokens.

        Incremental: the request remembers how many leading blocks were walked and the chain hash there, so a
        step hashes only blocks that filled since the last call instead of re-walking the whole context."""
        if not self.enable_prefix_caching:
            return
        if req.unpublished:
            req.unpublished = [d for d in req.unpublished if not self._publish(*d)]
        bs = self.block_size
        if num_committed // bs <= req.num_hashed_blocks:  # the common case: no block filled since the last call
            return
        full = min(num_committed, req.num_tokens) // bs
        prev = req.last_block_hash
        for i in range(req.num_hashed_blocks, full):
            bid = req.block_ids[i]
            block = self.blocks[bid]
            if block.block_hash is not None:  # shared from the prefix cache
                prev = block.block_hash
                continue
            toks = tuple(req.token_slice(i * bs, (i + 1) * bs))
            prev = chain_hash(prev, toks)
            if not self._publish(bid, prev, toks):
                # Another block holds these tokens (e.g. the same prompt prefilled concurrently); retried each
                # call so that this block becomes findable once the other one is evicted.
                req.unpublished.append((bid, prev, toks))
        if full > req.num_hashed_blocks:
            req.num_hashed_blocks, req.last_block_hash = full, prev

    def free_request(self, req: Request) -> None:
        """Drop req's references; tail blocks go to the eviction queue first."""
        for bid in reversed(req.block_ids):
            block = self.blocks[bid]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {bid} freed twice"
            if block.ref_count == 0:
                self.free[bid] = None
        self._set_blocks(req, [])
        req.num_computed = 0

    def reset_prefix_cache(self) -> None:
        for h, bid in list(self.cached.items()):
            if self.blocks[bid].ref_count == 0:
                self._forget(bid)

    # --- the drafter's K/V (same block ids) ---
    def mark_drafter_stale(self, req: Request, start: int, end: int) -> None:
        """The drafter did not write positions start..end-1 of req."""
        bs = self.block_size
        self.drafter_stale.update(req.block_ids[start // bs: (end - 1) // bs + 1])

    def mark_drafter_written(self, req: Request, start: int) -> None:
        """The drafter has written every position of req from `start` on (it caught up)."""
        if self.drafter_stale:
            self.drafter_stale.difference_update(req.block_ids[start // self.block_size:])

    def drafter_written_until(self, req: Request, end: int) -> int:
        """The first position before `end` in a block of req that the drafter did not write (`end` if none): where
        a prefix hit's drafter context stops being valid."""
        if self.drafter_stale:
            for i, bid in enumerate(req.block_ids[: -(-end // self.block_size)]):
                if bid in self.drafter_stale:
                    return min(i * self.block_size, end)
        return end

    # --- internals ---
    @staticmethod
    def _set_blocks(req: Request, block_ids: list[int]) -> None:
        """Give req a new block table (a new list: ModelRunner tells tables apart by identity); hashing restarts."""
        req.block_ids = block_ids
        req.num_hashed_blocks, req.last_block_hash, req.unpublished = 0, None, []

    def _publish(self, bid: int, h: int, toks: tuple[int, ...]) -> bool:
        """Make block bid findable under hash h, unless another block already is; True if published."""
        if h in self.cached:
            return False
        block = self.blocks[bid]
        block.block_hash, block.tokens = h, toks
        self.cached[h] = bid
        return True

    def _grow(self, req: Request, n: int) -> None:
        for _ in range(n):
            bid, _ = self.free.popitem(last=False)
            self._forget(bid)
            self.blocks[bid].ref_count = 1
            req.block_ids.append(bid)

    def _take(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.ref_count == 0:
            del self.free[bid]
        block.ref_count += 1

    def _forget(self, bid: int) -> None:
        block = self.blocks[bid]
        self.drafter_stale.discard(bid)  # (taken for new tokens, or dropped from the cache)
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) == bid:
                del self.cached[block.block_hash]
                if self.snapshots is not None:  # (no hit can reach the state at its end any more)
                    self.snapshots.drop(block.block_hash)
            block.block_hash, block.tokens = None, ()
