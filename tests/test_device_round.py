"""The speculative round with every input on the device (speculative/device_round.py), run eagerly on the CPU: what
a captured graph of it replays. Its commits must be plain greedy decoding's, whatever the drafts; its verdict must
keep exactly the drafts that match; its drafter must draft what the drafter drafts from host-built metadata."""

from __future__ import annotations

import itertools

import pytest
import torch

from outrider import LLM, SamplingParams
from outrider.attention.metadata import build_metadata, uniform_metadata_on_device
from outrider.engine.request import Request, Status
from outrider.speculative.device_round import DeviceRound
from spec_helpers import SETUPS, write_attentive_families

PROMPT = [5, 9, 100, 13, 7, 200, 11, 17, 19, 23]
TOKENS = 40
K = 3
KINDS = ["dflash", "mtp", "mimo", "eagle3", "draft"]


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    return write_attentive_families(tmp_path_factory.mktemp("round"))


@pytest.fixture(scope="module", params=KINDS)
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def plain(families, kind):
    arch, served, _, _ = SETUPS[kind]
    llm = LLM(families[arch][served], dtype="float32", spec_type="none")
    params = SamplingParams(max_tokens=TOKENS + 2 * K + 2, temperature=0.0, ignore_eos=True)
    return llm.generate([PROMPT], params)[0].token_ids


def prefilled(families, kind, **overrides):
    """An engine with the kind's drafter (its engine arguments updated with `overrides`) that has prefilled PROMPT
    and committed its first token, the prompt learned; and that request."""
    arch, served, engine_kwargs, _ = SETUPS[kind]
    llm = LLM(families[arch][served], dtype="float32", spec_draft_n_max=K, block_size=4,
              **(engine_kwargs(families[arch]) | overrides))
    engine = llm.engine
    req = Request(list(PROMPT), SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True))
    engine.add_request(req, lambda out: None)
    while not req.output_ids:
        engine.step()
    engine.speculator.flush()
    return engine, req


def rounds(engine, req, first_drafts: list[int], count: int) -> tuple[list[int], list[int], DeviceRound]:
    """Run `count` device rounds of K drafts from the request's state (its bonus token unfed, `first_drafts` to
    verify): the tokens committed, the accepted count of each round, and the round object."""
    return rounds_of(engine, req, first_drafts, [K] * count)


def rounds_of(engine, req, first_drafts: list[int], lengths: list[int]) -> tuple[list[int], list[int], DeviceRound]:
    """As `rounds`, a round of each length in turn: a new length takes over from the rounds before it, as the engine
    switches (DeviceRound.continue_from); the last round object."""
    width = engine.max_model_len // engine.pool.block_size
    objects = {k: DeviceRound(engine.runner, engine.drafter, k, width) for k in set(lengths)}
    dr = objects[lengths[0]]
    dr.load(req.all_ids[-1], first_drafts, req.num_tokens - 1, req.block_ids)
    out, accepted = [], []
    position = req.num_tokens - 1
    for k in lengths:
        if k != dr.k:
            objects[k].continue_from(dr)
            dr = objects[k]
        assert engine.pool.ensure(req, position + dr.reach())
        dr.set_blocks(req.block_ids)
        dr.run()
        tokens = dr.read()
        out += tokens
        accepted.append(len(tokens) - 1)
        position += len(tokens)
    return out, accepted, dr


def test_device_rounds_commit_plain_greedy_decoding(families, kind, plain):
    engine, req = prefilled(families, kind)
    out, accepted, _ = rounds(engine, req, [0] * K, 12)
    assert req.output_ids == plain[:1]
    assert out == plain[1 : 1 + len(out)] and len(out) >= 12
    assert all(0 <= m <= K for m in accepted)


@pytest.mark.parametrize("right", [0, 1, K])
def test_the_verdict_keeps_exactly_the_leading_drafts_that_match(families, kind, plain, right):
    """First round's drafts: the true continuation's first `right` tokens, then wrong ones."""
    engine, req = prefilled(families, kind)
    truth = plain[1 : 1 + K]
    drafts = truth[:right] + [(t + 1) % 500 for t in truth[right:]]
    out, accepted, _ = rounds(engine, req, drafts, 3)
    assert accepted[0] == right
    assert out == plain[1 : 1 + len(out)]


