"""A hybrid target (Qwen3.5, Qwen3-Next) that ships its own MTP head speculates with it with no flag, as
llama-server's draft-mtp does: greedy output stays the target's (batch 1 and 8), and over `outrider serve` the
response `timings` and the /metrics `llamacpp:spec_decode_*` counters report the head's drafts and acceptance."""

from __future__ import annotations

import json
import re
import shutil

import httpx
import pytest

from e2e_harness import ServerProcess
from outrider.models import registry
from outrider.llm import LLM
from outrider.params import SamplingParams
from spec_helpers import write_hybrid_family
from test_models_hybrid_engine import SPEC_PROMPTS


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def family(request, tmp_path_factory):
    return write_hybrid_family(tmp_path_factory.mktemp("mtp_family"), request.param)


@pytest.mark.parametrize("batch", [1, 8])
def test_the_targets_own_mtp_head_drafts_with_no_flag_and_greedy_output_is_the_targets(family, batch):
    prompts = SPEC_PROMPTS[:batch]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = LLM(str(family["target"]), max_num_seqs=batch).generate(prompts, params)
    spec = LLM(str(family["mtp"]), max_num_seqs=batch, spec_draft_n_max=3)  # no kind, no draft model: detected
    outs = spec.generate(prompts, params)
    assert spec.engine.speculation is not None and spec.engine.speculation.drafter.kind == "mtp"
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    drafted = sum(o.timing.draft_n for o in outs)
    accepted = sum(o.timing.draft_n_accepted for o in outs)
    assert 0 < accepted < drafted, "the head should be accepted part of the time"


def _scrape(client: httpx.Client) -> dict[str, float]:
    text = client.get("/metrics").text
    return {m[0]: float(m[1]) for m in re.findall(r"^([a-z_:]+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def test_outrider_serve_reports_the_mtp_heads_drafts_and_acceptance(family):
    with ServerProcess(["-m", str(family["mtp"]), "-np", "2", "-c", "256", "--metrics",
                        "--spec-draft-n-max", "3"]) as srv, httpx.Client(base_url=srv.url, timeout=120) as client:
        before = _scrape(client)
        timings = []
        for prompt in SPEC_PROMPTS[:4]:
            r = client.post("/completion", json={"prompt": prompt, "n_predict": 24, "temperature": 0,
                                                 "ignore_eos": True})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body.get("draft_kind") == "mtp", body
            timings.append(body["timings"])
        after = _scrape(client)
    assert all(t["draft_rounds"] > 0 and 0 <= t["draft_n_accepted"] <= t["draft_n"] <= 3 * t["draft_rounds"]
               for t in timings), timings
    assert sum(t["draft_n_accepted"] for t in timings) > 0

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("llamacpp:spec_decode_num_draft_tokens_total") == sum(t["draft_n"] for t in timings)
    assert delta("llamacpp:spec_decode_num_accepted_tokens_total") == sum(t["draft_n_accepted"] for t in timings)
    assert delta("llamacpp:spec_decode_num_drafts_total") == sum(t["draft_rounds"] for t in timings)


def test_a_head_shipped_with_no_config_key_is_detected_from_its_tensors(family, tmp_path):
    """Qwen3-Next's release ships mtp.* with no mtp_num_hidden_layers / num_nextn_predict_layers in config.json: the
    tensors announce the head, and the engine drafts with it with no flag."""
    path = tmp_path / "no_key"
    shutil.copytree(family["mtp"], path)
    config = json.loads((path / "config.json").read_text())
    del config["mtp_num_hidden_layers"]
    (path / "config.json").write_text(json.dumps(config))
    assert registry.load_config(path).mtp_num_hidden_layers == 0
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm = LLM(str(path), max_num_seqs=2, spec_draft_n_max=3)
    outs = llm.generate(SPEC_PROMPTS[:2], params)
    assert llm.engine.speculation is not None and llm.engine.speculation.drafter.kind == "mtp"
    assert sum(o.timing.draft_n for o in outs) > 0
    plain = LLM(str(family["target"]), max_num_seqs=2).generate(SPEC_PROMPTS[:2], params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
