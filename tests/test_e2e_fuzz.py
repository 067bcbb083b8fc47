"""Fuzzing the real server on loopback: no input makes it answer 5xx or fall over, and a bad body gets a 4xx in
llama-server's error format that names the offending field.

- schemathesis over tests/api_schema.py, an OpenAPI description of every route the app has: bodies that follow
  the schema (positive) and bodies that break it (negative), for every route and method;
- hypothesis-made malformed bodies: bytes that are not JSON, invalid UTF-8, JSON that is not an object, huge
  numbers, deep nesting, 10 MB strings, and a wrong-typed value in each described field (the 400 must name it).

CI runs a bounded number of examples (FUZZ_EXAMPLES, default 8 per route and method); docs/reliability.md has a
longer run's figures.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api_schema import BODIES, N_SLOTS, openapi, undescribed
from e2e_harness import ServerProcess
from outrider.config import EngineConfig
from outrider.engine.async_engine import AsyncEngine
from outrider.server.app import UNSUPPORTED, create_app
from outrider.server.settings import ServerConfig
from outrider.testing import write_tiny_checkpoint

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "8"))
APP = create_app(AsyncEngine(EngineConfig(model="routes-only")), ServerConfig(model_name="m"))  # never started
SCHEMA = schemathesis.openapi.from_dict(openapi(APP), config=schemathesis.Config.from_dict(
    {"generation": {"mode": "all", "max-examples": EXAMPLES}}))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = write_tiny_checkpoint(tmp_path_factory.mktemp("fuzz") / "target", "qwen3", seed=5)
    srv = ServerProcess(["-m", str(ckpt), "-np", str(N_SLOTS), "-c", "256", "-n", "16", "--props", "--metrics",
                         "--max-queue", "64", "--embedding"])
    yield srv
    assert srv.proc.poll() is None, "the server fell over:\n" + "".join(srv.stderr)
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    srv.stop()


UNSUPPORTED_PATHS = {p for paths in UNSUPPORTED for p in paths}


def error_format(ctx, response, case) -> bool | None:
    """A schemathesis check: no 5xx but the 501 of a route we lack, and every error body in the route's format:
    llama-server's {"error": {"code", "message", "type"}} with its status, Anthropic's on /v1/messages."""
    status = response.status_code
    assert status < 500 or status == 501 and case.path in UNSUPPORTED_PATHS, (status, response.content[:300])
    if status < 400:
        return None
    check_error(case.path, status, json.loads(response.content))
    return True


def check_error(path: str, status: int, body: dict) -> dict:
    """The error object of an error body in the route's format."""
    err = body["error"]
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and isinstance(err["message"], str) and err["type"], body
    else:
        assert err["code"] == status and isinstance(err["message"], str) and err["type"], err
    return err


def test_every_route_is_described():
    assert undescribed(APP) == []


@SCHEMA.parametrize()
@FUZZ
def test_schemathesis_every_route(case, server):
    case.call_and_validate(base_url=server.url, checks=[error_format], timeout=120)


def post_raw(server, path: str, content: bytes) -> httpx.Response:
    return httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"}, timeout=120)


def assert_4xx(r: httpx.Response, field: str | None = None) -> None:
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    err = check_error(r.url.path, r.status_code, r.json())
    assert err["type"] == "invalid_request_error", err
    if field is not None:
        assert f"'{field}'" in err["message"], err


JSON_PATHS = sorted(BODIES)
NOT_JSON = st.one_of(
    st.binary(min_size=1).filter(lambda b: not _parses(b)),
    st.sampled_from([b"{", b"[1,", b"{'a': 1}", b"\xff\xfe{}", b'{"prompt": "\xc3\x28"}', b"NaN", b"{\"a\":}"]))


def _parses(raw: bytes) -> bool:
    try:
        json.loads(raw)
        return True
    except ValueError:
        return False


@FUZZ
@given(path=st.sampled_from(JSON_PATHS), raw=NOT_JSON)
def test_bodies_that_are_not_json_are_400(server, path, raw):
    assert_4xx(post_raw(server, path, raw))


