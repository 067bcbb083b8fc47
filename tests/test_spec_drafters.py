"""Drafters on tiny random checkpoints: lossless greedy output, oracle acceptance, cache consistency."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch

from outrider.attention import KVCache, get_backend
from outrider.engine.request import Request
from outrider.attention.metadata import build_metadata
from outrider.sampler import RowSpec, Sampler
from outrider.models import load_model
from outrider.params import SamplingParams
from outrider.speculative.drafter import Commit
from outrider.models.registry import load_config
from outrider.speculative.kinds import detect_kind, load_drafter, target_kind
from outrider.speculative.verify import verify
from outrider.testing.checkpoints import write_tiny_checkpoint
from outrider.testing.drafters import write_dflash_checkpoint, write_eagle3_checkpoint, write_mtp_checkpoint

BLOCK, NUM_BLOCKS, BLOCKS_PER_SEQ = 4, 256, 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
PROMPTS = [[5, 9, 14, 3, 7, 21], [40, 41, 2], [17, 17, 30, 60, 11, 8, 9, 1, 33]]


class Loop:
    """What the runner does around a drafter, for one batch of requests: prefill, then speculative rounds."""

    def __init__(self, target_path, kind=None, draft_path=None, k=3):
        self.model, self.cfg = load_model(target_path)
        c = self.cfg
        self.kv = KVCache.allocate(c.num_hidden_layers, NUM_BLOCKS, BLOCK, c.num_key_value_heads, c.head_dim,
                                   torch.float32, "cpu")
        self.backend = get_backend("cpu")
        self.sampler = Sampler(c.vocab_size, "cpu")
        self.k, self.path, self.kind, self.draft_path = k, target_path, kind, draft_path
        self.drafter = None
        self.taps: tuple[int, ...] = ()  # the target layers the drafter reads, tapped in every target forward
        if kind is not None:
            self.drafter = load_drafter(kind, target=self.model, target_cfg=c, target_path=str(target_path),
                                        draft_path=str(draft_path) if draft_path else None,
                                        block_size=BLOCK, dtype=torch.float32, device="cpu",
                                        kv_pool=lambda shape, taps: KVCache.allocate(shape[0], NUM_BLOCKS, BLOCK,
                                                                                     *shape[1:], torch.float32, "cpu"))
            self.taps = tuple(self.drafter.aux_layer_ids)
        self.rounds: list[tuple[int, int]] = []  # (proposed, accepted)
        self.force = None  # test hook: f(k) -> m overrides the verdict, committing d[:m] + a target token

    def generate(self, prompts, params=GREEDY, seeds=None):
        reqs = self.reqs = [Request(list(p), params, seed=s) for p, s in zip(prompts, seeds or itertools.count())]
        for i, r in enumerate(reqs):
            r.block_ids = list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ))
        self.step(reqs, {})  # prefill
        while any(len(r.output_ids) < params.max_tokens for r in reqs):
            live = [r for r in reqs if len(r.output_ids) < params.max_tokens]
            drafts = {}
            if self.drafter is not None:
                k = next(self.k) if isinstance(self.k, Iterator) else self.k  # a schedule may skip rounds
                ks = [min(k, params.max_tokens - len(r.output_ids) - 1) for r in live]
                props = self.drafter.propose(live, ks)
                drafts = {r.request_id: t for r, t in zip(live, props.tokens)}
            self.step(live, drafts)
        return [r.output_ids[: params.max_tokens] for r in reqs]

    @torch.inference_mode()
    def step(self, reqs, drafts):
        feeds = [r.all_ids[r.num_computed :] + drafts.get(r.request_id, []) for r in reqs]
        meta, positions = build_metadata([(r.block_ids, r.num_computed, len(f)) for r, f in zip(reqs, feeds)],
                                         BLOCK, "cpu")
        ids = torch.tensor([t for f in feeds for t in f])
        out = self.model(ids, positions, self.kv, meta, self.backend, self.taps)
        hidden, aux = out.hidden, out.aux_hidden
        ends = list(itertools.accumulate(len(f) for f in feeds))
        ds = [drafts.get(r.request_id, []) for r in reqs]
        rows = [e - len(d) - 1 + j for e, d in zip(ends, ds) for j in range(len(d) + 1)]
        specs = [RowSpec(r.params, r.seed, len(r.output_ids) + j, r.all_ids + d[:j])
                 for r, d in zip(reqs, ds) for j in range(len(d) + 1)]
        logits = self.model.compute_logits(hidden[rows])
        verdict = verify(self.sampler, logits, self.sampler.prepare(specs), ds).settle()
        commits, keep = [], []
        for r, f, e, d, m, toks in zip(reqs, feeds, ends, ds, verdict.num_accepted, verdict.tokens):
            if self.force is not None and d:
                m = self.force(len(d))
                best = logits[rows.index(e - len(d) - 1 + m)].topk(2).indices.tolist()
                toks = d[:m] + [best[1] if m < len(d) and best[0] == d[m] else best[0]]  # a rejection differs
            count = len(f) - len(d) + m  # fed rows that are now committed
            commits.append(Commit(r, r.num_computed, count))
            keep.extend(range(e - len(f), e - len(f) + count))
            r.num_computed += count
            r.output_ids.extend(toks)
            if d:
                self.rounds.append((len(d), m))
        if self.drafter is not None:
            self.drafter.on_commit(commits, hidden[keep], aux[keep] if aux is not None else None)


class GraphStandIn:
    """What CudaGraphRunner offers a drafter (can_run, run), replaying eagerly and counting the replays: drafter
    graphs need CUDA, their routing does not."""

    def __init__(self, fits, forward) -> None:
        self.can_run, self.forward, self.calls = fits, forward, 0

    def run(self, ids, pos, meta):
        self.calls += 1
        return self.forward(ids, pos, meta)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    target = write_tiny_checkpoint(root / "target", layers=4, vocab_size=96, tokenizer=False, seed=1)
    return {
        "target": target,
        "draft": write_tiny_checkpoint(root / "draft", layers=1, hidden_size=32, vocab_size=96, tokenizer=False,
                                       seed=2),
        "mtp_qwen": write_mtp_checkpoint(root / "mtp_qwen", "qwen", layers=4, vocab_size=96, tokenizer=False,
                                         seed=1),
        "mtp_mimo": write_mtp_checkpoint(root / "mtp_mimo", "mimo", layers=4, vocab_size=96, tokenizer=False,
                                         seed=3),
        "dflash": write_dflash_checkpoint(root / "dflash", target, layers=2, block_size=5,
                                          target_layer_ids=[0, 2]),
        # the newer layout, its sliding window shorter than the prompts: the window changes the drafts
        "dflash_sliding": write_dflash_checkpoint(root / "dflash_sliding", target, layers=3, block_size=5,
                                                  target_layer_ids=[0, 2, 3], sliding_window=6),
        # taps out of layer order, one layer twice (a 4-layer target's default taps for two layers are [1, 1])
        "dflash_taps": write_dflash_checkpoint(root / "dflash_taps", target, layers=2, block_size=5,
                                               target_layer_ids=[2, 0, 2]),
        "eagle3": write_eagle3_checkpoint(root / "eagle3", target, aux_layer_ids=[1, 2, 3], seed=4),
        "eagle3_speculators": write_eagle3_checkpoint(root / "eagle3_speculators", target, aux_layer_ids=[1, 2, 3],
                                                      layout="speculators", seed=4),
    }


@pytest.fixture(scope="module")
def plain(ckpts):
    cache = {}

    def run(name):
        if name not in cache:
            cache[name] = Loop(ckpts[name]).generate(PROMPTS)
        return cache[name]

    return run


def test_detect_kind(ckpts):
    assert detect_kind(str(ckpts["dflash"]), str(ckpts["target"])) == "dflash"
    assert detect_kind(str(ckpts["draft"]), str(ckpts["target"])) == "draft"
    assert detect_kind(str(ckpts["mtp_qwen"]), str(ckpts["mtp_qwen"])) == "mtp"
    assert detect_kind(str(ckpts["eagle3"]), str(ckpts["target"])) == "eagle3"
    assert detect_kind(str(ckpts["eagle3_speculators"]), str(ckpts["target"])) == "eagle3"


def test_a_target_speculates_with_the_head_its_own_config_declares(ckpts):
    """Qwen3.5 / Qwen3-Next MTP layers and MiMo's (test_models_moe_mimo.py) declare the MTP kind; a plain target
    declares none (no speculation without a flag)."""
    assert target_kind(load_config(ckpts["mtp_qwen"])) == "mtp"
    assert target_kind(load_config(ckpts["target"])) is None


def test_draft_model_equal_to_target_is_an_oracle(ckpts, plain):
    loop = Loop(ckpts["target"], "draft", ckpts["target"], k=3)
    assert loop.generate(PROMPTS) == plain("target")
    assert loop.rounds and all(m == k for k, m in loop.rounds)


# (kind, target checkpoint, drafter checkpoint) of every drafter layout the fixtures write
LAYOUTS = [
    ("draft", "target", "draft"),
    ("mtp", "mtp_qwen", None),
    ("mtp", "mtp_mimo", None),
    ("dflash", "target", "dflash"),
    ("dflash", "target", "dflash_sliding"),
    ("dflash", "target", "dflash_taps"),
    ("eagle3", "target", "eagle3"),
    ("eagle3", "target", "eagle3_speculators"),
]


@pytest.mark.parametrize("kind,target,draft", LAYOUTS)
def test_greedy_output_is_the_targets(ckpts, plain, kind, target, draft):
    loop = Loop(ckpts[target], kind, ckpts[draft] if draft else None, k=4)
    assert loop.generate(PROMPTS) == plain(target)
    assert sum(k for k, _ in loop.rounds) > 0


def test_seeded_sampling_is_reproducible(ckpts):
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16)
    runs = [Loop(ckpts["target"], "draft", ckpts["draft"]).generate(PROMPTS, params, seeds=[7, 8, 9])
            for _ in range(2)]
    assert runs[0] == runs[1]


def replay(loop, req):
    """A fresh copy of `loop`'s drafter fed the whole committed sequence of `req` in one target forward."""
    fresh = Loop(loop.path, loop.kind, loop.draft_path)
    copy = Request(list(req.all_ids), req.params)
    copy.block_ids = list(range(NUM_BLOCKS - BLOCKS_PER_SEQ, NUM_BLOCKS))  # blocks no one else used
    n = len(copy.all_ids) - 1  # every position but the last token has target rows
    with torch.inference_mode():
        meta, pos = build_metadata([(copy.block_ids, 0, n)], BLOCK, "cpu")
        out = fresh.model(torch.tensor(copy.all_ids[:n]), pos, fresh.kv, meta, fresh.backend, fresh.taps)
        fresh.drafter.on_commit([Commit(copy, 0, n)], out.hidden, out.aux_hidden)
    copy.num_computed = n
    return fresh, copy


