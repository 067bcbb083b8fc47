"""Train outrider's bundled demo model family on Python source, reproducibly.

What it builds, all sharing one byte-level BPE tokenizer:
  target/  a Qwen3ForCausalLM checkpoint (HF layout) with a Qwen3.5-style MTP layer stored in it (`mtp.*`)
  draft/   a smaller Qwen3ForCausalLM draft model (distilled from the target)
  dflash/  a DFlashDraftModel drafter (block diffusion on the target's frozen hidden states)
  eagle3/  an EAGLE-3 head (EAGLE reference layout, LlamaForCausalLMEagle3) over three target taps, with a reduced
           draft vocabulary
plus metrics.json (losses, offline acceptance proxies, T = 0 samples, timings, corpus fingerprints),
eval_prompts.json and train_log.txt.

Data: every `.py` file of the running interpreter's standard library (site-packages excluded). A fixed 5 % of the
files, chosen by a hash of their relative path, is held out for evaluation and never trained on; the tokenizer
learns from the rest. The training text adds, up to a cap, the `.py` files of the interpreter's installed packages
(its site-packages / dist-packages directories, or --site-packages), less duplicates and copies of the stdlib.

Usage (the shipped artifacts; one H200, about 7.5 minutes with the EAGLE-3 stage (6.5 without it, as published);
each training stage has a time cap, so the whole run stays under about 9 minutes even on a slower device):
    python3 scripts/train_demo.py --out outrider/demo --seed 0
On a device run that returns files from $OUT (at most 8 files of 16 MiB): train into a scratch directory and
--pack the family as two tar files plus metrics.json and train_log.txt, to unpack into outrider/demo (packed
again after every stage, so a run stopped from outside still returns the stages it finished):
    python3 scripts/train_demo.py --out /tmp/demo --seed 0 --pack $OUT
CPU smoke run of the whole pipeline with tiny sizes (< 1 minute):
    python scripts/train_demo.py --smoke --out /tmp/demo-smoke
Drafter stages alone against an existing family (its target and tokenizer as they are; the corpus and the target's
generations rebuilt as a full run builds them): --out gets the stages' directories plus the family's metrics.json
and train_log.txt with the stages added, drop-in replacements. The EAGLE-3 head for the shipped family (one H200,
about 2.5 minutes; scripts/gpu_run.sh train-eagle3), then `tar -xf $OUT/demo-eagle3.tar -C outrider/demo` and copy
metrics.json and train_log.txt there:
    python3 scripts/train_demo.py --stages eagle3 --family outrider/demo --out /tmp/demo-eagle3 --seed 0 --pack $OUT
--set FIELD=VALUE overrides a profile field for a trial (e.g. --set "eagle3_train=(5, 64, 2e-3, 2)").

Formats follow shared/reference/speculative-decoding.md: MTP = `mtp.fc [H, 2H]` over
concat[pre_fc_norm_embedding(emb(t_{i+1})), pre_fc_norm_hidden(h_i)] with h_i the target's post-final-norm hidden
state, one decoder layer `mtp.layers.0`, `mtp.norm`; recursion feeds the post-`mtp.norm` output back. DFlash =
`fc [H, n_taps*H]` over the outputs of target blocks `target_layer_ids`, `hidden_norm`, non-causal Qwen3 layers
whose context K/V are `k_norm(k_proj(ctx))`/`v_proj(ctx)`, final `norm`, the target's embedding and lm_head.
EAGLE-3 = outrider/speculative/eagle3.py's: `fc [H, 3H]` over target block outputs (the config's
`eagle_aux_hidden_state_layer_ids` are those blocks + 1), `midlayer` one Llama layer whose q/k/v read
[input_layernorm(emb(t_{i+1})) ; hidden_norm(h)] over a residual stream from h (h = fc(taps_i), then the chain's
own pre-norm output), `norm`, `lm_head [draft_vocab, H]`, `d2t`, `t2d`, the target's embedding.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import sysconfig
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from outrider.demo import DEMO_DIR
from outrider_tools.dense import mtp_unroll
from outrider_tools.demo.corpus import build_corpus, fixed_windows, sample_windows, site_dirs
from outrider_tools.demo.models import (load_lm, n_params, new_dflash, new_eagle3, new_lm, new_mtp, write_dflash,
                                        write_eagle3, write_lm)
from outrider_tools.demo.objectives import (dflash_block, dflash_loss, dflash_outputs, dflash_scores, dflash_weights,
                                            draft_vocabulary, eagle3_outputs, eagle3_scores, random_anchors,
                                            step_weights)
from outrider_tools.demo.profiles import FULL, SMOKE, STAGE_DIRS, STAGES, parse_stages, with_overrides
from outrider_tools.demo.proxy import REPEAT_NGRAM, make_eval_prompts, repeated_tokens, summarize, walk
from outrider_tools.demo.tokenizer import MASK_ID, load_tokenizer
from outrider_tools.pack import pack
from outrider_tools.demo.training import (generate, greedy_continuations, log, log_to, soft_ce, start_run,
                                          train_loop)

# T = 0 completions recorded in metrics.json ("samples"): the README's prompt, more `def` and `class` lines, and a
# chat turn in the chat template's format
SAMPLE_PROMPTS = (
    "def fibonacci(n):",
    "def is_prime(n):",
    "class Stack:",
    "<|im_start|>user\nWrite a Python function `reverse_words(text)`: Return the words of text in reverse order."
    "<|im_end|>\n<|im_start|>assistant\n",
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEMO_DIR)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, a few steps, CPU-friendly (< 1 minute)")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    ap.add_argument("--stdlib", type=Path, default=None, help="override the corpus root (default: this interpreter's)")
    ap.add_argument("--site-packages", type=Path, action="append", default=None, metavar="DIR",
                    help="a package directory for the training-only part of the corpus (repeatable; default: this "
                         "interpreter's site-packages / dist-packages directories)")
    ap.add_argument("--reuse-target", type=Path, default=None,
                    help="load the target from a previous run's target/ directory instead of training it")
    ap.add_argument("--stages", type=parse_stages, default=list(STAGES), metavar="S[,S...]",
                    help=f"the stages to run, of {','.join(STAGES)} (default: all). Without target, --family "
                         "gives the target and tokenizer, and --out gets only the stages' directories")
    ap.add_argument("--family", type=Path, default=None,
                    help="an existing family directory (e.g. outrider/demo) to train drafter --stages against: its "
                         "target and tokenizer are used as they are, the corpus and the target's generations are "
                         "rebuilt as a full run builds them, and metrics.json and train_log.txt are the family's "
                         "with this run's stages added (drop-in replacements)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a profile field for a trial run (repeatable; VALUE a Python literal), e.g. "
                         "eagle3_train='(5, 64, 2e-3, 2)' or stage_seconds=\"{'eagle3': 30}\"")
    ap.add_argument("--pack", type=Path, default=None,
                    help="also write the family into this directory as tar files of at most 16 MiB each (what a "
                         "device run may return), plus copies of metrics.json and train_log.txt")
    args = ap.parse_args(argv)
    stages, family = args.stages, args.family
    if ("target" in stages) == (family is not None):
        ap.error("--family goes with --stages that leave out target (and those need it)")

    t_start = time.time()
    p = with_overrides(SMOKE if args.smoke else FULL, args.set)
    ctx = start_run(args.device, args.seed, args.smoke)
    device = ctx.device
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if family:  # the family's log goes on with this run's lines
        (out / "train_log.txt").write_text((family / "train_log.txt").read_text())
    log_to(out / "train_log.txt", append=family is not None)
    run: dict = {"seed": args.seed, "profile": "smoke" if args.smoke else "full", "device": str(device),
                 "torch": torch.__version__, "python": platform.python_version(),
                 "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:]))}
    if args.set:
        run["profile_overrides"] = args.set
    if ctx.cuda:
        run["gpu"] = torch.cuda.get_device_name(0)
    # A full run's metrics start with the run; a run against a family adds its stages (each with the run) to the
    # family's metrics.
    metrics: dict = json.loads((family / "metrics.json").read_text()) if family else dict(run)
    timed = run if family else metrics  # where "seconds" goes
    if family:
        run["family"] = str(family)
        log(f"--- stages {','.join(stages)} against the family in {family}: {run['command']}")
    stage_t = {}
    pack_parts = {f"demo-{d}.tar": (d,) for d in dict.fromkeys(STAGE_DIRS[s] for s in stages)} if family else \
        PACK_PARTS

    def save_metrics():
        """Writes metrics.json and, with --pack, packs what exists so far: a run stopped from outside (a device
        call's time limit) still returns every stage it finished."""
        timed["seconds"] = {**stage_t, "total": round(time.time() - t_start, 1)}
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        if args.pack:
            return pack(out, args.pack, pack_parts)
        return []

    def drafter_done(name: str, t0: float, res: dict, fields: dict) -> None:
        """A drafter stage's end: its metrics (the stage's fields, the training loop's results with the history
        last, and with --family this run's record), its time, and metrics.json saved (and packed)."""
        metrics[name] = {**fields, **{k: v for k, v in res.items() if k != "history"}, "history": res["history"],
                         **({"run": run} if family else {})}
        stage_t[name] = round(time.time() - t0, 1)
        save_metrics()

    # ---- data + tokenizer (a family's own tokenizer: ids must be its target's)
    t0 = time.time()
    root = args.stdlib or Path(sysconfig.get_paths()["stdlib"])
    family_tok = load_tokenizer(family / "target") if family else None
    corpus = build_corpus(root, args.site_packages or site_dirs(), p, args.seed, tok=family_tok)
    tok, train_stream, val_stream, held_files = corpus.tok, corpus.train_stream, corpus.val_stream, corpus.held_files
    vocab = tok.get_vocab_size()
    summary = corpus.summary()
    if family:
        was = metrics.get("corpus", {})
        run["corpus_matches_family"] = same = (summary["sha256"] == was.get("sha256") and
                                               summary["packages"]["sha256"] == was.get("packages", {}).get("sha256"))
        if not same:
            log(f"warning: this corpus (stdlib {summary['sha256'][:8]}, packages "
                f"{summary['packages']['sha256'][:8]}) is not the family's (stdlib {was.get('sha256', '?')[:8]}, "
                f"packages {was.get('packages', {}).get('sha256', '?')[:8]}): another interpreter or packages")
    else:
        metrics["corpus"] = summary
        metrics["vocab_size"] = vocab
    stage_t["data"] = round(time.time() - t0, 1)
    log(f"corpus {summary} vocab {vocab} ({stage_t['data']}s)")

    train_stream_d = train_stream.to(device)
    val = fixed_windows(val_stream, p.val_windows, p.seq + 1).to(device)
    val_small = val[: max(8, min(64, len(val)))]

    def lm_eval(model, windows):
        tot, correct, n = 0.0, 0, 0
        for i in range(0, len(windows), 32):
            x = windows[i:i + 32]
            h, _ = model(x[:, :-1])
            lg = model.logits(h)
            tot += F.cross_entropy(lg.view(-1, vocab), x[:, 1:].reshape(-1), reduction="sum").item()
            correct += (lg.argmax(-1) == x[:, 1:]).sum().item()
            n += x[:, 1:].numel()
        return {"val": tot / n, "top1": correct / n}

    # ---- target
    if family:
        target = load_lm(family / "target", device)
        log(f"target from {family / 'target'} ({n_params(target.model)} parameters)")
    else:
        t0 = time.time()
        # unigram baseline on the same held-out targets
        counts = torch.bincount(train_stream.long(), minlength=vocab).double() + 1.0
        logp = (counts / counts.sum()).log()
        unigram = -logp[val[:, 1:].reshape(-1).cpu()].mean().item()
        torch.manual_seed(args.seed + 1)
        target = new_lm(p.target, vocab)
        target.model.to(device)
        steps, batch, lr, warmup = p.target_train
        g = torch.Generator().manual_seed(args.seed + 11)

        def target_loss(step):
            x = sample_windows(train_stream_d, batch, p.seq + 1, g)
            h, _ = target(x[:, :-1])
            return F.cross_entropy(target.logits(h).view(-1, vocab), x[:, 1:].reshape(-1))

        if args.reuse_target:
            target = load_lm(args.reuse_target, device)
            res = {"reused": str(args.reuse_target), "history": []}
        else:
            res = train_loop("target", target.model, list(target.model.parameters()), steps, lr, warmup,
                             target_loss, lambda: lm_eval(target, val_small), p.eval_every, ctx,
                             p.stage_seconds["target"])
        target.model.requires_grad_(False)
        with torch.no_grad(), ctx.autocast():
            final = lm_eval(target, val)
        bits_per_byte = final["val"] / math.log(2) / metrics["corpus"]["held_out_bytes_per_token"]
        metrics["target"] = {"params": n_params(target.model), "shape": asdict(p.target), "steps_planned": steps,
                             "batch": batch, "seq": p.seq, "lr": lr, "schedule": "linear warmup, linear decay to 0",
                             **{k: v for k, v in res.items() if k != "history"},
                             "held_out_loss": round(final["val"], 4), "held_out_top1": round(final["top1"], 4),
                             "held_out_bits_per_byte": round(bits_per_byte, 4),
                             "held_out_tokens_scored": int(val[:, 1:].numel()),
                             "unigram_loss": round(unigram, 4), "history": res["history"]}
        stage_t["target"] = round(time.time() - t0, 1)
        log(f"target held-out loss {final['val']:.4f} (top-1 {final['top1']:.3f}, {bits_per_byte:.3f} bits/byte) "
            f"vs unigram {unigram:.4f}")
        write_lm(out / "target", target, tok)  # rewritten with the MTP tensors below
        texts = greedy_continuations(target, [tok.encode(s).ids for s in SAMPLE_PROMPTS], p.eval_new, ctx, device)
        metrics["samples"] = [{"prompt": s, "completion": tok.decode(t, skip_special_tokens=False)}
                              for s, t in zip(SAMPLE_PROMPTS, texts)]
        for sample in metrics["samples"]:
            log(f"T = 0 sample:\n{sample['prompt']}{sample['completion']}")
        save_metrics()
    drafters = [s for s in stages if s != "target"]

    # ---- target-generated data (greedy, plus 25 % sampled at T = 0.8) for all drafters
    t0 = time.time()
    gg = torch.Generator().manual_seed(args.seed + 21)
    g_sample = torch.Generator(device=device).manual_seed(args.seed + 22)
    gen_seqs = []
    for i in range(0, p.gen_prompts if drafters else 0, p.gen_batch):
        b = min(p.gen_batch, p.gen_prompts - i)
        prompts = sample_windows(train_stream_d, b, p.gen_prompt_len, gg)
        temp = torch.where(torch.rand(b, generator=gg) < 0.25, 0.8, 0.0).to(device)
        new = generate(target, prompts, p.gen_new, ctx, temperature=temp, gen=g_sample)
        gen_seqs.append(torch.cat([prompts, new], 1).cpu())
    gen_seqs = torch.cat(gen_seqs) if gen_seqs else torch.zeros(0, p.gen_prompt_len + p.gen_new, dtype=torch.long)
    gen_stream = torch.cat([torch.zeros(len(gen_seqs), 1, dtype=torch.long), gen_seqs], 1).reshape(-1)
    gen_stream = gen_stream.to(torch.int32).to(device)  # each sequence preceded by <|endoftext|>
    # held-out generations for drafter validation: greedy continuations of held-out prefixes
    vprompts = fixed_windows(val_stream, max(8, p.val_windows // 4), p.gen_prompt_len).to(device)
    vgen_windows = torch.cat([vprompts, generate(target, vprompts, p.gen_new, ctx)], 1)  # [n, P + new]
    generated = {"sequences": len(gen_seqs), "tokens": int(gen_seqs.numel()), "prompt_len": p.gen_prompt_len,
                 "new_tokens": p.gen_new, "sampled_fraction": 0.25, "temperature": 0.8}
    if family:
        run["generated"] = generated
    else:
        metrics["generated"] = generated
    stage_t["generate"] = round(time.time() - t0, 1)
    log(f"generated {gen_seqs.numel()} tokens ({stage_t['generate']}s)")

    def drafter_batch(batch_size, gen):
        half = batch_size // 2
        return torch.cat([sample_windows(train_stream_d, half, p.seq, gen),
                          sample_windows(gen_stream, batch_size - half, p.seq, gen)])

    def target_view(x):
        with torch.no_grad():
            h, tapped = target(x)
        return h, tapped

    def chained_stage(step_losses, weights, batch_size, gen):
        """train_loop's loss and eval functions for a chain head: step_losses(ids) -> ([loss per step], [draft
        agreement with the target's argmax per step]), the loss weighted over the steps."""

        def loss_fn(step):
            losses, _ = step_losses(drafter_batch(batch_size, gen))
            return sum(w * l for w, l in zip(weights, losses))

        def eval_fn():
            losses, accs = step_losses(vgen_windows)
            return {"val": sum(w * l.item() for w, l in zip(weights, losses)),
                    **{f"agree{k + 1}": a.item() for k, a in enumerate(accs)}}

        return loss_fn, eval_fn

    # ---- draft model: forward KL to the target + 0.2 CE
    if "draft" in stages:
        t0 = time.time()
        torch.manual_seed(args.seed + 2)
        draft = new_lm(p.draft, vocab)
        draft.model.to(device)
        steps, batch, lr, warmup = p.draft_train
        gd = torch.Generator().manual_seed(args.seed + 12)

        def draft_loss(step):
            x = drafter_batch(batch, gd)
            th, _ = target_view(x)
            dh, _ = draft(x[:, :-1])
            dl = draft.logits(dh)
            kd = soft_ce(dl, target.logits(th[:, :-1])).mean()
            ce = F.cross_entropy(dl.reshape(-1, vocab), x[:, 1:].reshape(-1))
            return kd + 0.2 * ce

        def draft_eval():
            x = vgen_windows
            th, _ = target(x)
            tl = target.logits(th[:, :-1])
            dh, _ = draft(x[:, :-1])
            dl = draft.logits(dh)
            lm = lm_eval(draft, val_small)
            return {"val": soft_ce(dl, tl).mean().item(),
                    "agree": (dl.argmax(-1) == tl.argmax(-1)).float().mean().item(),
                    "code_loss": lm["val"]}

        res = train_loop("draft", draft.model, list(draft.model.parameters()), steps, lr, warmup, draft_loss,
                         draft_eval, p.eval_every, ctx, p.stage_seconds["draft"])
        draft.model.requires_grad_(False)
        with torch.no_grad(), ctx.autocast():
            dfinal = lm_eval(draft, val)
        # The draft's tokenizer copy only serves the engine's vocabulary check (outrider/speculative/compat.py):
        # compact JSON, 156 KB less of the demo's 20 MB.
        write_lm(out / "draft", draft, tok, pretty_tokenizer=False)
        drafter_done("draft", t0, res, {"params": n_params(draft.model), "shape": asdict(p.draft), "batch": batch,
                                        "lr": lr, "loss": "forward KL to target + 0.2 CE",
                                        "held_out_loss": round(dfinal["val"], 4)})

    # ---- MTP: recursive K steps, weights beta^(k-1) normalised, soft CE to the target's next-token distribution
    K = p.mtp_steps
    if "mtp" in stages:
        t0 = time.time()
        torch.manual_seed(args.seed + 3)
        mtp = new_mtp(target.config).to(device)
        wk = step_weights(p.mtp_beta, K)
        steps, batch, lr, warmup = p.mtp_train
        gm = torch.Generator().manual_seed(args.seed + 13)

        def mtp_step_losses(x):
            th, _ = target_view(x)
            outs = mtp_unroll(mtp, target, th, x, K)
            N = x.shape[1] - 1 - K
            losses, accs = [], []
            for k, y in enumerate(outs, start=1):
                ml = target.logits(y)
                tl = target.logits(th[:, k:k + N])  # target at index i+k predicts t_{i+k+1}
                losses.append(soft_ce(ml, tl).mean())
                accs.append((ml.argmax(-1) == tl.argmax(-1)).float().mean())
            return losses, accs

        mtp_loss, mtp_eval = chained_stage(mtp_step_losses, wk, batch, gm)
        res = train_loop("mtp", mtp, list(mtp.parameters()), steps, lr, warmup, mtp_loss, mtp_eval,
                         p.eval_every, ctx, p.stage_seconds["mtp"])
        mtp.requires_grad_(False)
        write_lm(out / "target", target, tok, mtp=mtp)
        drafter_done("mtp", t0, res, {
            "params": n_params(mtp), "layout": "qwen3_5 (mtp.fc / pre_fc_norm_* / layers.0 / norm)",
            "hidden_input": "target post-final-norm hidden; recursion feeds post-mtp.norm output",
            "train_steps_K": K, "step_weights": [round(w, 3) for w in wk], "batch": batch, "lr": lr})

    # ---- DFlash: block diffusion on the frozen target's tapped hidden states
    Bk = p.block_size
    if "dflash" in stages:
        t0 = time.time()
        torch.manual_seed(args.seed + 4)
        dflash = new_dflash(p.dflash, vocab, target.config.hidden_size, block_size=Bk,
                            target_layers=target.config.num_hidden_layers, taps=p.dflash_taps, mask_id=MASK_ID)
        dflash.model.to(device)
        dw = dflash_weights(Bk, p.dflash_gamma, device)
        steps, batch, lr, warmup = p.dflash_train
        gf = torch.Generator().manual_seed(args.seed + 14)

        def train_step_loss(step):
            x = drafter_batch(batch, gf)
            anchors = random_anchors(batch, p.seq, p.dflash_anchors, Bk, gf, device)
            return dflash_loss(*dflash_outputs(dflash, target, x, anchors, Bk, p.dflash_taps), dw)

        def dflash_eval():
            x = vgen_windows
            ge = torch.Generator().manual_seed(1234)
            anchors = random_anchors(len(x), x.shape[1], min(p.dflash_anchors, (x.shape[1] - Bk) // 2), Bk, ge,
                                     device)
            return dflash_scores(*dflash_outputs(dflash, target, x, anchors, Bk, p.dflash_taps), dw)

        res = train_loop("dflash", dflash.model, list(dflash.model.parameters()), steps, lr, warmup,
                         train_step_loss, dflash_eval, p.eval_every, ctx, p.stage_seconds["dflash"])
        dflash.model.requires_grad_(False)
        write_dflash(out / "dflash", dflash)
        drafter_done("dflash", t0, res, {
            "params": n_params(dflash.model), "shape": asdict(p.dflash), "block_size": Bk,
            "target_layer_ids": list(p.dflash_taps), "mask_token_id": MASK_ID, "gamma": p.dflash_gamma,
            "anchors_per_seq": p.dflash_anchors, "batch": batch, "lr": lr})

    # ---- EAGLE-3: fc over three target taps, one layer chained on its own output (training-time test), a reduced
    # vocabulary; soft CE to the target's distribution on that vocabulary, weights beta^(k-1) normalised
    K3 = p.eagle3_steps
    if "eagle3" in stages:
        t0 = time.time()
        torch.manual_seed(args.seed + 5)
        ids3 = draft_vocabulary([train_stream, gen_stream], vocab, p.eagle3_vocab)
        eagle3 = new_eagle3(p.eagle3, vocab, target.config.hidden_size, p.eagle3_taps, ids3)
        eagle3.model.to(device)
        w3 = step_weights(p.eagle3_beta, K3)
        steps, batch, lr, warmup = p.eagle3_train
        g3 = torch.Generator().manual_seed(args.seed + 15)

        def eagle3_step_losses(x):
            scores = [eagle3_scores(eagle3, *o) for o in eagle3_outputs(eagle3, target, x, p.eagle3_taps, K3)]
            return [s for s, _ in scores], [a for _, a in scores]

        eagle3_loss, eagle3_eval = chained_stage(eagle3_step_losses, w3, batch, g3)
        res = train_loop("eagle3", eagle3.model, list(eagle3.model.parameters()), steps, lr, warmup, eagle3_loss,
                         eagle3_eval, p.eval_every, ctx, p.stage_seconds["eagle3"])
        eagle3.model.requires_grad_(False)
        covered = {name: round(eagle3.covers(stream.long()).float().mean().item(), 4)
                   for name, stream in (("corpus", train_stream_d), ("generated", gen_stream))}
        write_eagle3(out / "eagle3", eagle3)
        log(f"eagle3 draft vocabulary of {p.eagle3_vocab} covers {covered}")
        drafter_done("eagle3", t0, res, {
            "params": n_params(eagle3.model), "shape": asdict(p.eagle3),
            "layout": "EAGLE reference (LlamaForCausalLMEagle3: fc / midlayer / norm / lm_head / d2t / t2d; the "
                      "target's embedding)",
            "target_layer_ids": list(p.eagle3_taps),
            "eagle_aux_hidden_state_layer_ids": [t + 1 for t in p.eagle3_taps],
            "draft_vocab_size": p.eagle3_vocab, "draft_vocab_covers": covered,
            "hidden_input": "fc(taps) at the first step; the chain feeds the pre-norm output back",
            "train_steps_K": K3, "step_weights": [round(w, 3) for w in w3], "batch": batch, "lr": lr})

    # ---- offline acceptance proxy on held-out prompts (greedy; exact under teacher forcing)
    t0 = time.time()
    if family:  # the published prompts
        prompts = json.loads((family / "eval_prompts.json").read_text())
    else:
        prompts = make_eval_prompts(held_files, p.eval_prompts, args.seed)
        (out / "eval_prompts.json").write_text(json.dumps(prompts, indent=1) + "\n")
    names = {"draft": [f"draft_k{k}" for k in (3, 4, 5)], "mtp": [f"mtp_k{k}" for k in range(1, K + 1)],
             "dflash": ["dflash"], "eagle3": [f"eagle3_k{k}" for k in range(1, K3 + 1)]}
    taus = {n: [] for s in drafters for n in names[s]}
    per_kind = {kind: {n: [] for n in taus} for kind in ("def", "window")}
    prompt_ids = [tok.encode(pr["prompt"]).ids for pr in prompts]
    continuations = greedy_continuations(target, prompt_ids, p.eval_new, ctx, device)
    repeated = sum(repeated_tokens(ids + gen, len(ids)) for ids, gen in zip(prompt_ids, continuations))
    taps_needed = tuple(sorted(set(p.dflash_taps) | set(p.eagle3_taps)))
    with torch.no_grad(), ctx.autocast():
        for pr, ids, gen_ids in zip(prompts, prompt_ids, continuations):
            toks = ids + gen_ids
            seq = torch.tensor([toks], device=device)
            P, L = len(ids), len(toks)
            end = L - 1  # last index
            if L - P < 4:
                continue
            kind = per_kind[pr["kind"]]

            def record(name, pred, k):
                # pred(n, j): the token drafter proposes for index n+j+1 when the last committed index is n
                m = [[n + j + 1 <= end and pred(n, j) == toks[n + j + 1] for j in range(k)] for n in range(L)]
                tk = walk(m, P, end, k)
                taus[name] += tk
                kind[name] += tk

            th, tapped = target(seq, taps=taps_needed)
            taps = dict(zip(taps_needed, tapped))  # concatenated in layer order, as in training and serving

            def chain_record(kind_name, preds, steps):
                # chain index i = n-1; step j+1 predicts index n+j+1
                for k in range(1, steps + 1):
                    record(f"{kind_name}_k{k}", lambda n, j: preds[j][n - 1] if n - 1 < len(preds[j]) else -1, k)

            if "draft" in stages:
                # teacher-forced argmax at index i predicts i+1 (exact: accepted drafts = target tokens)
                dh, _ = draft(seq)
                da = draft.logits(dh).argmax(-1)[0].tolist()
                for k in (3, 4, 5):
                    record(f"draft_k{k}", lambda n, j: da[n + j], k)
            if "mtp" in stages:
                chain_record("mtp", [target.logits(y).argmax(-1)[0].tolist()
                                     for y in mtp_unroll(mtp, target, th, seq, K)], K)
            if "eagle3" in stages:
                taps3 = torch.cat([taps[t] for t in sorted(p.eagle3_taps)], -1)
                chain_record("eagle3", [eagle3.drafts(y)[0].tolist() for y in eagle3.unroll(target, taps3, seq, K3)],
                             K3)
            if "dflash" in stages and L - Bk >= 1:
                # one block per anchor a in [1, L - Bk]; slot j+1 predicts index a+j+1
                anchors = torch.arange(1, L - Bk + 1, device=device)[None]
                block_ids, pos, mask = dflash_block(seq, anchors, Bk)
                hid = dflash(torch.cat([taps[t] for t in sorted(p.dflash_taps)], -1),
                             target.embed(block_ids), pos, mask)
                fa = target.logits(hid).argmax(-1)[0].view(-1, Bk).tolist()  # [anchor - 1][slot]
                record("dflash", lambda n, j: fa[n - 1][j + 1] if 1 <= n <= L - Bk else -1, Bk - 1)
    proxy = {
        "what": "offline greedy acceptance length tau (accepted drafts + 1) simulated with the trainer's own "
                "model code on the target's greedy continuations of held-out prompts (eval_prompts.json, "
                f"{p.eval_new} new tokens, stop at EOS); full-length steps only. Exact for greedy verification "
                "up to numerics; NOT the engine's measurement.",
        "all": {n: summarize(v) for n, v in taus.items()},
        **{kind: {n: summarize(v) for n, v in d.items()} for kind, d in per_kind.items()},
        "dflash_block_size": Bk,
        "greedy_repeated_share": round(repeated / max(1, sum(map(len, continuations))), 3),
        "greedy_repeated_share_what": f"share of the target's generated tokens that end a {REPEAT_NGRAM}-gram "
                                      "already present earlier in the prompt or continuation (greedy loops)",
    }
    if family:  # the family's numbers for the other drafters stay
        for part in ("all", "def", "window"):
            metrics.setdefault("acceptance_proxy", {}).setdefault(part, {}).update(proxy[part])
    else:
        metrics["acceptance_proxy"] = proxy
    stage_t["acceptance_proxy"] = round(time.time() - t0, 1)
    log("acceptance proxy: " + json.dumps(proxy["all"]))

    # the family's files as they will be: this run's directories, and the family's for the others
    sizes = {}
    for d in ("target", "draft", "dflash", "eagle3"):
        base = out if (out / d).is_dir() or not family else family
        sizes.update({f"{d}/{f.name}": f.stat().st_size for f in sorted((base / d).glob("*")) if f.is_file()})
    metrics["files"] = sizes
    metrics["total_bytes"] = sum(sizes.values())
    log(f"wrote {out} ({metrics['total_bytes'] / 1e6:.2f} MB of model files with the family's) in "
        f"{time.time() - t_start:.0f}s")
    for path in save_metrics():
        log(f"packed {path} ({path.stat().st_size / 1e6:.2f} MB)")
    return 0


# The family as the device returns it: tar files relative to outrider/demo, none over the 16 MiB a file may be.
PACK_PARTS = {"demo-target.tar": ("target",),
              "demo-drafters.tar": ("draft", "dflash", "eagle3", "metrics.json", "eval_prompts.json",
                                    "train_log.txt")}


if __name__ == "__main__":
    sys.exit(main())