def test_a_draft_after_a_miss_is_not_kept_even_where_the_target_agrees(families, kind, plain):
    """Drafts [wrong, g]: g is the target's greedy token after the wrong one, so it matches its verify row; the round
    still keeps nothing (only a leading run of matches is accepted)."""
    wrong = (plain[1] + 1) % 500
    arch, served, _, _ = SETUPS[kind]
    target = LLM(families[arch][served], dtype="float32", spec_type="none")
    after = target.generate([PROMPT + plain[:1] + [wrong]], SamplingParams(max_tokens=2, temperature=0.0,
                                                                         ignore_eos=True))[0].token_ids
    engine, req = prefilled(families, kind)
    out, accepted, _ = rounds(engine, req, [wrong, *after[: K - 1]], 2)
    assert accepted[0] == 0 and out == plain[1 : 1 + len(out)]


def test_a_round_longer_than_the_one_before_keeps_no_more_drafts_than_it_was_given(families, kind, plain):
    """A round of K taking over from a round of one verifies that one's draft and K - 1 pads: pads the target would
    keep (here they are its own continuation) are not kept, as the drafter never fed them. The round after keeps
    what matches again."""
    engine, req = prefilled(families, kind)
    width = engine.max_model_len // engine.pool.block_size
    short, long = (DeviceRound(engine.runner, engine.drafter, k, width) for k in (1, K))
    truth = plain[1:]
    short.load(req.all_ids[-1], truth[:1], req.num_tokens - 1, req.block_ids)
    long.continue_from(short)
    assert long.ids.tolist() == [req.all_ids[-1]] + truth[:1] * K
    long.ids[2:] = torch.tensor(truth[1:K])
    assert engine.pool.ensure(req, req.num_tokens - 1 + long.reach())
    long.set_blocks(req.block_ids)
    long.run()
    assert long.read() == truth[:2]
    long.run()  # (its own drafts now, from where the first round ended)
    assert long.read() == truth[2 : 2 + len(long.read())] and int(long.limit.item()) == K


def test_dflash_drafts_what_it_drafts_from_host_built_metadata(families):
    """After rounds, the staged drafts equal DFlash's block recomputed over host-built metadata at the round's next
    position (same context, same block: the same K/V rewritten, the same outputs), and not the block one position
    off (its probabilities differ)."""
    engine, req = prefilled(families, "dflash")
    out, _, dr = rounds(engine, req, [0] * K, 4)
    first = int(dr.first.item())
    assert first == req.num_tokens - 1 + len(out)
    drafter = engine.drafter
    block = torch.tensor([int(dr.ids[0].item())] + [drafter.mask_token_id] * (drafter.block - 1))
    drafts, conf = drafter.block_drafts(block, [(req.block_ids, first, drafter.block)])  # (the round's block K/V)
    assert dr.ids[1:].tolist() == drafts[1 : K + 1].tolist()
    _, off = drafter.block_drafts(block, [(req.block_ids, first - 1, drafter.block)])  # (overwrites context: last)
    assert not torch.allclose(off[1 : K + 1], conf[1 : K + 1], atol=1e-5)


def test_dflash_rounds_learn_the_context_the_host_path_learns(families):
    """The drafter's context K/V at every committed position after device rounds equals what learning those rows
    from one eager target forward over the committed sequence writes."""
    engine, req = prefilled(families, "dflash")
    out, _, dr = rounds(engine, req, [0] * K, 5)
    committed = req.prompt_ids + req.output_ids + out[:-1]  # (the last token is the unfed bonus)
    n = len(committed)
    assert n == int(dr.first.item())
    meta, positions = build_metadata([(req.block_ids, 0, n)], engine.pool.block_size, torch.device("cpu"))
    aux = engine.runner.forward_eager(torch.tensor(committed), positions, meta).aux_hidden
    kv = engine.drafter.kv
    slots = meta.slot_mapping
    learned = [layer.view(-1, *layer.shape[2:])[slots].clone() for layer in kv.k + kv.v]
    engine.drafter._store_context(aux, positions, meta)
    again = [layer.view(-1, *layer.shape[2:])[slots] for layer in kv.k + kv.v]
    for a, b in zip(learned, again):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_uniform_metadata_on_the_device_matches_the_host_built_one():
    first = torch.tensor([3, 9])
    tables = torch.tensor([[4, 7, 2, 0], [1, 5, 6, 8]], dtype=torch.int32)
    for causal in (True, False):
        meta, positions = uniform_metadata_on_device(first, 3, tables, 4, causal)
        host, host_positions = build_metadata([([4, 7, 2, 0], 3, 3), ([1, 5, 6, 8], 9, 3)], 4, torch.device("cpu"),
                                              causal=causal)
        assert positions.tolist() == host_positions.tolist()
        assert meta.slot_mapping.tolist() == host.slot_mapping.tolist()
        assert meta.seq_lens.tolist() == host.seq_lens.tolist()
        assert meta.query_start_loc.tolist() == host.query_start_loc.tolist()
        assert meta.max_query_len == 3 and meta.causal == causal and meta.max_seq_len >= max(host.seq_lens_host)