@pytest.mark.parametrize("kind,target,draft", LAYOUTS)
def test_state_after_rollbacks_matches_recomputation(ckpts, kind, target, draft):
    """After rounds accepting 0..k drafts (and plain rounds between), the drafter proposes exactly what a fresh
    one fed the committed sequence at once proposes: its KV / context rollback and catch-up are right."""
    loop = Loop(ckpts[target], kind, ckpts[draft] if draft else None, k=itertools.cycle([3, 3, 0, 3, 2]))
    accepted = itertools.cycle([2, 0, 3, 1])  # the round before each plain one rejects everything
    loop.force = lambda k: min(next(accepted), k)
    loop.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=14))
    assert {m for _, m in loop.rounds} >= {0, 1, 2, 3}
    req = loop.reqs[0]
    fresh, copy = replay(loop, req)
    a, b = loop.drafter.propose([req], [3]), fresh.drafter.propose([copy], [3])
    assert a.tokens == b.tokens
    assert a.confidence[0] == pytest.approx(b.confidence[0], abs=1e-4)


def test_the_targets_taps_come_in_the_drafters_order_a_layer_listed_twice_twice(ckpts):
    """aux_hidden is the listed layers' outputs concatenated in the order the drafter lists them (its fc reads
    them so), whatever the layer order, repeats included."""
    loop = Loop(ckpts["target"])
    ids = torch.tensor(PROMPTS[0])
    meta, pos = build_metadata([(list(range(BLOCKS_PER_SEQ)), 0, len(ids))], BLOCK, "cpu")

    def taps(layers):
        with torch.inference_mode():
            return loop.model(ids, pos, loop.kv, meta, loop.backend, layers).aux_hidden

    assert torch.equal(taps((2, 0, 2)), torch.cat([taps((2,)), taps((0,)), taps((2,))], dim=-1))
    assert not torch.equal(taps((2,)), taps((0,)))
    assert taps(()) is None


