"""Mean acceptance length of the bundled demo drafters, measured through the real engine (outrider.LLM).

For every drafter setting, each held-out prompt of outrider/demo/eval_prompts.json is decoded greedily (T = 0,
stop at EOS or after --max-tokens new tokens), one request at a time unless --batch says otherwise, by an engine
with that drafter, and by an engine with no drafter. Reported per setting:

  tau         mean acceptance length = committed tokens per verify round
              = 1 + sum(draft_n_accepted) / sum(draft_rounds), the RequestTiming counters summed over the
              prompts (so every verify round weighs the same, as in the demo trainer's offline proxy);
  tau/prompt  the same ratio per prompt, then averaged over prompts;
  mean k      drafts verified per round, sum(draft_n) / sum(draft_rounds) (the k the engine really used);
  accept      sum(draft_n_accepted) / sum(draft_n);
  tok/step    (generated tokens - 1) / decode steps, plain decode steps included (the first token comes from
              the prefill);
  identical   prompts whose greedy output is token-for-token the no-drafter output;
  tau novel / tau repeat
              tau over the rounds whose text is not / is a verbatim repeat of earlier text (is_repeat: the 4
              tokens up to the anchor and the 4 after it occur earlier); the tiny target's greedy output loops,
              and loops are easy to draft;
  --vs-training-code
              also checks every round's drafts against the demo trainer's own model code (the offline proxy
              of metrics.json) at the same point: slots compared / equal.

Draft length. A setting "KIND:K" runs the engine with spec_draft_n_max = K. The DraftPolicy then takes the
smallest of K, the drafter's max_draft (DFlash: block_size - 1), the tokens left minus one and the batch cap
max_verify_tokens // n_decoding - 1 (255 at batch 1), and its online rule may pick a smaller k:
  --policy fixed   (default) the rule is neutralised by setting the drafter's step_cost to 0, so every round
                   drafts that cap: k = K except in the last rounds before --max-tokens;
  --policy online  the engine as served with --spec-draft-n-max K: the acceptance-aware rule chooses k <= K
                   per round (and may decode plainly with k = 0, probing every 16 rounds).
  Both: --policy fixed,online.

Usage. The model card's numbers (outrider/demo/acceptance.json; about 25 minutes on the CPU):
    .venv/bin/python scripts/measure_acceptance.py --settings draft:4 mtp:1 mtp:3 dflash:7 dflash:4 eagle3:1 \
        eagle3:4 --policy fixed,online --vs-training-code --check --json outrider/demo/acceptance.json
A quick look (the defaults draft:4 mtp:1 mtp:3 dflash:7 eagle3:4, fixed k; first 2 prompts of each kind, 64
tokens):
    .venv/bin/python scripts/measure_acceptance.py --limit 2 --max-tokens 64 --json /tmp/acceptance.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import dataclass, field

import torch

from outrider.demo import DRAFTER_KINDS as KINDS

DEFAULT_SETTINGS = ("draft:4", "mtp:1", "mtp:3", "dflash:7", "eagle3:4")
THRESHOLDS = {"draft": 2.0, "mtp": 1.6, "dflash": 2.5}  # issue 6, acceptance criterion 3 (none for EAGLE-3)


@dataclass
class PromptResult:
    index: int
    kind: str  # "def" | "window"
    prompt_tokens: int
    generated: int
    draft_rounds: int
    draft_n: int
    draft_n_accepted: int
    accepted_per_position: list[int]
    identical: bool
    rounds: list[tuple[int, int, bool]] = field(default_factory=list)  # (drafts, accepted, repeat) per round
    training_code: tuple[int, int] | None = None  # (draft slots compared, equal) vs the demo trainer's code

    @property
    def tau(self) -> float | None:
        return 1 + self.draft_n_accepted / self.draft_rounds if self.draft_rounds else None


@dataclass
class SettingResult:
    kind: str
    k: int
    policy: str
    prompts: list[PromptResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.k}"

    def summary(self, subset: str | None = None) -> dict:
        rs = [r for r in self.prompts if subset is None or r.kind == subset]
        rounds = sum(r.draft_rounds for r in rs)
        drafted = sum(r.draft_n for r in rs)
        accepted = sum(r.draft_n_accepted for r in rs)
        gen = sum(r.generated - 1 for r in rs)
        plain_steps = sum(max(r.generated - 1 - r.draft_n_accepted - r.draft_rounds, 0) for r in rs)
        per_prompt = [r.tau for r in rs if r.tau is not None]
        depth = max((len(r.accepted_per_position) for r in rs), default=0)
        per_pos = [sum(r.accepted_per_position[i] for r in rs if i < len(r.accepted_per_position))
                   for i in range(depth)]
        return {
            "prompts": len(rs),
            "tau": round(1 + accepted / rounds, 3) if rounds else None,
            "tau_per_prompt_mean": round(sum(per_prompt) / len(per_prompt), 3) if per_prompt else None,
            "tau_per_prompt_min": round(min(per_prompt), 3) if per_prompt else None,
            "mean_k": round(drafted / rounds, 3) if rounds else None,
            "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
            "tokens_per_step": round(gen / (rounds + plain_steps), 3) if rounds + plain_steps else None,
            "draft_rounds": rounds,
            "draft_n": drafted,
            "draft_n_accepted": accepted,
            "plain_decode_steps": plain_steps,
            "generated_tokens": sum(r.generated for r in rs),
            # [i]: the fraction of verify rounds whose draft i+1 was accepted (tau = 1 + the sum of these)
            "accepted_at_depth_per_round": [round(c / rounds, 3) for c in per_pos] if rounds else [],
            "identical": sum(r.identical for r in rs),
            **repeat_split([x for r in rs for x in r.rounds]),
            **training_code_summary(rs),
            # the propose hook saw every verify round the engine counted (no proposal was dropped)
            "rounds_consistent": all(len(r.rounds) == r.draft_rounds for r in rs),
            # drafts RequestTiming counts as accepted that were never committed: verified in a round that a stop
            # (EOS) cut short. tau includes them; they are few (see the model card).
            "accepted_after_stop": sum(r.draft_n_accepted - sum(m for _, m, _ in r.rounds) for r in rs),
        }


REPEAT_CONTEXT, REPEAT_AHEAD = 4, 4


def is_repeat(seq: list[int], n: int) -> bool:
    """Whether the text at anchor n is a verbatim repeat: the REPEAT_CONTEXT tokens ending at n followed by the
    next REPEAT_AHEAD tokens (fewer at the sequence's end) occur earlier in the sequence (prompt included). The tiny
    target's greedy output falls into such loops, which every drafter finds easy."""
    lo, hi = n + 1 - REPEAT_CONTEXT, min(n + 1 + REPEAT_AHEAD, len(seq))
    if lo < 0 or hi <= n + 1:
        return False
    gram = seq[lo:hi]
    width = len(gram)
    return any(seq[i:i + width] == gram for i in range(lo))


def repeat_split(rounds: list[tuple[int, int, bool]]) -> dict:
    """tau over the rounds at verbatim repeats and over the others (per-round records of the propose hook)."""
    out = {"recorded_rounds": len(rounds)}
    for name, flag in (("repeat", True), ("novel", False)):
        sel = [m for _, m, r in rounds if r == flag]
        out[f"{name}_rounds"] = len(sel)
        out[f"tau_{name}"] = round(1 + sum(sel) / len(sel), 3) if sel else None
    return out


def record_rounds(llm) -> tuple[dict[int, list[tuple[int, list[int]]]], list[int]]:
    """Wrap the engine so every proposal is kept: (request id -> [(anchor index, drafts)], request ids in the order
    they were added). The anchor is the last committed token (index num_tokens - 1); the drafts guess the tokens
    after it."""
    log: dict[int, list] = {}
    order: list[int] = []
    drafter, add = llm.engine.speculation.drafter, llm.engine.add_request
    # (a drafter that stages its drafts on the device proposes through `stage`; they are read here for the record)
    name = "stage" if drafter.stages_on_device else "propose"
    propose = getattr(drafter, name)

    def recording(requests, ks):
        out = propose(requests, ks)
        tokens = out.to_host().tokens if name == "stage" else out.tokens
        for req, drafts in zip(requests, tokens):
            if drafts:
                log.setdefault(req.request_id, []).append((req.num_tokens - 1, list(drafts)))
        return out

    def adding(req, on_output):
        order.append(req.request_id)
        return add(req, on_output)

    setattr(drafter, name, recording)
    llm.engine.add_request = adding
    return log, order


def rounds_of(seq: list[int], proposals: list[tuple[int, list[int]]]) -> list[tuple[int, int, bool]]:
    """(drafts, accepted, repeat) per proposal of one request whose final sequence is `seq`. Greedy verification
    accepts the drafts' longest prefix that matches the committed tokens (a round cut by a stop counts only the
    drafts that were committed)."""
    out = []
    for n, drafts in proposals:
        truth = seq[n + 1:n + 1 + len(drafts)]
        m = next((j for j, (d, t) in enumerate(zip(drafts, truth)) if d != t), min(len(drafts), len(truth)))
        out.append((len(drafts), m, is_repeat(seq, n)))
    return out


class TrainingCode:
    """The demo trainer's model code (outrider_tools.demo: outrider's modules run densely, teacher-forced, which
    computes the offline acceptance proxy) with the shipped weights, in float32 on the CPU: what it drafts on a
    final sequence. target and drafters (kind -> checkpoint directory): another family's than the demo's; a
    drafter is loaded when first asked for."""

    def __init__(self, target: str | None = None, drafters: dict[str, str] | None = None) -> None:
        from pathlib import Path

        from outrider_tools.demo import models

        self.models_of = models
        self.paths = {k: Path(v) for k, v in {"target": target, **(drafters or {})}.items() if v}
        self.target = models.load_lm(self.path("target"))
        self.models: dict[str, object] = {}

    def path(self, kind: str):
        from outrider import demo

        return self.paths.get(kind) or demo.demo_path(kind)

    def model(self, kind: str):
        """The training code's drafter of `kind`, loaded once."""
        if kind not in self.models:
            m = self.models_of
            self.models[kind] = {"draft": lambda: m.load_lm(self.path(kind)),
                                 "mtp": lambda: m.load_mtp(self.path("target"), self.target),
                                 "dflash": lambda: m.load_dflash(self.path(kind)),
                                 "eagle3": lambda: m.load_eagle3_head(self.path(kind), self.target.config)}[kind]()
        return self.models[kind]

    @torch.no_grad()
    def predictor(self, kind: str, k: int, seq: list[int]):
        """f(n, j): the token the training code drafts for index n+j+1 when the last committed index is n (None
        where it has no prediction). Teacher-forced: for MTP, EAGLE-3 and the draft model, slot j assumes slots < j
        were right, so only slots up to the first wrong draft are comparable."""
        from outrider_tools.dense import mtp_unroll
        from outrider_tools.demo.objectives import dflash_block

        s, L = torch.tensor([seq]), len(seq)
        if kind == "draft":
            draft = self.model(kind)
            dh, _ = draft(s)
            da = draft.logits(dh).argmax(-1)[0].tolist()
            return lambda n, j: da[n + j] if n + j < L else None
        steps = max(k, 1)

        def chain(preds):  # chain index i = n-1; step j+1 predicts index n+j+1
            return lambda n, j: preds[j][n - 1] if j < steps and 0 <= n - 1 < len(preds[j]) else None

        if kind == "mtp":
            th, _ = self.target(s)
            return chain([self.target.logits(y).argmax(-1)[0].tolist()
                          for y in mtp_unroll(self.model(kind), self.target, th, s, steps)])
        if kind == "eagle3":
            head = self.model(kind)
            _, tapped = self.target(s, taps=head.taps)
            return chain([head.drafts(y)[0].tolist() for y in head.unroll(self.target, torch.cat(tapped, -1), s,
                                                                            steps)])
        # DFlash: a block at every anchor 1..L-1 (the block may run past the sequence's end; only its slot 0 is read)
        dflash = self.model(kind)
        _, tapped = self.target(s, taps=dflash.taps)
        anchors = torch.arange(1, L)[None]
        ids, pos, mask = dflash_block(s, anchors, dflash.block_size, dflash.mask_id)
        hid = dflash(torch.cat(tapped, -1), self.target.embed(ids), pos, mask)
        fa = self.target.logits(hid).argmax(-1)[0].view(-1, dflash.block_size).tolist()
        return lambda n, j: fa[n - 1][j + 1] if 1 <= n < L and j + 1 < dflash.block_size else None

    def compare(self, kind: str, k: int, seq: list[int], proposals) -> tuple[int, int]:
        """(slots compared, slots where the engine's draft equals the training code's) over a request's rounds."""
        pred = self.predictor(kind, k, seq)
        compared = equal = 0
        for n, drafts in proposals:
            for j, d in enumerate(drafts):
                want = pred(n, j)
                if want is None:
                    break
                compared += 1
                equal += d == want
                if kind != "dflash" and (n + j + 1 >= len(seq) or d != seq[n + j + 1]):
                    break  # later slots of a teacher-forced drafter saw a different input
        return compared, equal


def training_code_summary(rs: list[PromptResult]) -> dict:
    pairs = [r.training_code for r in rs if r.training_code is not None]
    if not pairs:
        return {}
    return {"training_code_slots": sum(c for c, _ in pairs), "training_code_equal": sum(e for _, e in pairs)}


def parse_setting(text: str) -> tuple[str, int]:
    kind, _, k = text.partition(":")
    if kind not in KINDS or not k.isdigit() or int(k) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KIND:K with KIND in {'|'.join(KINDS)} and K >= 1")
    return kind, int(k)


def select_prompts(which: str, limit: int | None) -> list[tuple[int, dict]]:
    """(index in eval_prompts.json, prompt) for "all" | "def" | "window"; limit takes the first N of each kind
    ("all": the first N def prompts and the first N window prompts)."""
    from outrider import demo

    prompts = list(enumerate(demo.eval_prompts()))
    kinds = ("def", "window") if which == "all" else (which,)
    out = []
    for kind in kinds:
        chosen = [(i, p) for i, p in prompts if p["kind"] == kind]
        out += chosen[:limit] if limit else chosen
    return sorted(out)


def kv_blocks(prompt_lens: list[int], max_tokens: int, batch: int, block_size: int = 16) -> int:
    """Enough KV blocks for `batch` of the longest requests, with room for a DFlash block of lookahead."""
    need = -(-(max(prompt_lens) + max_tokens + 32) // block_size)
    return batch * need + 8


def make_llm(kind: str | None, k: int, *, device: str, dtype: str, num_kv_blocks: int, batch: int,
             target: str | None = None, draft_model: str | None = None, fixed: bool = False):
    """An engine for `target` (default: the demo target) with drafter `kind` (None: none) drafting up to k, from
    `draft_model` (default: the demo's) for the kinds that have one. fixed: no measured step costs (the CUDA
    default), so that a drafter with step_cost 0 always drafts the cap, and each round drafted after the last one
    is committed (drafting ahead caps the last rounds of a request by the tokens the round in flight may still
    commit: not the documented k there); a confidence stop no draft falls below keeps rounds from being drafted
    ahead, and trims nothing."""
    from outrider import LLM, demo

    kwargs = dict(device=device, dtype=dtype, num_kv_blocks=num_kv_blocks, max_num_seqs=max(batch, 1))
    if kind is None:
        kwargs["spec_type"] = "none"
    else:
        kwargs.update(spec_type=kind, spec_draft_n_max=k)
        if kind in ("draft", "dflash", "eagle3"):
            kwargs["draft_model"] = draft_model or str(demo.demo_path(kind))
        if fixed:
            kwargs.update(spec_measured_costs=False, draft_p_min=1e-30)
    llm = LLM(target or str(demo.demo_path("target")), **kwargs)
    if kind is not None and llm.engine.drafter_kind != kind:
        raise RuntimeError(f"the engine did not load the {kind} drafter (see the log)")
    return llm


def run_prompts(llm, prompts: list[tuple[int, dict]], max_tokens: int, batch: int):
    """Greedy completions, in prompt order, `batch` requests at a time."""
    from outrider import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = []
    for s in range(0, len(prompts), batch):
        outs += llm.generate([p["prompt"] for _, p in prompts[s:s + batch]], params)
    return outs


def measure(settings: list[tuple[str, int]], prompts: list[tuple[int, dict]], *, max_tokens: int = 128,
            policies: tuple[str, ...] = ("fixed",), batch: int = 1, device: str = "cpu", dtype: str = "float32",
            vs_training_code: bool = False, target: str | None = None, draft_models: dict[str, str] | None = None,
            log=print) -> tuple[list[int], list[SettingResult]]:
    """Plain greedy token ids per prompt, and one SettingResult per (policy, setting). vs_training_code: also
    compare every round's drafts with what the demo trainer's model code drafts at the same point. target and
    draft_models (kind -> checkpoint): another model and its drafters than the demo family's."""
    from outrider import demo
    from outrider.tokenizer import Tokenizer

    target = target or str(demo.demo_path("target"))
    tok = Tokenizer.from_pretrained(target)
    lens = [len(tok.encode(p["prompt"])) for _, p in prompts]
    blocks = kv_blocks(lens, max_tokens, batch)
    reference = TrainingCode(target, draft_models) if vs_training_code else None
    t0 = time.time()
    plain = [o.token_ids for o in run_prompts(make_llm(None, 0, device=device, dtype=dtype, num_kv_blocks=blocks,
                                                       batch=batch, target=target), prompts, max_tokens, batch)]
    log(f"plain greedy: {len(prompts)} prompts, {sum(map(len, plain))} tokens, {time.time() - t0:.1f}s")
    results = []
    for policy in policies:
        for kind, k in settings:
            t0 = time.time()
            llm = make_llm(kind, k, device=device, dtype=dtype, num_kv_blocks=blocks, batch=batch, target=target,
                           draft_model=(draft_models or {}).get(kind), fixed=policy == "fixed")
            if policy == "fixed":
                # expected_tokens(alpha, n) grows with n, so with no cost per draft the online rule always takes
                # the cap: min(K, max_draft, tokens left - 1, batch cap).
                llm.engine.speculation.drafter.step_cost = 0.0
            res = SettingResult(kind, k, policy)
            log_rounds, request_ids = record_rounds(llm)
            outs = run_prompts(llm, prompts, max_tokens, batch)
            for (i, p), n, ref, o, rid in zip(prompts, lens, plain, outs, request_ids):
                t = o.timing
                seq = o.prompt_ids + o.token_ids
                props = log_rounds.get(rid, [])
                res.prompts.append(PromptResult(i, p["kind"], n, len(o.token_ids), t.draft_rounds, t.draft_n,
                                                t.draft_n_accepted, list(t.accepted_per_position),
                                                o.token_ids == ref, rounds_of(seq, props),
                                                reference and reference.compare(kind, k, seq, props)))
            res.seconds = round(time.time() - t0, 1)
            s = res.summary()
            same = (f"  drafts = training code's {s['training_code_equal']}/{s['training_code_slots']}"
                    if reference else "")
            log(f"{policy:6} {res.name:9} tau {s['tau']}  mean k {s['mean_k']}  identical "
                f"{s['identical']}/{s['prompts']}{same}  ({res.seconds}s)")
            results.append(res)
    return plain, results


def table(results: list[SettingResult]) -> str:
    head = ("| policy | drafter | k | prompts | tau | tau def | tau window | tau/prompt (min) | mean k | accept "
            "| tok/step | repeat rounds | tau novel | tau repeat | identical |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        a, d, w = r.summary(), r.summary("def"), r.summary("window")
        lines.append(f"| {r.policy} | {r.kind} | {r.k} | {a['prompts']} | **{a['tau']}** | {d['tau']} | {w['tau']} "
                     f"| {a['tau_per_prompt_mean']} ({a['tau_per_prompt_min']}) | {a['mean_k']} "
                     f"| {a['acceptance_rate']} | {a['tokens_per_step']} "
                     f"| {a['repeat_rounds'] / max(a['recorded_rounds'], 1):.0%} | {a['tau_novel']} "
                     f"| {a['tau_repeat']} "
                     f"| {a['identical']}/{a['prompts']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", type=parse_setting, nargs="+", default=[parse_setting(s) for s in DEFAULT_SETTINGS],
                    metavar="KIND:K", help=f"drafter kind and spec_draft_n_max (default: {' '.join(DEFAULT_SETTINGS)})")
    ap.add_argument("--policy", default="fixed", help="fixed | online | fixed,online (see above)")
    ap.add_argument("--prompts", choices=("all", "def", "window"), default="all")
    ap.add_argument("--limit", type=int, default=None, help="first N prompts of each kind (default: all 64)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1, help="requests decoded together (the batch cap applies)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest for this tiny model)")
    ap.add_argument("--json", default="acceptance.json", help="where to write the results")
    ap.add_argument("--vs-training-code", action="store_true",
                    help="compare every round's drafts with the demo trainer's model code (the offline proxy)")
    ap.add_argument("--check", action="store_true", help="exit 1 unless every setting meets issue 6's threshold "
                    "(EAGLE-3 has none) and every output is identical to plain decoding")
    args = ap.parse_args(argv)
    policies = tuple(args.policy.split(","))
    if not set(policies) <= {"fixed", "online"}:
        ap.error("--policy: fixed, online or fixed,online")
    torch.set_num_threads(args.threads)

    prompts = select_prompts(args.prompts, args.limit)
    t0 = time.time()
    _, results = measure(args.settings, prompts, max_tokens=args.max_tokens, policies=policies, batch=args.batch,
                         device=args.device, dtype=args.dtype, vs_training_code=args.vs_training_code)
    print()
    print(table(results))
    from outrider import demo

    out = {
        "what": "mean acceptance length tau = 1 + sum(draft_n_accepted) / sum(draft_rounds) over all prompts, "
                "measured through outrider.LLM (the engine step) with greedy decoding; identical = greedy output "
                "equals the no-drafter output token for token",
        "command": "scripts/measure_acceptance.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "max_tokens": args.max_tokens, "temperature": 0.0, "batch": args.batch, "device": args.device,
        "dtype": args.dtype, "prompts": args.prompts, "limit": args.limit, "prompt_indices": [i for i, _ in prompts],
        "block_size": json.loads((demo.demo_path("dflash") / "config.json").read_text())["block_size"],
        "torch": torch.__version__, "python": platform.python_version(), "seconds": round(time.time() - t0, 1),
        "thresholds": THRESHOLDS,
        "results": [{"drafter": r.kind, "spec_draft_n_max": r.k, "policy": r.policy, "seconds": r.seconds,
                     "all": r.summary(), "def": r.summary("def"), "window": r.summary("window"),
                     "per_prompt": [{"index": p.index, "kind": p.kind, "tau": p.tau and round(p.tau, 3),
                                     "rounds": p.draft_rounds, "generated": p.generated,
                                     "identical": p.identical} for p in r.prompts]}
                    for r in results],
    }
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(f"\nwrote {args.json}")
    if args.check:
        bad = [f"{r.policy} {r.name}: tau {r.summary()['tau']}" for r in results
               if r.kind in THRESHOLDS and (r.summary()["tau"] or 0) < THRESHOLDS[r.kind]]
        bad += [f"{r.policy} {r.name}: prompt {p.index} differs from plain decoding" for r in results
                for p in r.prompts if not p.identical]
        bad += [f"{r.policy} {r.name}: drafts differ from the training code's in "
                f"{s['training_code_slots'] - s['training_code_equal']} of {s['training_code_slots']} slots"
                for r in results for s in [r.summary()] if s.get("training_code_slots", 0) != s.get(
                    "training_code_equal", 0)]
        for b in bad:
            print("FAIL", b)
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
