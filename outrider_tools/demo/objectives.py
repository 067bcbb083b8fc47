"""What the demo drafters learn: DFlash's blocks (layout, mask, anchors, slot weights, loss), EAGLE-3's chain
outputs, loss and draft vocabulary, and the per-step weights of chained heads. Each drafter is trained against a
frozen target called as target(ids, taps=...) -> (post-norm hidden, [tapped layer outputs]), with embed(ids) and
logits(hidden) (outrider_tools.dense.DenseLM, or the SmolLM2 trainer's paged one)."""

from __future__ import annotations

import torch

from outrider_tools.demo.tokenizer import MASK_ID
from outrider_tools.demo.training import soft_ce

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
    drafter: a models.DFlash (or anything called as it is); target: the frozen target (see the module docstring)."""
    with torch.no_grad():
        th, tapped = target(x, taps=taps)
    block_ids, pos, mask = dflash_block(x, anchors, block_size, mask_id)
    with torch.no_grad():
        bemb = target.embed(block_ids)
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
    keep = head.covers(best).float()
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