def test_dflash_block_attention_is_not_causal(ckpts):
    """Changing a later block slot changes the output at an earlier one (the block sees itself both ways)."""
    loop = Loop(ckpts["target"], "dflash", ckpts["dflash"])
    loop.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=2))
    req = loop.reqs[0]
    mask = loop.drafter.mask_token_id
    meta, positions = build_metadata([(req.block_ids, req.num_tokens - 1, 5)], loop.drafter.block_size,
                                     torch.device("cpu"), causal=False)
    with torch.inference_mode():
        h1 = loop.drafter._block_forward(torch.tensor([req.all_ids[-1], mask, mask, mask, mask]), positions, meta)
        h2 = loop.drafter._block_forward(torch.tensor([req.all_ids[-1], mask, mask, 3, mask]), positions, meta)
    assert not torch.allclose(h1[1], h2[1])


@pytest.mark.parametrize("layout,hidden_half", [("qwen", 1), ("mimo", 0)])
def test_mtp_fusion_order_follows_the_checkpoint_layout(ckpts, layout, hidden_half):
    """Qwen's fc reads [embedding, hidden]; MiMo's input_proj reads [hidden, embedding]."""
    from outrider.speculative.mtp import load_mtp_head

    path = ckpts[f"mtp_{layout}"]
    _, head = load_mtp_head(str(path), load_model(path)[1], torch.float32, torch.device("cpu"))
    proj = head.fc if layout == "qwen" else head.input_proj
    h = proj.weight.shape[0]
    with torch.no_grad():
        proj.weight[:, hidden_half * h : (hidden_half + 1) * h] = 0.0
    emb, hid = torch.randn(3, h), torch.randn(3, h)
    torch.testing.assert_close(head.fuse(emb, hid), head.fuse(emb, torch.randn(3, h)))
    assert not torch.allclose(head.fuse(emb, hid), head.fuse(torch.randn(3, h), hid))


