"""/infill's prompt is llama-server's documented FIM format, built from the tokenizer's own FIM tokens (here a
Qwen2.5-Coder-style vocabulary); a model without FIM tokens gets a clear 400."""

from __future__ import annotations

import httpx
import pytest
import tokenizers

from e2e_harness import ServerProcess

from outrider.server.infill import infill_ids
from outrider.testing import write_tiny_checkpoint
from outrider.testing.tokenizer import BOS_TOKEN, write_tiny_tokenizer
from outrider.tokenizer import FimTokens, Tokenizer

QWEN_CODER_FIM = ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
                  "<|file_sep|>"]


def tokenizer_with(tmp_path, specials: list[str], add_bos: bool = False) -> Tokenizer:
    write_tiny_tokenizer(tmp_path, add_bos_token=add_bos)
    add_specials(tmp_path, specials)
    return Tokenizer.from_pretrained(tmp_path)


def add_specials(path, specials: list[str]) -> None:
    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens(specials)
    tok.save(str(path / "tokenizer.json"))


@pytest.fixture
def coder(tmp_path):
    return tokenizer_with(tmp_path, QWEN_CODER_FIM)


def test_fim_tokens_come_from_the_vocabulary(coder, tmp_path):
    vocab = coder.vocab()
    assert coder.fim_tokens == FimTokens(vocab["<|fim_prefix|>"], vocab["<|fim_suffix|>"], vocab["<|fim_middle|>"],
                                         vocab["<|repo_name|>"], vocab["<|file_sep|>"])
    write_tiny_tokenizer(tmp_path / "plain")
    assert Tokenizer.from_pretrained(tmp_path / "plain").fim_tokens is None


def test_the_repo_level_prompt_is_llama_servers_documented_format(coder):
    ids = infill_ids(coder, coder.fim_tokens, prefix="def add(a, b):\n", suffix="\n\nprint(add(1, 2))\n",
                     extra=[("util.py", "X = 1\n"), ("main.py", "import util\n")], prompt="    return",
                     n_batch=2048, n_ctx=4096, n_predict=64)
    assert coder.decode(ids) == (
        "<|repo_name|>myproject\n"
        "<|file_sep|>util.py\nX = 1\n"
        "<|file_sep|>main.py\nimport util\n"
        "<|file_sep|>filename\n"
        "<|fim_prefix|>def add(a, b):\n<|fim_suffix|>\n\nprint(add(1, 2))\n<|fim_middle|>    return")


def test_without_repo_tokens_extra_context_is_prefixed_as_snippets(tmp_path):
    tok = tokenizer_with(tmp_path, ["<PRE>", "<SUF>", "<MID>"], add_bos=True)  # CodeLlama's names
    ids = infill_ids(tok, tok.fim_tokens, "a", "b", [("f", "ctx")], "", n_batch=2048, n_ctx=4096, n_predict=-1)
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids[1:]) == "\n\n--- snippet ---\n\nctx<PRE>a<SUF>b<MID>"


def test_fim_text_is_not_read_as_special_tokens_and_long_parts_are_cut(coder):
    fim = coder.fim_tokens
    ids = infill_ids(coder, fim, "<|fim_middle|>", "", [], "", n_batch=2048, n_ctx=4096, n_predict=0)
    assert ids.count(fim.mid) == 1 and ids[-1] == fim.mid
    long = "x " * 400
    ids = infill_ids(coder, fim, long, long, [("f", long)], "", n_batch=64, n_ctx=128, n_predict=16)
    pre, suf, mid = ids.index(fim.pre), ids.index(fim.suf), ids.index(fim.mid)
    assert suf - pre - 1 == 48  # the prefix's last 3/4 of a batch
    assert mid - suf - 1 == 16 - 2  # the suffix's first quarter, less 2 (and the empty prompt)
    assert pre == 128 - 64 - 2 * 16  # the extra context's tail
    assert coder.decode(ids[pre + 1 : suf]) == coder.decode(coder.encode(long, add_special=False)[-48:])


def test_the_infill_route_answers_as_completion_does(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "coder", "qwen3", vocab_size=600, seed=3)
    add_specials(ckpt, QWEN_CODER_FIM)
    with ServerProcess(["-m", str(ckpt), "-c", "256", "-np", "2", "-b", "64"]) as srv:  # (room for the extra context)
        body = {"input_prefix": "def f(", "input_suffix": ")\n", "prompt": "x", "n_predict": 4, "temperature": 0,
                "input_extra": [{"filename": "a.py", "text": "y = 2"}]}
        r = httpx.post(srv.url + "/infill", json=body, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["prompt"].startswith(BOS_TOKEN + "<|repo_name|>myproject\n<|file_sep|>a.py\ny = 2<|file_sep|>"
                                        "filename\n")
        assert out["prompt"].endswith("<|fim_prefix|>def f(<|fim_suffix|>)\n<|fim_middle|>x")
        assert out["tokens_predicted"] == 4 and out["timings"]["predicted_n"] == 4
        same = httpx.post(srv.url + "/completion", timeout=60, json={
            "prompt": httpx.post(srv.url + "/tokenize", json={"content": out["prompt"]}).json()["tokens"],
            "n_predict": 4, "temperature": 0}).json()
        assert same["content"] == out["content"]
        for bad, field in (({**body, "input_prefix": None}, "input_prefix"),
                           ({**body, "input_extra": [1]}, "input_extra[0]"), ({**body, "prompt": 3}, "prompt")):
            r = httpx.post(srv.url + "/infill", json=bad, timeout=60)
            assert r.status_code == 400 and f"'{field}'" in r.json()["error"]["message"], r.text