@FUZZ
@given(path=st.sampled_from(JSON_PATHS), value=st.one_of(st.integers(), st.text(), st.lists(st.integers()),
                                                         st.booleans(), st.none()))
def test_json_that_is_not_an_object_is_400(server, path, value):
    assert_4xx(post_raw(server, path, json.dumps(value).encode()))


def wrong_for(spec: dict) -> st.SearchStrategy:
    """JSON values of a type the field's schema does not allow."""
    allowed = {s.get("type") for s in spec.get("oneOf", [spec])} - {None}
    if "enum" in spec:
        return st.sampled_from(["on", 3, [1], {"a": 1}]).filter(lambda v: v not in spec["enum"])
    pool = {"string": st.text(max_size=5), "boolean": st.booleans(), "array": st.lists(st.text(max_size=2), max_size=2),
            "object": st.dictionaries(st.text(max_size=3), st.integers(), min_size=1, max_size=2),
            "integer": st.integers(), "number": st.floats(allow_nan=False, allow_infinity=False)}
    if allowed & {"number", "integer"}:
        pool.pop("integer"), pool.pop("number")
    if "number" in allowed:
        pool["integer-ish"] = st.just("1.5")
    if "integer" in allowed:
        pool["fraction"] = st.just(1.5)
    return st.one_of(*(v for k, v in pool.items() if k not in allowed))


FIELDS = [(path, name) for path in ("/completion", "/v1/completions", "/v1/chat/completions", "/tokenize")
          for name in BODIES[path].get("properties", {})]
# (no token limit here: n_predict and max_tokens are aliases, the first present wins; the server's -n caps it)
BASE = {"/completion": {"prompt": "x"}, "/v1/completions": {"prompt": "x"},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}]}, "/tokenize": {"content": "x"}}


@FUZZ
@given(data=st.data())
@pytest.mark.parametrize("path, field", FIELDS)
def test_a_wrong_typed_field_is_a_400_naming_it(server, path, field, data):
    value = data.draw(wrong_for(BODIES[path]["properties"][field]))
    r = httpx.post(server.url + path, json={**BASE[path], field: value}, timeout=120)
    assert_4xx(r, field)


@pytest.mark.parametrize("body, field", [
    ({"prompt": "x", "temperature": 10**400}, "temperature"),  # beyond any float
    ({"prompt": "x", "n_predict": 10**400}, "n_predict"),
    ({"prompt": "x", "top_n_sigma": "big"}, "top_n_sigma"),
    ({"prompt": "x", "logit_bias": {"5": 10**400}}, "logit_bias"),
    ({"prompt": "x", "seed": 2**64}, "seed"),
])
def test_huge_numbers_and_odd_values_are_400_naming_the_field(server, body, field):
    assert_4xx(httpx.post(server.url + "/completion", content=json.dumps(body).encode(), timeout=60), field)


@pytest.mark.parametrize("raw", [b"1e999", b'{"prompt": "x", "temperature": 1e999}', b"[" * 100_000,
                                 b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"])
def test_infinities_and_deep_nesting_are_400(server, raw):
    assert_4xx(post_raw(server, "/completion", raw))


BIG = "y" * 10_000_000


@pytest.mark.parametrize("body, field", [
    ({"prompt": "x", "stop": [BIG]}, None),  # a stop string as long as the body allows: cheap to hold back
    ({"prompt": "x", "response_fields": [BIG]}, None),
    ({"prompt": "x", "user": BIG}, None),  # unknown fields are ignored, whatever their size
    ({"prompt": "x", "grammar": BIG}, "grammar"),
    ({"prompt": "x", "temperature": BIG}, "temperature"),
    ({"prompt": BIG}, "context"),  # refused before tokenizing: no tokenization of it fits the context
])
def test_ten_megabyte_strings_are_handled(server, body, field):
    r = httpx.post(server.url + "/completion", json=body, timeout=300)
    if field == "context":
        assert r.status_code == 400 and r.json()["error"]["type"] == "exceed_context_size_error", r.text[:300]
    elif field is None:
        assert r.status_code in (200, 400), (r.status_code, r.text[:300])
    else:
        assert_4xx(r, field)