@pytest.mark.parametrize("head", ["mtp", "mimo", "eagle3"])
def test_chain_heads_in_rounds_learn_and_draft_what_the_host_path_does(families, head):
    """After rounds, a chain head's K/V at every committed position, and the drafts the last round staged, equal the
    head run over the committed rows from one eager target forward (each row paired with the token after it),
    d_1 from the last, the chain after it from the bonus token's position."""
    engine, req = prefilled(families, head)
    out, _, dr = rounds(engine, req, [0] * K, 5)
    committed, bonus = req.prompt_ids + req.output_ids + out[:-1], out[-1]
    n = len(committed)
    assert n == int(dr.first.item())
    block = engine.pool.block_size
    meta, positions = build_metadata([(req.block_ids, 0, n)], block, torch.device("cpu"))
    target = engine.runner.forward_eager(torch.tensor(committed), positions, meta)
    hidden, aux = target.hidden, target.aux_hidden
    drafter, kv = engine.drafter, engine.drafter.kv
    learned = [layer.view(-1, *layer.shape[2:])[meta.slot_mapping].clone() for layer in kv.k + kv.v]
    rows, _ = build_metadata([(req.block_ids, p, 1) for p in range(n)], block, torch.device("cpu"))
    y, drafts, conf = drafter._step(torch.tensor(committed[1:] + [bonus]), drafter.context(hidden, aux), positions,
                                    rows)
    again = [layer.view(-1, *layer.shape[2:])[meta.slot_mapping] for layer in kv.k + kv.v]
    for a, b in zip(learned, again):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    chained, _ = drafter.chain.steps(drafts[-1:], y[-1:], torch.tensor([n]), torch.tensor([K]), meta.block_tables,
                                     K - 1)
    assert dr.ids[1:].tolist() == [int(drafts[-1])] + chained[0].tolist()


@pytest.mark.parametrize("lengths", [[K] * 6, [K, 1, 2, K, 1, K, K]], ids=["steady", "switching"])
@pytest.mark.parametrize("checkpoint", ["draft", "target"])
def test_draft_model_rounds_draft_its_greedy_continuation_of_what_they_committed(families, checkpoint, lengths):
    """Loaded with the engine's own first drafts, rounds keep the draft model's K/V in step with every committed
    token (it equals one forward over them), so the staged drafts are the draft model's own greedy continuation of
    the committed sequence; also where the length changes between rounds. Drafting with the target itself keeps
    every draft (the last one, never fed while drafting, must be fed after), but the pads of a round longer than
    the one before it: that round keeps the drafts it was given, and no more."""
    engine, req = prefilled(families, "draft", draft_model=str(families["qwen3"][checkpoint]), spec_type="draft")
    assert engine.pool.ensure(req, req.num_tokens + 2 * K)  # (as the engine does first: room for its lookahead)
    first = engine.speculator.device_round_drafts(req, lengths[0])
    out, accepted, dr = rounds_of(engine, req, first, lengths)
    committed = req.prompt_ids + req.output_ids + out
    if checkpoint == "target":
        assert accepted == [min(k, before) for k, before in zip(lengths, lengths[:1] + lengths)]
    drafter, n = engine.drafter, len(committed)
    assert int(dr.first.item()) == n - 1
    meta, positions = build_metadata([(req.block_ids, 0, n)], engine.pool.block_size, torch.device("cpu"))
    learned = [layer.view(-1, *layer.shape[2:])[meta.slot_mapping].clone() for layer in drafter.kv.k + drafter.kv.v]
    drafter.model(torch.tensor(committed), positions, drafter.kv, meta, drafter.backend)
    again = [layer.view(-1, *layer.shape[2:])[meta.slot_mapping] for layer in drafter.kv.k + drafter.kv.v]
    for a, b in zip(learned, again):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    draft = LLM(families["qwen3"][checkpoint], dtype="float32", spec_type="none")
    want = draft.generate([committed], SamplingParams(max_tokens=dr.k, temperature=0.0, ignore_eos=True))[0].token_ids
    assert dr.ids[1:].tolist() == want


# --- served: the engine runs device rounds for a request that decodes alone (spec_device_round) ---------------

