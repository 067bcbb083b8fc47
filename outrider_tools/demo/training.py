"""The demo trainers' machinery: the run's device and seeds, the training loop and its schedule, the soft
cross-entropy, the run's log, and (batched, left-padded) greedy or sampled generation with a dense cache."""

from __future__ import annotations

import logging
import random
import sys
import time
from pathlib import Path

import torch

from outrider_tools.dense import DenseLM
from outrider_tools.demo.tokenizer import EOS_IDS, EOT_ID

LOG = logging.getLogger("train_demo")


def log(msg: str) -> None:
    LOG.info(msg)


def log_to(path: Path, append: bool = False) -> None:
    """Log lines go to stdout and to `path` (the run's train_log.txt, appended to with `append`), each stamped with
    the time."""
    stamp = logging.Formatter("[%(asctime)s] %(message)s", "%H:%M:%S")
    LOG.handlers.clear()
    LOG.setLevel(logging.INFO)
    LOG.propagate = False
    file = logging.FileHandler(path, mode="a" if append else "w", encoding="utf-8")
    for handler in (logging.StreamHandler(sys.stdout), file):
        handler.setFormatter(stamp)
        LOG.addHandler(handler)


class Ctx:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.cuda else torch.autocast("cpu", enabled=False)


def start_run(device_name: str, seed: int, smoke: bool) -> Ctx:
    """The run's device (auto: CUDA when there is one), torch and random seeded, TF32 matmuls on CUDA, and one CPU
    thread for smoke sizes (tiny tensors: threads only add overhead)."""
    auto = device_name == "auto"
    ctx = Ctx(torch.device("cuda" if auto and torch.cuda.is_available() else ("cpu" if auto else device_name)))
    torch.manual_seed(seed)
    random.seed(seed)
    if ctx.cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if smoke:
        torch.set_num_threads(1)
    return ctx


def lr_at(step: int, progress: float, lr: float, warmup: int) -> float:
    """Linear warmup over `warmup` steps, then linear decay to zero at progress 1. Decaying to zero beats cosine
    to 10 % of the peak, and more so the more tokens per parameter (Bergsma et al. 2025, "Straight to Zero"):
    the demo target trains on about 15 tokens per parameter."""
    return lr * min((step + 1) / warmup, max(0.0, 1.0 - progress))


def train_loop(name, module, params, steps, lr, warmup, loss_fn, eval_fn, eval_every, ctx, max_seconds):
    """AdamW (0.9, 0.95), wd 0.1 on matrices, clip 1.0, lr_at's schedule over the larger of step progress and
    time progress against max_seconds; evaluates every eval_every steps and at the end, and keeps the weights of
    the best evaluation."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), fused=ctx.cuda)
    best, best_state, best_step, history = float("inf"), None, -1, []
    t0 = time.time()
    step, loss = 0, None

    def evaluate():
        nonlocal best, best_state, best_step
        module.eval()
        with torch.no_grad(), ctx.autocast():
            metrics = eval_fn()
        history.append({"step": step, "train_loss": round(loss.item(), 4), **metrics})
        log(f"{name} step {step}/{steps} train {loss.item():.4f} " +
            " ".join(f"{k} {v:.4f}" for k, v in metrics.items()) + f" ({time.time() - t0:.0f}s)")
        if metrics["val"] < best:
            best, best_step = metrics["val"], step
            best_state = {k: v.detach().clone() for k, v in module.state_dict().items()}

    while True:
        progress = max(step / steps, (time.time() - t0) / max_seconds)
        if progress >= 1.0 and step > 0:
            break
        rate = lr_at(step, progress, lr, warmup)
        for g in opt.param_groups:
            g["lr"] = rate
        module.train()
        with ctx.autocast():
            loss = loss_fn(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % eval_every == 0:
            evaluate()
    if step % eval_every:
        evaluate()
    stopped_by_time = step < steps
    if stopped_by_time:
        log(f"{name}: the {max_seconds}s cap ended the schedule at step {step} of {steps}")
    module.load_state_dict(best_state)
    module.eval()
    return {"steps_run": step, "best_step": best_step, "best_val": round(best, 4), "history": history,
            "seconds": round(time.time() - t0, 1), "stopped_by_time": stopped_by_time}


def soft_ce(student_logits, teacher_logits):
    """Cross-entropy against the teacher's softmax (= KL up to the teacher's entropy), per position."""
    return -(teacher_logits.float().softmax(-1) * student_logits.float().log_softmax(-1)).sum(-1)


@torch.no_grad()
def generate(model: DenseLM, prompts: torch.Tensor, n_new: int, ctx: Ctx, temperature=None, gen=None, pad=None):
    """prompts [B, P] -> generated ids [B, n_new]. temperature: None = greedy, or a per-row tensor [B] (0 = greedy).
    pad [B]: row b is left-padded with pad[b] filler tokens that no real token attends to and that do not count
    as positions (None: no padding)."""
    model.model.eval()
    B, P = prompts.shape
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    cache = model.new_cache(B, P + n_new, dtype, prompts.device)
    keys = torch.arange(P + n_new, device=prompts.device)

    def forward(ids, start):
        if pad is None:
            return model(ids, cache=cache, start=start)
        q = keys[start:start + ids.shape[1]]
        k = keys[:start + ids.shape[1]]
        real = (k[None] >= pad[:, None])[:, None, :]  # [B, 1, S]
        # a filler row attends to itself only, so that it stays finite; real rows never see fillers
        mask = (real & (k[None, :] <= q[:, None])[None]) | (k[None, :] == q[:, None])[None]
        return model(ids, cache=cache, start=start, positions=q[None] - pad[:, None], mask=mask[:, None])

    out = []
    with ctx.autocast():
        h, _ = forward(prompts, 0)
        for t in range(n_new):
            logits = model.logits(h[:, -1])
            nxt = logits.argmax(-1)
            if temperature is not None:
                probs = (logits / temperature.clamp(min=1e-4)[:, None]).softmax(-1)
                sampled = torch.multinomial(probs, 1, generator=gen).squeeze(1)
                nxt = torch.where(temperature > 0, sampled, nxt)
            out.append(nxt)
            if t + 1 < n_new:
                h, _ = forward(nxt[:, None], P + t)
    return torch.stack(out, dim=1)


def greedy_continuations(model: DenseLM, prompts: list[list[int]], n_new: int, ctx: Ctx, device) -> list[list[int]]:
    """Greedy continuations of prompts of any lengths in one left-padded batch, each cut after its first EOS (as
    the engine stops)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[EOT_ID] * (width - len(p)) + p for p in prompts], device=device)
    pad = torch.tensor([width - len(p) for p in prompts], device=device)
    outs = []
    for row in generate(model, ids, n_new, ctx, pad=pad).tolist():
        stop = next((j for j, t in enumerate(row) if t in EOS_IDS), len(row) - 1)
        outs.append(row[:stop + 1])
    return outs