def test_draft_model_proposes_through_its_graphs_when_they_fit(tmp_path):
    """A draft model's uniform steps (one token per request: learning, d_1) go to its decode graphs and the drafts
    after d_1 to one chain graph when captured (stand-ins here: graphs need CUDA); other steps, and a drafter
    without graphs, run eager. Drafts are the same."""
    import torch

    from outrider.engine.request import Request
    from outrider.params import SamplingParams
    from outrider.speculative.draft_model import DraftModelDrafter
    from outrider.testing.checkpoints import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "draft", hidden_size=32, layers=1, seed=6)
    drafter = DraftModelDrafter(str(path), 512, block_size=16, dtype=torch.float32, device="cpu",
                                kv_pool=lambda shape, taps: KVCache.allocate(shape[0], 16, 16, *shape[1:], torch.float32,
                                                                             "cpu"))
    req = Request(list(range(3, 20)), SamplingParams())
    req.block_ids = [1, 2]
    eager = drafter.propose([req], [3]).tokens
    drafter.release(req.request_id)

    drafter.graphs = decode = GraphStandIn(lambda meta: meta.max_query_len == 1, drafter._decode_logits)
    chain = drafter.chain
    chain._ks_in = torch.zeros(8, dtype=torch.int64)
    chained = GraphStandIn(lambda meta: meta.max_query_len == 1, lambda ids, pos, meta: chain.steps(
        ids, None, pos, chain._ks_in[: ids.shape[0]], meta.block_tables, 2))
    chain.graphs = {2: chained}
    assert drafter.propose([req], [3]).tokens == eager
    assert (decode.calls, chained.calls) == (0, 1)  # d_1 fed the whole prompt (eager); d_2 and d_3: one replay
    drafter.release(req.request_id)
    drafter.on_commit([Commit(req, 0, req.num_tokens - 1)], None, None)  # learned as one-token sequences
    assert drafter.propose([req], [3]).tokens == eager
    assert (decode.calls, chained.calls) == (2, 2)  # learning, then d_1 from the last token alone


def test_a_draft_chain_beside_a_request_whose_block_table_is_full(tmp_path):
    """Two requests draft together: one with room for three drafts, one whose block table ends at its last token,
    so it gets one draft (d_1) and no chained position. The chain runs for the first and skips the second."""
    from outrider.speculative.draft_model import DraftModelDrafter

    path = write_tiny_checkpoint(tmp_path / "draft", hidden_size=32, layers=1, seed=6)
    drafter = DraftModelDrafter(str(path), 512, block_size=16, dtype=torch.float32, device="cpu",
                                kv_pool=lambda shape, taps: KVCache.allocate(shape[0], 16, 16, *shape[1:], torch.float32,
                                                                             "cpu"))
    roomy, full = Request(list(range(3, 20)), SamplingParams()), Request(list(range(3, 35)), SamplingParams())
    roomy.block_ids, full.block_ids = [1, 2], [3, 4]  # 17 tokens in 32 slots; 32 tokens in 32
    alone = drafter.propose([roomy], [3]).tokens[0]
    drafter.release(roomy.request_id)
    assert [len(d) for d in drafter.propose([roomy, full], [3, 3]).tokens] == [3, 1]
    drafter.release(roomy.request_id)
    assert drafter.propose([roomy, full], [3, 3]).tokens[0] == alone


