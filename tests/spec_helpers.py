"""Shared by the speculative-decoding tests: a checkpoint family whose drafters really get accepted part of the
time, a step clock that makes engine steps last a chosen time, and the real server app on loopback in-process.
"""

from __future__ import annotations

import math
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from outrider.testing.checkpoints import write_tiny_checkpoint
from outrider.config import NgramConfig
from outrider.speculative.kinds import KINDS
from outrider.testing.drafters import write_dflash_checkpoint, write_eagle3_checkpoint, write_mtp_checkpoint
from outrider.timing import RequestTiming, now

H, V = 64, 512  # hidden size; the tiny tokenizer's vocabulary
HUBS = (100, 200, 300)  # the tokens the family's target concentrates on
MASK_ID = 4  # <|mask|> in the tiny tokenizer: the DFlash drafters' mask token


# --- a checkpoint family with mid acceptance ----------------------------------------------------------------
#
# A random tiny checkpoint spreads its next-token mass over the whole vocabulary and random drafters almost never
# propose a token the target keeps. In this family the target is nearly a bigram model whose top-p 0.9 set holds
# two or three "hub" tokens (which one is favoured depends on the previous token), and every drafter agrees with
# it part of the time: a perturbed copy as draft model, MTP heads and a DFlash drafter that pass a token
# embedding through to the target's LM head.

