"""Embeddings pooled from the prefill equal transformers' pooling of the same tiny checkpoint's last hidden state
(after the final norm) within 1e-4: mean, cls, last and none, in one step and chunked."""

from __future__ import annotations

import pytest
import torch

from outrider import LLM, SamplingParams
from outrider.engine.request import Request
from outrider.testing import write_tiny_checkpoint

transformers = pytest.importorskip("transformers")

PROMPTS = [[(5 * i + 2) % 400 + 5 for i in range(90)], [(13 * i) % 300 + 7 for i in range(11)]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("emb") / "tiny", "qwen3", seed=8)


@pytest.fixture(scope="module")
def hidden(checkpoint):
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf.model(torch.tensor([p])).last_hidden_state[0] for p in PROMPTS]


def pooled(llm: LLM, mode: str) -> list[torch.Tensor]:
    requests = [Request(list(p), SamplingParams(max_tokens=1, temperature=0, pooling=mode)) for p in PROMPTS]
    for r in requests:
        llm.engine.add_request(r, lambda out: None)
    while llm.engine.has_work():
        llm.engine.step()
    return [r.pooled.result() for r in requests]


@pytest.mark.parametrize("budget", [2048, 32], ids=["one-step", "chunked"])
def test_pooled_embeddings_equal_transformers(checkpoint, hidden, budget):
    llm = LLM(str(checkpoint), dtype="float32", max_model_len=256, num_kv_blocks=64, max_num_seqs=2,
              max_num_batched_tokens=budget)
    want = {"mean": [h.mean(0) for h in hidden], "cls": [h[0] for h in hidden], "last": [h[-1] for h in hidden],
            "none": hidden}
    for mode, expected in want.items():
        for got, exp in zip(pooled(llm, mode), expected):
            torch.testing.assert_close(got, exp, atol=1e-4, rtol=0)
    # twice: no cached prefix is reused, so the second pooling sees every row again
    torch.testing.assert_close(pooled(llm, "mean")[0], want["mean"][0], atol=1e-4, rtol=0)


# --- the routes ---
def test_embedding_routes_return_normalised_pooled_embeddings(checkpoint, hidden, tmp_path):
    import base64
    import json
    import shutil

    import httpx
    import numpy as np

    from e2e_harness import ServerProcess

    # a sentence-transformers layout that declares last-token pooling: used when --pooling is not given
    model = shutil.copytree(checkpoint, tmp_path / "st")
    (model / "modules.json").write_text(json.dumps([{"idx": 0, "name": "0", "path": "", "type":
                                                     "sentence_transformers.models.Transformer"},
                                                    {"idx": 1, "name": "1", "path": "1_Pooling", "type":
                                                     "sentence_transformers.models.Pooling"}]))
    (model / "1_Pooling").mkdir()
    (model / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    unit = [torch.nn.functional.normalize(h[-1], dim=0) for h in hidden]
    with ServerProcess(["-m", str(model), "-c", "256", "-np", "2", "--embedding", "--dtype", "float32"]) as srv:
        r = httpx.post(srv.url + "/v1/embeddings", json={"input": PROMPTS, "model": "m"}, timeout=60).json()
        assert [d["index"] for d in r["data"]] == [0, 1] and r["usage"]["prompt_tokens"] == sum(map(len, PROMPTS))
        for d, want in zip(r["data"], unit):
            torch.testing.assert_close(torch.tensor(d["embedding"]), want, atol=1e-4, rtol=0)
        b64 = httpx.post(srv.url + "/v1/embeddings", json={"input": PROMPTS[1], "encoding_format": "base64"},
                         timeout=60).json()["data"][0]["embedding"]
        torch.testing.assert_close(torch.from_numpy(np.frombuffer(base64.b64decode(b64), "<f4").copy()), unit[1],
                                   atol=1e-4, rtol=0)
        native = httpx.post(srv.url + "/embedding", json={"content": PROMPTS[1], "embd_normalize": -1},
                            timeout=60).json()
        torch.testing.assert_close(torch.tensor(native[0]["embedding"][0]), hidden[1][-1], atol=1e-4, rtol=0)
        r = httpx.post(srv.url + "/v1/embeddings", json={"input": [[]]}, timeout=60)
        assert r.status_code == 400 and "input" in r.json()["error"]["message"]
    with ServerProcess(["-m", str(checkpoint), "-c", "256", "-np", "2", "--embedding", "--pooling", "none",
                        "--dtype", "float32"]) as srv:
        rows = httpx.post(srv.url + "/embeddings", json={"input": PROMPTS[1]}, timeout=60).json()[0]["embedding"]
        torch.testing.assert_close(torch.tensor(rows), hidden[1], atol=1e-4, rtol=0)  # unnormalised, per token
        r = httpx.post(srv.url + "/v1/embeddings", json={"input": "hi"}, timeout=60)
        assert r.status_code == 400 and "not OAI compatible" in r.json()["error"]["message"]
    with ServerProcess(["-m", str(checkpoint), "-c", "256", "-np", "2"]) as srv:
        r = httpx.post(srv.url + "/v1/embeddings", json={"input": "hi"}, timeout=60)
        assert r.status_code == 501 and "--embeddings" in r.json()["error"]["message"]


def test_a_gguf_declares_its_pooling(tmp_path):
    import gguf

    from outrider.server.embeddings import model_pooling

    for kind, mode in ((gguf.PoolingType.LAST, "last"), (gguf.PoolingType.CLS, "cls")):
        path = tmp_path / f"{mode}.gguf"
        writer = gguf.GGUFWriter(path, "qwen3")
        writer.add_pooling_type(kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        assert model_pooling(path) == mode