def served(families, kind: str, **kwargs) -> LLM:
    arch, model, engine_kwargs, _ = SETUPS[kind]
    return LLM(families[arch][model], dtype="float32", spec_draft_n_max=K, block_size=4, spec_device_round=True,
               overlap_schedule=True, spec_measured_costs=False, **engine_kwargs(families[arch]), **kwargs)


@pytest.fixture
def replays(monkeypatch):
    """Device rounds run, by the request they ran for (the engine's round owner at each replay)."""
    seen: list[int] = []
    replay = DeviceRound.replay
    monkeypatch.setattr(DeviceRound, "replay", lambda self: seen.append(self.k) or replay(self))
    return seen


def test_a_lone_greedy_request_runs_device_rounds_and_gives_plain_output(families, kind, plain, replays):
    llm = served(families, kind)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == plain[:TOKENS]
    assert replays and set(replays) <= set(range(1, K + 1))
    t = out.timing
    # (the family's EAGLE-3 head drafts the bonus token again, which the target never keeps: acceptance varies)
    assert t.predicted_n == TOKENS and t.draft_rounds >= len(replays) and 0 <= t.draft_n_accepted <= t.draft_n
    assert t.draft_kind == SETUPS[kind][3]


def test_device_rounds_give_way_to_a_second_request_and_resume(families, replays):
    """Rounds while one request decodes alone; engine steps while two run; rounds again once one has finished.
    Both outputs are plain greedy decoding's."""
    llm = served(families, "dflash", max_num_seqs=4)
    engine = llm.engine
    greedy = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    ref = LLM(families["qwen3"]["target"], dtype="float32", spec_type="none")
    other = [7, 100, 200, 300, 5]
    want = [o.token_ids for o in ref.generate([PROMPT, other], [greedy, SamplingParams(max_tokens=8, temperature=0.0,
                                                                                       ignore_eos=True)])]
    got = {0: [], 1: []}
    first = Request(list(PROMPT), greedy)
    engine.add_request(first, lambda o: got[0].extend(o.new_token_ids))
    for _ in range(4):
        before = len(replays)
        engine.step()
        if len(replays) > before:  # (a committed round leaves the request as a verify step does: all computed but
            assert first.num_pending == 0 and first.num_computed == first.num_tokens - 1  # the last token)
            assert engine.round_flight is not None  # (and the round just launched runs while the host commits)
    alone = len(replays)
    second = Request(list(other), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.add_request(second, lambda o: got[1].extend(o.new_token_ids))
    while second.status is not Status.FINISHED:
        engine.step()
    together = len(replays)
    while engine.has_work():
        engine.step()
    assert alone > 0 and together == alone and len(replays) > together
    assert [got[0], got[1]] == want


def test_a_lone_requests_rounds_shorten_near_its_limit_and_none_runs_past_it(families, kind, plain, replays):
    """k follows the policy, which caps it by the tokens left: near max_tokens the rounds shorten, taking over from
    the longer ones on the device (no drafting anew), and where the round in flight may reach the limit, the next
    waits for its verdict: every round replayed is committed, none runs after the request has ended."""
    llm = served(families, kind)
    engine = llm.engine
    policy, speculator = engine.policy, engine.speculator
    policy.draft_lengths = lambda requests, drafter, in_flight=None, explore=True: [policy._cap(r, K) for r in requests]
    starts, device_round_drafts = [], speculator.device_round_drafts
    speculator.device_round_drafts = lambda req, k: starts.append(k) or device_round_drafts(req, k)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == plain[:TOKENS]
    assert starts == [K] and replays[0] == K and set(replays) <= set(range(1, K + 1))
    assert len(replays) == out.timing.draft_rounds and not engine.has_work()


def test_device_rounds_change_length_on_the_device_and_still_give_plain_output(families, kind, plain, replays):
    """The policy's k changes from round to round: the rounds start once and each new length takes over on the
    device. Output is plain greedy decoding's; a round longer than the one before verifies only that one's drafts,
    and the request's draft count says so."""
    llm = served(families, kind)
    engine = llm.engine
    policy, speculator = engine.policy, engine.speculator
    wanted = itertools.cycle([K, 1, 2, K, K, 1])
    policy.draft_lengths = lambda requests, drafter, in_flight=None, explore=True: [
        min(next(wanted), policy._cap(r, K)) for r in requests]
    starts, device_round_drafts = [], speculator.device_round_drafts
    speculator.device_round_drafts = lambda req, k: starts.append(k) or device_round_drafts(req, k)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == plain[:TOKENS]
    assert starts == [K] and len(set(replays)) == K and len(replays) == out.timing.draft_rounds
    assert out.timing.draft_n == sum(min(k, before) for k, before in zip(replays, replays[:1] + replays))


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=12, temperature=0.7, seed=1, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.0, n_probs=2, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.0, repeat_penalty=1.3, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.0, logit_bias=((100, -5.0),), ignore_eos=True),
], ids=["sampled", "logprobs", "penalty", "bias"])
def test_requests_whose_next_token_is_not_the_plain_argmax_run_no_device_round(families, params, replays):
    served(families, "dflash").generate([PROMPT], params)
    assert replays == []


