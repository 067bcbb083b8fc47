"""End to end: `outrider serve` with no model serves the bundled demo family under the name `outrider-demo`."""

from __future__ import annotations

import httpx
import openai
import pytest

from e2e_harness import ServerProcess
from outrider import demo

pytestmark = pytest.mark.skipif(not demo.is_available(), reason="demo artifacts not installed")


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(["-c", "512", "-np", "1"])  # no -m: the demo target, with its default drafter
    yield srv
    srv.stop()


def test_the_demo_is_named_outrider_demo_in_props_models_and_responses(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        props = client.get("/props").json()
        assert props["model_alias"] == demo.SERVED_NAME == "outrider-demo"
        assert props["model_path"] == str(demo.demo_path("target"))
        for path in ("/models", "/v1/models"):
            body = client.get(path).json()
            (model,) = body["data"]
            assert model["id"] == "outrider-demo" and model["aliases"] == []
            assert body["models"][0]["name"] == "outrider-demo"
        native = client.post("/completion", json={"prompt": "def fibonacci(n):", "n_predict": 4,
                                                   "ignore_eos": True}).json()
        assert native["model"] == "outrider-demo" and native["tokens_predicted"] == 4
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    chat = oai.chat.completions.create(model="anything", max_tokens=4,
                                       messages=[{"role": "user", "content": "Write a Python function."}])
    assert chat.model == "outrider-demo"
    text = oai.completions.create(model="outrider-demo", prompt="def fibonacci(n):", max_tokens=4)
    assert text.model == "outrider-demo" and text.choices[0].text
