"""Token maps (--spec-token-map): drafts through the target's LM head read only the mapped rows, propose only mapped
tokens and stay lossless; maps that cannot be right, and kinds that draft over their own vocabulary, are refused."""

from __future__ import annotations

import json
import types

import pytest
import torch

from outrider import LLM, SamplingParams, cli
from outrider.config import EngineConfig
from outrider.layers.linear import Linear
from outrider.quant.tensor import quantize_fp8
from outrider.quant.layers import QuantizedLinear
from outrider.quant.weight import QuantizedWeight
from outrider.speculative.drafter import TargetView
from outrider.speculative.kinds import load_drafter
from outrider.speculative.token_map import read_token_map
from spec_helpers import write_hybrid_family


def _write(tmp_path, name: str, ids) -> str:
    path = tmp_path / name
    if name.endswith(".pt"):
        torch.save(ids, path)
    else:
        path.write_text(json.dumps(ids))
    return str(path)


def test_a_token_map_reads_from_json_or_a_saved_tensor(tmp_path):
    assert read_token_map(_write(tmp_path, "m.json", [5, 0, 9]), 10).tolist() == [5, 0, 9]
    ids = read_token_map(_write(tmp_path, "m.pt", torch.tensor([3, 1], dtype=torch.int32)), 10)
    assert ids.dtype == torch.int64 and ids.tolist() == [3, 1]


@pytest.mark.parametrize("content, reason", [
    ([], "empty"), ([1, 1], "twice"), ([0, 10], r"\[0, 10\)"), ([-1], r"\[0, 10\)"), ([[1, 2]], "flat"),
    ([1.5], "flat"), ("not json", "JSON list"),
])
def test_a_token_map_that_cannot_be_right_is_refused_with_the_reason(tmp_path, content, reason):
    path = tmp_path / "m.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ValueError, match=reason):
        read_token_map(path, 10)


def _model_with_head(head) -> types.SimpleNamespace:
    inner = types.SimpleNamespace(norm=lambda h: h, rotary_emb=torch.nn.Identity())
    return types.SimpleNamespace(embed=lambda t: t, model=inner, lm_head=head)


@pytest.mark.parametrize("quantized", [False, True])
def test_the_cut_head_gives_the_full_heads_logits_at_the_mapped_columns(quantized):
    torch.manual_seed(0)
    w = torch.randn(256, 128)
    if quantized:  # (rows of a quantized head are dequantized once)
        head = QuantizedLinear(QuantizedWeight([quantize_fp8(w)], torch.float32))
    else:
        head = Linear(128, 256, bias=False)
        head.weight.data.copy_(w)
    ids = torch.tensor([7, 0, 255, 21])
    full, cut = TargetView.of(_model_with_head(head)), TargetView.of(_model_with_head(head), ids)
    y = torch.randn(3, 128)
    torch.testing.assert_close(cut.lm_head(y), full.lm_head(y)[:, ids])
    assert cut.tokens(torch.tensor([2, 0, 3])).tolist() == [255, 7, 21]
    assert full.tokens(torch.tensor([2, 0])).tolist() == [2, 0]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return write_hybrid_family(tmp_path_factory.mktemp("token_map_family"), "qwen3_5")


PROMPTS = [[1, 17, 99, 200, 7], [1] + list(range(30, 50)), [42, 43], [9] * 7, [300, 100, 200, 5],
           list(range(60, 64)), [1, 300, 301, 302], [5, 6, 7, 8, 9]]


def _speculating(family, kind: str, **kwargs) -> LLM:
    if kind == "mtp":
        return LLM(str(family["mtp"]), **kwargs)
    return LLM(str(family["target"]), draft_model=str(family[kind]), **kwargs)


@pytest.mark.parametrize("kind", ["mtp", "dflash"])
def test_drafts_propose_only_mapped_tokens_and_the_output_stays_plain(family, kind, tmp_path):
    """A map holding every token the target chose lets drafts be accepted; one holding none of them leaves every
    draft rejected. Either way the tokens are plain decoding's (batch 8, overlap on)."""
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    plain = [o.token_ids for o in LLM(str(family["target"]), spec_type="none", max_num_seqs=8)
             .generate(PROMPTS, params)]
    chosen = {t for out in plain for t in out}
    vocab = json.loads((family["target"] / "config.json").read_text())["vocab_size"]
    accepted = {}
    for name, ids in (("with", sorted(chosen) + [t for t in range(vocab) if t not in chosen][:50]),
                      ("without", [t for t in range(vocab) if t not in chosen])):
        llm = _speculating(family, kind, max_num_seqs=8, spec_draft_n_max=3, overlap_schedule=True,
                           spec_token_map=_write(tmp_path, f"{name}.json", ids))
        outs = llm.generate(PROMPTS, params)
        assert [o.token_ids for o in outs] == plain
        assert sum(o.timing.draft_n for o in outs) > 0
        accepted[name] = sum(o.timing.draft_n_accepted for o in outs)
    assert accepted["with"] > 0 and accepted["without"] == 0


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_a_token_map_for_a_kind_with_its_own_vocabulary_is_refused(family, kind, tmp_path):
    with pytest.raises(ValueError, match="token map cuts the target's LM head"):
        load_drafter(kind, target=None, target_cfg=None, target_path=str(family["target"]),
                     draft_path=str(family["draft"]), block_size=16, dtype=torch.float32, device="cpu",
                     token_map=_write(tmp_path, "m.json", [1, 2]))


def test_serve_takes_sglangs_token_map_flag(tmp_path):
    path = _write(tmp_path, "m.json", [1, 2])
    for flag in ("--spec-token-map", "--speculative-token-map"):
        ns = cli.parse(cli.SERVE_GROUPS, ["-m", "/models/x", flag, path])
        assert EngineConfig(**cli.engine_kwargs(ns)).spec_token_map == path