@pytest.mark.parametrize("trim", [dict(spec_p_min=1e-6), dict(spec_n_min=2)], ids=["p_min", "n_min"])
def test_a_request_that_trims_its_drafts_runs_host_rounds_that_honour_it(families, kind, plain, trim, replays):
    """A device round verifies all k drafts: a request with a confidence stop or a minimum draft length drafts in
    host rounds, which apply them, and still decodes what plain greedy decoding does."""
    llm = served(families, kind)
    trims, trim_calls = llm.engine.policy.trim, []
    llm.engine.policy.trim = lambda requests, proposals: trim_calls.append(len(requests)) or trims(requests, proposals)
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, **trim)
    out = llm.generate([PROMPT], params)[0]
    assert replays == [] and trim_calls and out.timing.draft_rounds > 0
    assert out.token_ids == plain[:TOKENS]


def test_a_stop_inside_a_device_round_ends_the_request_where_plain_decoding_does(families, replays):
    """A stop token committed by one round ends the request there (rounds start once min_tokens is behind, the stop
    comes in the first of them); the round launched meanwhile is dropped."""
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, stop_token_ids=(300,), min_tokens=8, ignore_eos=True)
    want = LLM(families["qwen3"]["target"], dtype="float32", spec_type="none").generate([PROMPT], params)[0]
    llm = served(families, "dflash")
    out = llm.generate([PROMPT], params)[0]
    assert out.token_ids == want.token_ids and len(want.token_ids) < TOKENS
    assert out.finish_reason == want.finish_reason and out.timing.draft_rounds > 0
    assert replays and llm.engine.round_flight is None and not llm.engine.has_work()


def test_an_abort_with_a_round_in_flight_leaves_the_engine_serving(families, replays):
    llm = served(families, "dflash")
    engine = llm.engine
    req = Request(list(PROMPT), SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True))
    engine.add_request(req, lambda out: None)
    while engine.round_flight is None:
        engine.step()
    engine.abort(req.request_id)
    while engine.has_work():
        engine.step()
    greedy = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    want = LLM(families["qwen3"]["target"], dtype="float32", spec_type="none").generate([PROMPT], greedy)[0]
    assert replays and llm.generate([PROMPT], greedy)[0].token_ids == want.token_ids


@pytest.mark.parametrize("alpha", [0.0, 1.0, 0.6])
def test_controlled_acceptance_substitutes_inside_device_rounds(families, kind, plain, alpha, replays):
    """bench spec --acceptance with device rounds: the captured round replaces the real drafter's drafts on the
    device from the recording (RoundScript), keeping each round's drawn count: all of them at alpha 1, none at 0,
    both kinds of round at 0.6; the output is the recording."""
    from outrider.bench.controlled import ControlledDrafter, RoundScript
    from outrider.bench.profile import patched

    llm = served(families, kind)
    engine = llm.engine
    script = RoundScript(len(PROMPT) + TOKENS + 2 * K + 2, TOKENS + 1, engine.device)
    ctl = ControlledDrafter(engine.drafter, alpha, engine.model_config.vocab_size, seed=0, rounds=script)
    req = Request(list(PROMPT), SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True))
    ctl.expect(req.request_id, PROMPT + plain[:TOKENS], stream=0)
    with patched((engine.speculator, "drafter", lambda _: ctl), (engine, "device_rounds",
                                                                 lambda _: engine.device_rounds_for(ctl))):
        engine.add_request(req, lambda out: None)
        while engine.has_work():
            engine.step()
    assert req.output_ids == plain[:TOKENS] and replays
    t = req.timing
    accepted = t.draft_n_accepted
    assert t.draft_rounds > 0
    if alpha == 1.0:
        assert accepted >= t.draft_n - K  # (all, but a round the token limit cut short)
    elif alpha == 0.0:
        assert accepted == 0
    else:
        assert 0 < accepted < t.draft_n
