"""A drafter whose vocabulary does not match the target's is refused when it loads, with a message:

- asked for on the command line (-md / --spec-type), the server refuses to start (status 1, the reason logged);
- otherwise (a drafter the engine found by itself) the engine serves without speculation, logs why, and /props
  shows `speculative.types: "none"` and the reason in `drafter_error`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys

import httpx
import pytest

from e2e_harness import REPO
from outrider.config import EngineConfig
from outrider.models import registry
from outrider.engine.async_engine import AsyncEngine
from outrider.server.app import create_app
from outrider.server.settings import ServerConfig
from outrider.speculative.compat import IncompatibleDrafter
from outrider.speculative.kinds import BY_NAME
from outrider.testing import write_tiny_checkpoint
from outrider.testing.drafters import write_dflash_checkpoint


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("compat")
    target = write_tiny_checkpoint(root / "target", "qwen3", seed=1)
    same = write_tiny_checkpoint(root / "same", "qwen3", layers=1, seed=2)
    small = write_tiny_checkpoint(root / "small", "qwen3", layers=1, seed=2, vocab_size=300, tokenizer=False)
    remapped = write_tiny_checkpoint(root / "remapped", "qwen3", layers=1, seed=2)
    tok = json.loads((remapped / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]  # two ordinary tokens swap ids: same size, other meaning
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (remapped / "tokenizer.json").write_text(json.dumps(tok))
    dflash = write_dflash_checkpoint(root / "dflash", target, layers=1)
    cfg = json.loads((dflash / "config.json").read_text())
    other_dflash = root / "dflash_other"
    other_dflash.mkdir()
    (other_dflash / "config.json").write_text(json.dumps({**cfg, "vocab_size": cfg["vocab_size"] + 64}))
    return {"target": target, "same": same, "small": small, "remapped": remapped, "dflash": dflash,
            "dflash_other": other_dflash, "swapped": (a, b)}


def check(family, kind: str, draft: str) -> None:
    target = family["target"]
    BY_NAME[kind].check_vocabulary(registry.load_config(target), target, family[draft])


def test_matching_drafters_pass(family):
    check(family, "draft", "same")
    check(family, "dflash", "dflash")


def test_a_draft_model_with_another_tokenizer_is_refused(family):
    with pytest.raises(IncompatibleDrafter, match="tokenizer does not match the target's: 2 of") as e:
        check(family, "draft", "remapped")
    assert repr(family["swapped"][0]) in str(e.value)


def test_a_draft_model_too_small_for_the_target_vocabulary_is_refused(family):
    with pytest.raises(IncompatibleDrafter, match="embeds 300 token ids but the target's vocabulary has"):
        check(family, "draft", "small")


def test_a_dflash_drafter_for_another_vocabulary_is_refused(family):
    with pytest.raises(IncompatibleDrafter, match="built for a vocabulary of"):
        check(family, "dflash", "dflash_other")


def test_without_an_explicit_request_the_server_serves_without_speculation(family, caplog):
    engine = AsyncEngine(EngineConfig(model=str(family["target"]), draft_model=str(family["remapped"]),
                                      max_num_seqs=2, max_model_len=256))
    caplog.set_level(logging.ERROR)
    engine.start()
    try:
        assert engine.wait_ready(timeout=120) and engine.drafter_kind is None
        assert "serving without speculative decoding" in caplog.text and "does not match" in caplog.text
        app = create_app(engine, ServerConfig(model_name="tiny"))

        async def run():
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as c:
                return (await c.get("/props")).json(), await c.post("/completion", json={"prompt": [5, 6],
                                                                                         "n_predict": 3,
                                                                                         "ignore_eos": True})

        props, done = asyncio.run(run())
        assert props["default_generation_settings"]["params"]["speculative.types"] == "none"
        assert props["drafter_error"].startswith("IncompatibleDrafter: the draft model's tokenizer does not match")
        assert done.status_code == 200 and done.json()["tokens_predicted"] == 3
    finally:
        engine.shutdown()


def test_asked_for_on_the_command_line_the_server_refuses_to_start(family):
    proc = subprocess.run([sys.executable, "-m", "outrider.cli", "serve", "-m", str(family["target"]), "--port", "0",
                           "-md", str(family["remapped"])], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1
    assert "failed to load the model: IncompatibleDrafter: the draft model" in proc.stderr