def _save(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors", metadata={"format": "pt"})


def _concentrate(t: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Every embedding gets a shared component u, so the final normed hidden always points partly along u. The
    LM head gives the hubs logits 7, 6.5 and 6 along u and every other token a small random one (std 0.5), and
    adds 1.2 to hub i+1's logit when the last token is hub i. Residual branches are scaled by 0.2, so the context
    beyond the last token still matters a little."""
    gen = torch.Generator().manual_seed(seed)
    c = 1.0
    u = torch.randn(H, generator=gen)
    u = u / u.norm()
    own = t["model.embed_tokens.weight"]  # rows of norm sqrt(H)
    t["model.embed_tokens.weight"] = own + c * math.sqrt(H) * u
    for name in t:
        if name.startswith("model.layers.") and name.endswith(("o_proj.weight", "down_proj.weight")):
            t[name] = 0.2 * t[name]
    t["model.norm.weight"] = torch.ones(H)
    head = 0.5 * torch.randn(V, H, generator=gen) / math.sqrt(H)
    # The normed hidden of token x is sqrt(H) * (own[x] + c sqrt(H) u) / |...|: its components along u and along
    # own[x] / |own[x]| are sqrt(H) c / sqrt(1 + c^2) and sqrt(H) / sqrt(1 + c^2).
    scale = math.sqrt(1 + c * c) / math.sqrt(H)
    for tok, bias in zip(HUBS, (7.0, 6.5, 6.0)):
        head[tok] += bias * scale / c * u
    for prev, nxt in zip(HUBS, HUBS[1:] + HUBS[:1]):
        head[nxt] += 1.2 * scale * own[prev] / own[prev].norm()
    t["lm_head.weight"] = head
    return t


def _pass_through_head(t: dict[str, torch.Tensor], prefix: str, fuse: str, token_first: bool,
                       gen: torch.Generator) -> None:
    """An MTP head that (noisily) feeds the embedding of t_{i+1} straight to the target's LM head: it predicts the
    target's bigram successor of t_{i+1}, usually the target's argmax for t_{i+2}."""
    eye, zero = torch.eye(H), torch.zeros(H, H)
    fc = torch.cat([eye, zero] if token_first else [zero, eye], dim=1)
    t[prefix + fuse] = fc + 0.3 / math.sqrt(H) * torch.randn(H, 2 * H, generator=gen)
    for name in t:
        if not name.startswith(prefix):
            continue
        if name.endswith(("o_proj.weight", "down_proj.weight")):  # the decoder layer adds nothing
            t[name] = torch.zeros_like(t[name])
        elif name.endswith("norm.weight") and not name.endswith(("q_norm.weight", "k_norm.weight")):
            t[name] = torch.ones_like(t[name])


def write_family(root: Path, arch: str, members: tuple[str, ...], seed: int = 5, layers: int = 1) -> dict[str, Path]:
    """`target` (arch, `layers` layers) and the drafters named in `members`: `draft` (a perturbed copy), `mtp` (the
    target plus a Qwen3-Next layout head), `mimo` (the target plus a MiMo layout head), `dflash`, `eagle3` (a head
    tapping the inputs of layers 1-3: `layers` >= 4)."""
    root = Path(root)
    out = {"target": write_tiny_checkpoint(root / "target", arch, hidden_size=H, layers=layers, seed=seed)}
    base = _concentrate(load_file(out["target"] / "model.safetensors"), seed + 100)
    _save(out["target"], base)
    gen = torch.Generator().manual_seed(seed + 200)
    if "draft" in members:
        out["draft"] = root / "draft"
        shutil.copytree(out["target"], out["draft"])
        _save(out["draft"], {n: x + 0.3 * x.std() * torch.randn(x.shape, generator=gen) if x.dim() == 2 else x
                             for n, x in base.items()})
    for layout, prefix, fuse, token_first in (("mtp", "mtp.", "fc.weight", True),
                                              ("mimo", "model.mtp_layers.0.", "input_proj.weight", False)):
        if layout in members:
            path = write_mtp_checkpoint(root / layout, "qwen" if layout == "mtp" else "mimo", arch=arch,
                                        hidden_size=H, layers=1, seed=seed)
            t = {**load_file(path / "model.safetensors"), **base}  # the very same target weights
            _pass_through_head(t, prefix, fuse, token_first, gen)
            _save(path, t)
            out[layout] = path
    if "dflash" in members:
        out["dflash"] = _write_hub_dflash(root / "dflash", out["target"])
    if "eagle3" in members:
        # The layer adds nothing and fc passes the last tap through: the head scores (nearly) the target's own
        # hidden state with the target's LM head rows for its draft vocabulary (the hubs and a few dozen more).
        # It drafts the target's favourite hub after the previous token, which the target keeps part of the time;
        # without the d2t map its ids would name other tokens, which the target never keeps.
        draft_ids = sorted({*HUBS, *range(5, 60)})
        out["eagle3"] = write_eagle3_checkpoint(root / "eagle3", out["target"], draft_ids=draft_ids,
                                                aux_layer_ids=[1, 2, 3], seed=seed)
        t = load_file(out["eagle3"] / "model.safetensors")
        for name in t:
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                t[name] = torch.zeros_like(t[name])
        t["fc.weight"] = torch.cat([torch.zeros(H, 2 * H), torch.eye(H)], dim=1)
        t["norm.weight"] = torch.ones(H)
        t["lm_head.weight"] = base["lm_head.weight"][draft_ids]
        _save(out["eagle3"], t)
    return out


def _write_hub_dflash(path: Path, target: Path) -> Path:
    """A DFlash drafter with zero residual branches: a mask slot's output is the mask token's embedding, so it always
    proposes the target's favourite hub after <|mask|>, which the target keeps part of the time."""
    path = write_dflash_checkpoint(path, target, layers=1, block_size=4, mask_token_id=MASK_ID)
    t = load_file(path / "model.safetensors")
    for name in t:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            t[name] = torch.zeros_like(t[name])
    t["norm.weight"] = torch.ones(H)
    _save(path, t)
    return path


def write_hybrid_family(root: Path, arch: str, seed: int = 5, layers: int = 4) -> dict[str, Path]:
    """A hybrid `target` (Qwen3-Next / Qwen3.5) made the family's near-bigram model, a Qwen3 `draft` model of the same
    vocabulary that reads the same bigram from the embedding alone (zero residual branches), a `dflash` drafter, and
    `mtp`: the same target with its own MTP head as released (`mtp.*`), passing t_{i+1}'s embedding through."""
    root = Path(root)
    target = write_tiny_checkpoint(root / "target", arch, hidden_size=H, layers=layers, seed=seed)
    t = _concentrate(load_file(target / "model.safetensors"), seed + 100)
    for name in t:  # (residual branches at 0.08: the embedding-only draft then agrees often, not always)
        if name.endswith(("o_proj.weight", "down_proj.weight", "out_proj.weight")):
            t[name] = (0.4 if name.startswith("model.layers.") and "linear_attn" not in name else 0.08) * t[name]
    t["model.norm.weight"] = torch.zeros(H)  # (stored as w for 1 + w: the family's norm of ones)
    _save(target, t)
    draft = write_tiny_checkpoint(root / "draft", "qwen3", hidden_size=H, layers=1, seed=seed + 1)
    d = load_file(draft / "model.safetensors")
    for name in d:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            d[name] = torch.zeros_like(d[name])
    d.update({"model.embed_tokens.weight": t["model.embed_tokens.weight"], "lm_head.weight": t["lm_head.weight"],
              "model.norm.weight": torch.ones(H)})
    _save(draft, d)
    mtp = write_mtp_checkpoint(root / "mtp", "qwen", arch=arch, hidden_size=H, layers=layers, seed=seed)
    with_head = {**load_file(mtp / "model.safetensors"), **t}  # the very same target weights
    _pass_through_head(with_head, "mtp.", "fc.weight", True, torch.Generator().manual_seed(seed + 300))
    _save(mtp, with_head)
    return {"target": target, "draft": draft, "dflash": _write_hub_dflash(root / "dflash", target), "mtp": mtp}


# kind -> (family arch, checkpoint served as the target, engine kwargs from the family, drafter kind reported)
SETUPS = {
    "draft": ("qwen3", "target", lambda c: dict(draft_model=str(c["draft"])), "draft"),
    "mtp": ("qwen3", "mtp", lambda c: {}, "mtp"),
    "mimo": ("qwen2", "mimo", lambda c: {}, "mtp"),  # MiMo's head sits on a Qwen2-style target
    "dflash": ("qwen3", "target", lambda c: dict(draft_model=str(c["dflash"])), "dflash"),
    "eagle3": ("eagle", "target", lambda c: dict(draft_model=str(c["eagle3"])), "eagle3"),
}
# The reported kind in llama-server's `speculative.types` spelling (its --spec-type names).
LLAMA_SPEC_TYPES = {k.name: k.llama_name for k in KINDS if k.weights}

# N-gram lookup, alone and combined with a drafter with weights: it drafts only where the context repeats, so these
# run on prompts that hold some of the hubs' bigrams (100 -> 200, 300 -> 100) but not all: lookup drafts after
# those, and the model drafter, when combined, after the others (both kinds draft in many requests).
# kind -> (family arch, served checkpoint, engine kwargs, kinds a request may report, prompt)
NGRAM = NgramConfig(size_n=1, size_m=4)
LOOKUP_SETUPS = {
    "ngram": ("qwen3", "target", lambda c: dict(spec_type="ngram", spec_ngram=NGRAM), {"ngram"},
              [5, 9, 100, 200, 13, 100, 200]),
    "ngram,draft": ("qwen3", "target", lambda c: dict(spec_type="ngram,draft", spec_ngram=NGRAM,
                                                      draft_model=str(c["draft"])), {"ngram", "draft"},
                    [5, 9, 100, 200, 13, 100, 200]),
    "ngram,eagle3": ("eagle", "target", lambda c: dict(spec_type="ngram,eagle3", spec_ngram=NGRAM,
                                                       draft_model=str(c["eagle3"])), {"ngram", "eagle3"},
                     [5, 300, 100, 9, 300, 100, 13, 17]),
}


def write_families(root: Path) -> dict[str, dict[str, Path]]:
    return {"qwen3": write_family(root / "qwen3", "qwen3", ("draft", "mtp", "dflash")),
            "qwen2": write_family(root / "qwen2", "qwen2", ("mimo",)),
            "eagle": write_family(root / "eagle", "qwen3", ("eagle3",), layers=4)}


def write_attentive_families(root: Path) -> dict[str, dict[str, Path]]:
    """write_families, with each hidden-reading drafter's attention made to count: there its output projection is
    zero, so its drafts would not depend on what it learned, nor where."""
    out = write_families(root)
    gen = torch.Generator().manual_seed(11)
    for arch, member in (("qwen3", "dflash"), ("qwen3", "mtp"), ("qwen2", "mimo"), ("eagle", "eagle3")):
        path = out[arch][member] / "model.safetensors"
        t = load_file(path)
        for name in t:
            if name.endswith("self_attn.o_proj.weight") and not name.startswith("model.layers."):  # (not the target's)
                t[name] = torch.randn(t[name].shape, generator=gen) / math.sqrt(H)
        save_file(t, path, metadata={"format": "pt"})
    return out


# --- steps that last a chosen time -------------------------------------------------------------------------

@dataclass
class Step:
    start: float  # when the clock started counting this step (see StepClock)
    # The engine launched it (after proposing drafts for its requests): where the timing rule starts the prompt
    # of a request it admits; the host work before, inside the clocked step, is that request's queue wait.
    launched: float
    end: float  # the runner's step hook returned (the step's tokens are on the host)
    prefill: bool
    requests: list  # the engine Requests scheduled in this step
    budget: float  # P or R
    overrun: float  # engine work past the budget (the hook was entered that late)
    late: float  # the hook's own oversleep: scheduling noise of the test, not work of the engine

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class StepClock:
    """Makes every engine step last `prefill_s` when its plan prefills and `round_s` otherwise (the runner's step
    hook sleeps out the rest), and records each step.

    A step is counted from the end of the previous step's clocked part (its hook) when the engine went straight on
    to it, so the bookkeeping between two hooks (commit, drafters learning the new rows, the next propose) is
    inside the step and consecutive tokens are exactly P or R apart. After the engine ran out of work, a step is
    counted from the moment Engine.step is entered.

    `gate`, when cleared, holds every non-prefill step in the hook until it is set again (the engine thread then
    waits there, with its snapshot for /slots published after the previous step)."""

    prefill_s: float = 0.0
    round_s: float = 0.0
    steps: list[Step] = field(default_factory=list)
    gate: threading.Event = field(default_factory=threading.Event)
    _start: float = 0.0
    _last_end: float = 0.0
    _busy: bool = False  # the engine still had work after its previous step (it goes straight on)
    _launched: dict = field(default_factory=dict)  # id(plan) -> when the runner's launch was entered

    def __post_init__(self) -> None:
        self.gate.set()

    def install(self, engine) -> StepClock:
        inner = engine.step

        def step() -> None:
            entered = now()
            self._start = self._last_end if self._busy else entered
            inner()
            self._busy = engine.has_work()

        engine.step = step  # the instance attribute shadows the method for LLM and AsyncEngine alike
        launch = engine.runner.launch

        def launched(plan, *args, **kwargs):
            self._launched[id(plan)] = now()
            return launch(plan, *args, **kwargs)

        engine.runner.launch = launched
        engine.runner.step_hook = self._hook
        return self

    def _hook(self, plan) -> None:
        entered = now()
        budget = self.prefill_s if plan.has_prefill else self.round_s
        until = self._start + budget
        while (left := until - now()) > 0:
            time.sleep(left)
        late = now() - max(until, entered)
        if not plan.has_prefill:
            assert self.gate.wait(timeout=60), "the test never opened the gate"
        self._last_end = now()
        self.steps.append(Step(self._start, self._launched.pop(id(plan)), self._last_end, plan.has_prefill,
                               [s.request for s in plan.scheduled], budget, max(0.0, entered - until), late))

    def steps_of(self, timing: RequestTiming) -> list[Step]:
        return [s for s in self.steps if any(r.timing is timing for r in s.requests)]

    def check(self, timings: dict, timing: RequestTiming, jitter_ms: float, max_overrun_ms: float = 250.0) -> None:
        """Criterion 4 for one request, whose prompt fits one step: prompt_ms is within 5 % (+ jitter) of P less
        the host work before its step's launch, and of its prefill step as measured from that launch; predicted_ms is within 5 % (+ jitter) of the total of every later step
        it took part in (the rounds, and any prefill of another request that shared them). And no step did
        work far beyond its budget: a load hidden inside a step (a lazily loaded drafter) would show there, even
        though the measured totals would then agree with the timings."""
        steps = self.steps_of(timing)
        assert steps and steps[0].prefill, "the request's first step must be its prefill"
        why = f"{timings} over steps (ms, budget, overrun) " + str(
            [(round(s.seconds * 1e3, 1), round(s.budget * 1e3), round(s.overrun * 1e3, 1)) for s in steps])
        first = steps[0]
        P, prompt = self.prefill_s * 1e3, (first.end - first.launched) * 1e3
        predicted = sum(s.seconds for s in steps[1:]) * 1e3
        waited = (first.launched - first.start) * 1e3  # drafts proposed for the step's other requests, say
        assert abs(timings["prompt_ms"] - (P + first.late * 1e3 - waited)) <= 0.05 * P + jitter_ms, why
        assert abs(timings["prompt_ms"] - prompt) <= 0.05 * prompt + jitter_ms, why
        assert abs(timings["predicted_ms"] - predicted) <= 0.05 * predicted + jitter_ms, why
        assert max(s.overrun for s in steps) * 1e3 <= max_overrun_ms, why

    def request_with_prompt(self, prompt_ids: list[int]):
        """The engine Request with these prompt ids (HTTP tests give every request its own prompt)."""
        found = {id(r): r for s in self.steps for r in s.requests if r.prompt_ids == list(prompt_ids)}
        assert len(found) == 1, f"{len(found)} engine requests have prompt {prompt_ids}"
        return next(iter(found.values()))


def check_hidden_rows_recompute_without_writing(model: Path, device: str) -> None:
    """A request has decoded a dozen tokens: ModelRunner.hidden_rows over its decoded rows, eager and replaying the
    runner's graphs, gives the hidden states one eager forward over the whole sequence gives there, and leaves the KV
    cache as it was (float32)."""
    from outrider import LLM, SamplingParams
    from outrider.attention.metadata import build_metadata
    from outrider.engine.request import Request
    from outrider.speculative.drafter import Commit

    engine = LLM(model, device=device, dtype="float32").engine
    prompt = [5, 9, 100, 13, 7]
    req = Request(list(prompt), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    engine.add_request(req, lambda out: None)
    while len(req.output_ids) < 12:
        engine.step()
    n = req.num_computed  # (rows whose K/V the steps launched so far write)
    cache = engine.kv_cache.k + engine.kv_cache.v
    before = [t.clone() for t in cache]
    rows = []
    for replay in (False, True):  # (replay: through the runner's graphs, where it has some: CUDA)
        hidden, aux = engine.runner.hidden_rows([Commit(req, len(prompt), n - len(prompt))], replay=replay)
        assert aux is None and all(torch.equal(a, b) for a, b in zip(before, cache))
        rows.append(hidden)
    meta, positions = build_metadata([(req.block_ids, 0, n)], engine.pool.block_size, torch.device(device))
    whole = engine.runner.forward_eager(torch.tensor(req.all_ids[:n], device=device), positions, meta)
    for hidden in rows:
        torch.testing.assert_close(hidden, whole.hidden[len(prompt) :], atol=1e-4, rtol=1e-4)