def test_dflash_drafts_whole_blocks_through_its_graphs_when_they_fit(ckpts):
    """DFlash's whole-block drafting goes to its CUDA graphs when captured (a stand-in here: graphs need CUDA);
    a block cut short near the end of the block table runs eager. Drafts are the same either way."""
    loop = Loop(ckpts["target"], "dflash", ckpts["dflash"])
    loop.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=2))
    drafter, reqs = loop.drafter, loop.reqs
    eager = drafter.propose(reqs, [4, 4]).tokens

    drafter.graphs = replays = GraphStandIn(lambda meta: not meta.causal and meta.max_query_len == drafter.block,
                                            drafter._block_drafts)
    assert drafter.propose(reqs, [4, 4]).tokens == eager and replays.calls == 1
    assert all(len(d) == 4 for d in eager)


def test_eagle3_layouts_load_the_same_head_and_draft_only_its_vocabulary(ckpts):
    """The EAGLE reference layout (midlayer.*, taps in eagle_config) and vLLM speculators' (layers.0.*, the layer's
    config nested) hold the same weights here: both draft alike, and every draft is a target id of the reduced
    vocabulary (d2t applied; the draft vocabulary is a random half, so unmapped ids would fall outside it)."""
    from safetensors.torch import load_file

    loops = [Loop(ckpts["target"], "eagle3", ckpts[name], k=4) for name in ("eagle3", "eagle3_speculators")]
    outs = [loop.generate(PROMPTS) for loop in loops]
    assert outs[0] == outs[1]
    vocab = set((torch.arange(48) + load_file(ckpts["eagle3"] / "model.safetensors")["d2t"]).tolist())
    assert vocab != set(range(48))
    reqs = loops[0].reqs
    drafts = loops[0].drafter.propose(reqs, [4] * len(reqs)).tokens
    assert all(d for d in drafts) and {t for d in drafts for t in d} <= vocab


def test_eagle3_taps_are_layer_inputs():
    """vLLM's aux ids count layer inputs: id j is the output of layer j - 1; the default is (2, L // 2, L - 3)."""
    from outrider.speculative.eagle3 import aux_layer_ids

    assert aux_layer_ids({}, 36) == (1, 17, 32)
    assert aux_layer_ids({"eagle_aux_hidden_state_layer_ids": [33, 2, 18]}, 36) == (1, 17, 32)
    assert aux_layer_ids({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}, 4) == (0, 1, 2)
    for bad in ([0, 1, 2], [1, 1, 2], [1, 2, 4]):
        with pytest.raises(ValueError, match="aux layer ids"):
            aux_layer_ids({"eagle_aux_hidden_state_layer_ids": bad}, 4)


@pytest.mark.parametrize("kind,name", [("mtp", "mtp_qwen"), ("eagle3", "eagle3")])
def test_chain_steps_go_through_graphs_when_they_fit(ckpts, kind, name):
    """A chain drafter's steps after d_1 (head, logits, drafts, each step's metadata advanced on the device) go to
    one CUDA graph per chain length when captured (a stand-in here: graphs need CUDA), reading the head output and
    each row's k from static buffers; the drafts are the same. A request with a shorter k keeps its own drafts."""
    target = ckpts["target"] if kind == "eagle3" else ckpts[name]
    loop = Loop(target, kind, ckpts[name] if kind == "eagle3" else None, k=3)
    loop.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=2))
    drafter, reqs = loop.drafter, loop.reqs
    eager = drafter.propose(reqs, [3, 3]).tokens
    assert drafter.propose(reqs, [3, 1]).tokens == [eager[0], eager[1][:1]]
    device_chain = drafter.chain
    device_chain._state_in = torch.zeros(8, drafter.hidden_size, dtype=drafter.dtype)
    device_chain._ks_in = torch.zeros(8, dtype=torch.int64)

    def chain(ids, pos, meta):
        n = ids.shape[0]
        return device_chain.steps(ids, device_chain._state_in[:n], pos, device_chain._ks_in[:n], meta.block_tables, 2)

    device_chain.graphs = {2: (replays := GraphStandIn(lambda meta: meta.max_query_len == 1, chain))}
    assert drafter.propose(reqs, [3, 3]).tokens == eager and replays.calls == 1  # d_2 and d_3 in one replay
    assert drafter.propose(reqs, [3, 2]).tokens == [eager[0], eager[1][:2]] and replays.calls == 2
    assert all(len(d) == 3 for d in eager)
