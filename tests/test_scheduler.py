"""Property test of the scheduler's slot choice: a request that names a slot (llama-server `id_slot`) runs in that
slot and waits while it is busy, without holding back requests behind it that can run elsewhere."""

from hypothesis import given, settings
from hypothesis import strategies as st

from outrider.engine.kv_cache import BlockPool
from outrider.engine.request import Request
from outrider.engine.scheduler import Scheduler
from outrider.params import SamplingParams

SLOTS = 3

# Each event: a new request (asking for a slot, or -1 for any), or the end of the running request at an index.
events = st.lists(st.one_of(st.tuples(st.just("add"), st.integers(-1, SLOTS - 1)),
                            st.tuples(st.just("finish"), st.integers(0, SLOTS - 1))), max_size=40)


@settings(max_examples=200, deadline=None)
@given(events=events)
def test_requests_run_in_the_slot_they_ask_for(events):
    scheduler = Scheduler(BlockPool(64, block_size=4), SLOTS, max_num_batched_tokens=1000, max_model_len=64)
    for kind, value in events:
        if kind == "add":
            scheduler.add(Request([1, 2, 3], SamplingParams(), slot_wanted=value))
        elif value < len(scheduler.running):
            scheduler.remove(scheduler.running[value])
        before = list(scheduler.waiting)
        plan = scheduler.schedule()
        admitted = [s.request for s in plan.scheduled if s.request in before]
        running = scheduler.running
        assert sorted(r.id_slot for r in running) == sorted({r.id_slot for r in running})  # one request a slot
        assert all(r.id_slot == r.slot_wanted for r in running if r.slot_wanted >= 0)
        assert sorted([*scheduler.free_slots, *(r.id_slot for r in running)]) == list(range(SLOTS))
        # Work-conserving: nothing left waiting could have taken a free slot.
        assert all(r.slot_wanted not in scheduler.free_slots for r in scheduler.waiting if r.slot_wanted >= 0)
        assert not scheduler.free_slots or all(r.slot_wanted >= 0 for r in scheduler.waiting)
        # First come, first served among requests that could take the same slot.
        assert [r for r in before if r in admitted] == admitted
        for r in running:  # (the prompts are computed: the next schedule decodes them)
            r.num_computed = r.num_tokens


def test_the_running_list_is_replaced_whenever_a_request_joins_or_leaves_it():
    """The Speculator's dormant path tells the batch is unchanged by the identity of Scheduler.running: a step that
    admits or preempts a request, and a request's end, give a new list; a step that only decodes keeps it."""
    scheduler = Scheduler(BlockPool(4, block_size=4), 2, max_num_batched_tokens=1000, max_model_len=64)
    a, b = Request([1, 2, 3], SamplingParams()), Request([4, 5, 6], SamplingParams())
    lists = [scheduler.running]

    def step() -> None:
        plan = scheduler.schedule()
        for s in plan.scheduled:  # (each request computes what it fed and samples its next token)
            s.request.num_computed += s.num_new_tokens
            s.request.output_ids.append(7)
        lists.append(scheduler.running)

    scheduler.add(a)
    scheduler.add(b)
    step()  # admits both, a block each (of the pool's three)
    step()  # decodes within those blocks
    step()  # a takes the last block; b finds none and is preempted
    scheduler.remove(a)
    lists.append(scheduler.running)
    assert b.num_preemptions == 1 and scheduler.running == []
    assert [new is not old for old, new in zip(lists, lists[1:])] == [True, False, True, True]


@settings(max_examples=150, deadline=None)
@given(prompts=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 6)), min_size=1, max_size=6),
       budget=st.integers(1, 12), blocks=st.integers(6, 16))
def test_a_step_said_to_feed_no_prompt_positions_feeds_none(prompts, budget, blocks):
    """StepPlan.prompt_rows False lets the prompt log-prob and pooling hooks skip a step unread, so it must hold
    whenever no row starts inside its prompt: under chunked prompts, prefix-free admission and preemption (a small
    pool), with outputs appended as steps commit."""
    scheduler = Scheduler(BlockPool(blocks, block_size=4), 3, max_num_batched_tokens=budget, max_model_len=64)
    wants = {}
    for i, (length, outputs) in enumerate(prompts):
        req = Request(list(range(1, length + 1)), SamplingParams())
        wants[req.request_id] = outputs
        scheduler.add(req)
    for _ in range(200):
        if not scheduler.running and not scheduler.waiting:
            break
        plan = scheduler.schedule()
        in_prompt = any(s.start < s.request.num_prompt for s in plan.scheduled)
        assert plan.prompt_rows or not in_prompt
        for s in plan.scheduled:
            s.request.num_computed += s.num_new_tokens
            if s.samples:
                s.request.output_ids.append(7)
                if len(s.request.output_ids) >= wants[s.request.request_id]:
                    scheduler.remove(s.request)


def test_decode_steps_are_said_to_feed_no_prompt_positions():
    scheduler = Scheduler(BlockPool(8, block_size=4), 2, max_num_batched_tokens=2, max_model_len=64)
    req = Request([1, 2, 3], SamplingParams())
    scheduler.add(req)
    said = []
    for _ in range(4):  # two prompt chunks (2 + 1 tokens, the second samples), then two decodes
        plan = scheduler.schedule()
        said.append(plan.prompt_rows)
        for s in plan.scheduled:
            s.request.num_computed += s.num_new_tokens
            if s.samples:
                s.request.output_ids.append(7)
    assert said == [True, True, False, False]
