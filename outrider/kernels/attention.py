"""Paged attention in Triton: one kernel for decode, verify, prefill and extend.

Rows of a tile are (query token, query head) pairs of ONE KV head: row r is token r // GROUP, head
kv_head * GROUP + r % GROUP. Packing the GQA group this way lets a single decode token fill a tensor-core tile
and makes each K/V tile serve every head that shares it.

Long contexts with few programs are split along the KV axis (flash-decoding). The grid is sized from host
upper bounds (AttentionMetadata), so a CUDA graph captured with max_seq_len = the model's limit replays for any
shorter context; each program derives its split's key range from the sequence's ACTUAL length, with at least
MIN_SPLIT_KEYS keys per split (VERIFY_MIN_SPLIT_KEYS for tiles of several query tokens). A sequence whose keys fit
one split is written directly by that split's program (the other splits return at once); otherwise each split
writes a partial output and its log-sum-exp, and the last split of a tile to finish (an arrival counter) merges
them, so no second kernel is ever launched.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from outrider.attention import AttentionMetadata
from outrider.kernels.fused import PREFETCH_LINE_BYTES, pdl_enter, prefetch_l2
from outrider.kernels.ops import cuda_properties, pdl_args, use_pdl

_LOG2E = 1.4426950408889634
# Fewest keys a split gets. Splitting costs the last split ~2 extra L2 round trips (arrival atomic, partial
# reads); two 64-key tiles cost about as much, so a context of up to 128 keys is one program and no merge.
# 256 (a 256-key context one program) measured no faster on an H200: Qwen3-0.6B batch 1, 1068 vs 1076 tok/s.
MIN_SPLIT_KEYS = 128
# Fewest keys a split gets when a tile holds several query tokens (verify, DFlash block): there a split's partial
# outputs and merge cost more than walking the keys. H200, Qwen3-8B layer, 16 queries over 300 keys planned for
# 40960 (scripts/sweep_verify_attention.py): 27.8 us split 3 ways, 9.6 us in one program; 5 queries 17.3 -> 9.9.
VERIFY_MIN_SPLIT_KEYS = 1024
# A split launch has at most this many programs per SM, so that many arrival counters per SM suffice.
_PROGRAMS_PER_SM = 4


@triton.jit
def _merge_rows(out_ptr, part_o_ptr, part_lse_ptr, first_row, n_rows, q_start, kvh, n_live, num_tokens,
                GROUP: tl.constexpr, N_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                ROWS: tl.constexpr, CHUNK: tl.constexpr):
    """Writes the final output of ROWS tile rows from the partials of splits 0..n_live-1 (log-sum-exp weighted).

    ROWS * CHUNK is kept small (the wrapper sizes ROWS to the real rows, up to 16) so the merge needs no more
    registers than the decode tile's KV loop, and a decode tile of GROUP rows reads many splits per load."""
    rows = first_row + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    row_tok = (q_start + rows // GROUP).to(tl.int64)
    head = kvh * GROUP + rows % GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    m = tl.full([ROWS], -1.0e30, tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for first in tl.range(0, n_live, CHUNK, num_stages=3):  # pipelined: later chunks load while one adds up
        s = first + tl.arange(0, CHUNK)
        ok = (s < n_live)[:, None] & row_ok[None, :]
        idx = (s.to(tl.int64)[:, None] * num_tokens + row_tok[None, :]) * N_HEADS + head[None, :]
        lse = tl.load(part_lse_ptr + idx, mask=ok, other=float("-inf"))
        o = tl.load(part_o_ptr + idx[:, :, None] * HEAD_DIM + d[None, None, :],
                    mask=ok[:, :, None] & d_ok[None, None, :], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, 0))
        alpha = tl.math.exp2(m - m_new)
        w = tl.math.exp2(lse - m_new[None, :])  # a split that saw no key for a row has lse = -inf: weight 0
        l = l * alpha + tl.sum(w, 0)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 0)
        m = m_new
    res = acc / tl.where(l > 0, l, 1.0)[:, None]
    o_off = row_tok[:, None] * (N_HEADS * HEAD_DIM) + head[:, None] * HEAD_DIM + d[None, :]
    tl.store(out_ptr + o_off, res.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


# Per-step ints are not specialised on: a new batch width or token count must never trigger a recompile.
# window: sliding-window attention (0: none), a value rather than a variant, so windowed layers compile nothing more.
@triton.jit(do_not_specialize=["num_splits", "num_tokens", "stride_bt", "window"])
def _attn_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_o_ptr, part_lse_ptr, arrivals_ptr,
    block_tables_ptr, seq_lens_ptr, qsl_ptr,
    scale_log2, num_splits, num_tokens, stride_bt, window,
    GROUP: tl.constexpr, N_KV: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    SPLIT: tl.constexpr, MIN_SPLIT: tl.constexpr, PREFETCH_KEYS: tl.constexpr, MERGE_ROWS: tl.constexpr,
    PRECISION: tl.constexpr, KEY_LINES: tl.constexpr, LINE: tl.constexpr, USE_PDL: tl.constexpr,
):
    # Every tensor is contiguous (the wrapper guarantees it), so strides follow from the shapes: fewer
    # launch arguments, which is most of Triton's per-launch host cost.
    stride_qt = N_KV * GROUP * HEAD_DIM  # q, out: [T, Hq, D]; part_o: [S, T, Hq, D]; part_lse: [S, T, Hq]
    stride_ks = N_KV * HEAD_DIM  # k/v cache: [NB, PAGE, Hkv, D]
    stride_kb = PAGE * stride_ks
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    m_block = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits

    # The three metadata loads are independent: issued together, they cost one memory round trip. Under PDL
    # they come before the wait on the previous kernel: metadata is copied in before a graph replays, and no
    # kernel of the step writes it.
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    n_rows = q_len * GROUP
    ctx_start = seq_len - q_len  # absolute position of this sequence's first query token
    # Keys any query of the sequence sees start at seq_lo: 0, or with a sliding window (window > 0) its first
    # query's window, so the splits share the window's keys rather than the whole context's.
    win = tl.where(window > 0, window, 1 << 30)
    seq_lo = tl.maximum(ctx_start - win + 1, 0)
    # This sequence's split length (whole tiles, >= MIN_SPLIT keys) and how many splits hold keys (>= 1, so
    # a padding row with seq_len 0 still gets its zeros written, by split 0).
    per_split = tl.maximum(tl.cdiv(tl.cdiv(seq_len - seq_lo, num_splits), BLOCK_N) * BLOCK_N, MIN_SPLIT)
    n_live = tl.maximum(tl.cdiv(seq_len - seq_lo, per_split), 1)
    idle = (m_block * BLOCK_M >= n_rows) | (split >= n_live)

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = rows < n_rows
    q_pos = ctx_start + tok
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    # Keys this tile can see: the whole context, or (causal) up to its last query token's position.
    if CAUSAL:
        last_tok = (tl.minimum(m_block * BLOCK_M + BLOCK_M, n_rows) - 1) // GROUP  # tile's last query token
        kv_end = tl.minimum(ctx_start + last_tok + 1, seq_len)
    else:
        kv_end = seq_len
    # A sliding window: keys before the tile's first query's window are skipped, and the mask below drops those
    # each row's window leaves out.
    first_pos = ctx_start + (m_block * BLOCK_M) // GROUP
    lo = tl.maximum(seq_lo + split * per_split, first_pos - win + 1)
    hi = tl.minimum(seq_lo + split * per_split + per_split, kv_end)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if USE_PDL:
        # The keys before this step's are in the cache already (L2 is coherent, so prefetching the newest ones
        # early is harmless too): bring this program's first PREFETCH_KEYS keys (all of a decode split's, usually)
        # of K and V into L2 while the previous kernel finishes. Positions and in-key offsets are clamped: every
        # prefetched address is valid.
        if idle == 0:
            p_pos = tl.minimum(lo + tl.arange(0, PREFETCH_KEYS), tl.maximum(hi - 1, 0))
            p_blk = tl.load(bt_row + p_pos // PAGE).to(tl.int64)
            p_off = p_blk * stride_kb + (p_pos % PAGE) * stride_ks + kvh * HEAD_DIM
            p_off = p_off[:, None] + tl.minimum(tl.arange(0, KEY_LINES) * LINE, HEAD_DIM - 1)[None, :]
            prefetch_l2(k_ptr + p_off)
            prefetch_l2(v_ptr + p_off)
    # Idle programs wait too: were all of a grid's programs to leave early, it could finish before the kernel
    # it depends on, and the next kernel's wait on this one would no longer cover that one.
    pdl_enter(USE_PDL)
    if idle:
        return
    q_off = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * HEAD_DIM + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # Finite start value: a row masked over a whole tile then gives p = 0 and alpha = 1 instead of NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        k_ok = k_pos < hi
        blk = tl.load(bt_row + k_pos // PAGE, mask=k_ok, other=0).to(tl.int64)
        page_off = k_pos % PAGE
        kv_off = blk * stride_kb + page_off * stride_ks + kvh * HEAD_DIM
        kt = tl.load(k_ptr + kv_off[None, :] + d[:, None], mask=k_ok[None, :] & d_ok[:, None], other=0.0)
        # V is loaded with K, before the softmax needs it: one memory round trip per tile, not two.
        v = tl.load(v_ptr + kv_off[:, None] + d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        qk = tl.dot(q, kt.to(q.dtype), input_precision=PRECISION) * scale_log2
        mask = k_ok[None, :] & (k_pos[None, :] + win > q_pos[:, None])
        if CAUSAL:
            mask = mask & (k_pos[None, :] <= q_pos[:, None])
        qk = tl.where(mask, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        m_i = m_new

    # Rows that saw no key (padding: seq_len 0) come out as zeros, never NaN.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    row_tok = (q_start + tok).to(tl.int64)
    st_mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        if n_live > 1:
            lse = tl.where(l_i > 0, m_i + tl.math.log2(l_i), float("-inf"))
            row = split.to(tl.int64) * num_tokens + row_tok  # flat (split, token) index
            p_off = row[:, None] * stride_qt + head[:, None] * HEAD_DIM + d[None, :]
            tl.store(part_o_ptr + p_off, out, mask=st_mask)
            tl.store(part_lse_ptr + row * (N_KV * GROUP) + head, lse, mask=row_ok)
            # Every thread's partial is stored before the (release) arrival; the last split to arrive (acquire)
            # merges and re-arms the counter, so it is zero for the next launch or graph replay.
            tl.debug_barrier()
            counter = arrivals_ptr + seq * N_KV + kvh  # one tile per (sequence, KV head) when splitting
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") < n_live - 1:
                return
            tl.store(counter, 0)
            for r in tl.static_range(0, BLOCK_M, MERGE_ROWS):
                if r < n_rows:  # (m_block is 0 when splitting)
                    _merge_rows(out_ptr, part_o_ptr, part_lse_ptr, r, n_rows, q_start, kvh, n_live, num_tokens,
                                GROUP, N_KV * GROUP, HEAD_DIM, BLOCK_D, MERGE_ROWS, 32 // MERGE_ROWS)
            return
    o_off = row_tok[:, None] * stride_qt + head[:, None] * HEAD_DIM + d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=st_mask)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":  # Triton's CPU interpreter (tests): pretend to be an H200
        return 132
    return cuda_properties(device).multi_processor_count


_ARRIVALS: dict[torch.device, torch.Tensor] = {}


def _arrival_counters(device: torch.device, num_sms: int) -> torch.Tensor:
    """The device's split-arrival counters, one per (sequence, KV head) tile of a split launch. Zeroed once
    and never reallocated (CUDA graphs keep its address); each launch leaves them zero again. Launches on one
    device must therefore not run concurrently on different streams."""
    counters = _ARRIVALS.get(device)
    if counters is None:
        # Allocated inside a capture, they would live in the graph's private pool, free for other tensors later.
        # The graph runners warm up eagerly before capturing, so the first split launch is never a captured one.
        assert device.type != "cuda" or not torch.cuda.is_current_stream_capturing(), "first split launch in capture"
        counters = _ARRIVALS[device] = torch.zeros(_PROGRAMS_PER_SM * num_sms, dtype=torch.int32, device=device)
    return counters


class LaunchPlan(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    m_blocks: int
    splits: int
    min_split: int  # fewest keys a split gets (the kernel spreads each sequence's actual keys by it)


def plan_launch(num_seqs: int, n_kv_heads: int, group: int, max_query_len: int, max_seq_len: int,
                num_sms: int) -> LaunchPlan:
    """Tile sizes, pipeline depth and grid for one call, from host-side upper bounds."""
    rows = max_query_len * group
    if rows <= 64:  # decode / verify / short drafts: one m-block, the KV stream is the cost
        block_m, block_n, warps = max(16, triton.next_power_of_2(rows)), 64, 4
    else:
        block_m, block_n, warps = 128, 64, 8
    m_blocks = triton.cdiv(rows, block_m)
    programs = num_seqs * n_kv_heads * m_blocks
    splits, stages = 1, 2
    min_split = MIN_SPLIT_KEYS if rows <= 16 else VERIFY_MIN_SPLIT_KEYS
    if rows <= 64 and programs < _PROGRAMS_PER_SM * num_sms:
        # Resident programs run their KV loops side by side, so time ~ keys per program: split up to 4 programs
        # per SM, never more (one arrival counter each). The kernel spreads each sequence's actual keys over at
        # most this many splits.
        splits = max(1, min(_PROGRAMS_PER_SM * num_sms // programs, triton.cdiv(max_seq_len, min_split), 32))
        if splits > 1 and block_m == 16:
            # A decode split walks a few tiles, each a dependent memory round trip: fewer, larger tiles and no
            # software pipelining (its prologue is pure latency here). H200, batch 1, 200-330 keys planned for
            # 40960: 9.3 -> 6.0-7.8 us. (Taller verify tiles keep 64 keys: registers.)
            block_n, stages = 128, 1
    return LaunchPlan(block_m, block_n, warps, stages, m_blocks, splits, min_split)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, out: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """q [T, Hq, D] over the paged cache [NB, page, Hkv, D] -> out [T, Hq, D] (q's dtype); window > 0: each query
    sees the keys of its last `window` positions (AttentionBackend.forward)."""
    q = q.contiguous()  # no-op for the usual [T, Hq, D] projection output
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the paged KV cache must be contiguous [num_blocks, page, n_kv_heads, head_dim]")
    t, n_heads, head_dim = q.shape
    n_kv = k_cache.shape[2]
    group = n_heads // n_kv
    if out is None:
        out = torch.empty((t, n_heads, head_dim), dtype=q.dtype, device=q.device)
    if t == 0 or meta.max_query_len == 0:
        return out
    num_sms = _num_sms(q.device)
    pdl = use_pdl(q)
    plan = plan_launch(meta.num_seqs, n_kv, group, meta.max_query_len, meta.max_seq_len, num_sms)
    splits = plan.splits
    block_d = max(16, triton.next_power_of_2(head_dim))
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 models must match the oracle closely
    if splits > 1:
        part_o = torch.empty((splits, t, n_heads, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((splits, t, n_heads), dtype=torch.float32, device=q.device)
        arrivals = _arrival_counters(q.device, num_sms)
        # Rows merged at a time: a decode tile's real rows (its GQA group), 4..16 (fewer compile badly).
        merge_rows = min(16, max(4, triton.next_power_of_2(meta.max_query_len * group)))
    else:  # unused by the kernel when SPLIT is off
        part_o, part_lse, arrivals, merge_rows = out, out, out, 16
    _attn_kernel[(meta.num_seqs, n_kv, plan.m_blocks * splits)](
        q, k_cache, v_cache, out, part_o, part_lse, arrivals,
        meta.block_tables, meta.seq_lens, meta.query_start_loc,
        scale * _LOG2E, splits, t, meta.block_tables.stride(0), window,
        GROUP=group, N_KV=n_kv, PAGE=k_cache.shape[1], HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, CAUSAL=bool(meta.causal), SPLIT=splits > 1,
        MIN_SPLIT=plan.min_split, PREFETCH_KEYS=MIN_SPLIT_KEYS, MERGE_ROWS=merge_rows, PRECISION=precision,
        KEY_LINES=triton.next_power_of_2(triton.cdiv(head_dim * k_cache.element_size(), PREFETCH_LINE_BYTES)),
        LINE=PREFETCH_LINE_BYTES // k_cache.element_size(), num_warps=plan.num_warps, num_stages=plan.num_stages,
        **pdl_args(pdl),
    )
    return out


def compile_eager_variants(k_cache: torch.Tensor, v_cache: torch.Tensor, n_heads: int, max_seq_len: int) -> None:
    """Launch paged attention once at every tile variant an eager step over this cache can take (causal), so that
    none compiles while serving. An eager launch (a batch whose sequences feed different query lengths, a chat's next
    turn, a decode past the largest graph) differs from a captured one (no PDL) and splits its keys by the batch's
    real context, so a warm-up of short prompts never meets the split variants; the first eager step over a long
    context then compiled one for 0.8-2.5 s on an H200. Queries of every tile height up to 64 rows, over a context
    of one tile and one long enough to split (as far as max_seq_len allows); the keys read are block 0's, whatever
    they hold."""
    page, n_kv, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    group, device = n_heads // n_kv, k_cache.device
    q_len = 1
    while q_len * group <= 64:
        min_split = MIN_SPLIT_KEYS if q_len * group <= 16 else VERIFY_MIN_SPLIT_KEYS
        for ctx in sorted({q_len, min(max_seq_len, 2 * min_split + q_len)}):
            if ctx < q_len:
                continue
            meta = AttentionMetadata(
                slot_mapping=torch.full((q_len,), -1, dtype=torch.int64, device=device),
                query_start_loc=torch.tensor([0, q_len], dtype=torch.int32, device=device),
                seq_lens=torch.tensor([ctx], dtype=torch.int32, device=device),
                block_tables=torch.zeros((1, triton.cdiv(ctx, page)), dtype=torch.int32, device=device),
                max_query_len=q_len, max_seq_len=ctx)
            paged_attention(torch.zeros((q_len, n_heads, head_dim), dtype=k_cache.dtype, device=device),
                            k_cache, v_cache, meta, 1.0)
        q_len *= 2
