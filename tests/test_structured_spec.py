"""Constrained decoding with speculation: for each demo drafter kind at batch 4 (greedy and sampled rows),
every constrained reply validates and the counters add up (accepted drafts per output, per request and per
engine). That the distribution stays the constrained target's is test_spec_distribution's chi-square case."""

from __future__ import annotations

import json

import jsonschema
import pytest

from outrider import LLM, SamplingParams
from outrider.demo import demo_path
from outrider.engine.request import Request

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "tags": {"type": "array", "items": {"enum": ["io", "os", "re"]},
                                                    "maxItems": 3},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["name", "tags", "size"]}
DRAFTERS = {"draft": dict(draft_model=str(demo_path("draft"))), "mtp": {},
            "dflash": dict(draft_model=str(demo_path("dflash")))}


@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_constrained_output_validates_with_each_drafter_at_batch_4(kind):
    llm = LLM(demo_path("target"), max_num_seqs=4, **DRAFTERS[kind])
    engine = llm.engine
    assert engine.drafter_kind == kind
    grammar = engine.grammars.json_schema(SCHEMA)
    outputs: dict[int, list] = {}
    requests = []
    for i, temperature in enumerate((0.0, 0.0, 0.8, 0.8)):
        req = Request(engine.tokenizer.encode("def load(path):\n    "),
                      SamplingParams(max_tokens=120, temperature=temperature, seed=i, grammar=grammar))
        outputs[req.request_id] = []
        requests.append(req)
        engine.add_request(req, outputs[req.request_id].append)
    while engine.has_work():
        engine.step()
    drafted = 0
    for req in requests:
        outs = outputs[req.request_id]
        text = "".join(o.text for o in outs)
        jsonschema.validate(json.loads(text), SCHEMA)
        assert outs[-1].stop_type == "eos"
        t = req.timing
        assert t.draft_rounds > 0 and t.draft_kind == kind
        assert 0 <= t.draft_n_accepted <= t.draft_n
        assert sum(o.accepted_drafts for o in outs) == t.draft_n_accepted
        assert t.predicted_n == len(req.output_ids) == sum(len(o.new_token_ids) for o in outs)
        drafted += t.draft_n
    assert engine.stats()["predicted_tokens"] == sum(len(r.output_ids) for r in requests)
    assert drafted > 0
