"""The built-in page in a real browser: headless Chromium (Debian's package) driven by Selenium against
`outrider serve` on the bundled demo model.

- the page loads, polls its status strip and chats with no request leaving the host;
- sending a message streams the reply into the page, and the conversation survives a reload;
- the stop button aborts the request, and /slots shows every slot idle again long before the reply could end;
- the figures under a reply are the final frame's `timings`, and the token view marks exactly `draft_n_accepted`
  tokens as accepted drafts;
- with --api-key the page loads, asks for the key, refuses a wrong one and works with the right one; the status
  strip degrades when /slots and /metrics are off;
- with --no-webui the browser gets a 404 at /.

Skipped only where Chromium or its driver is not installed, never in CI (.ci/run installs them).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time

import httpx
import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from e2e_harness import ServerProcess, sse_events
from outrider import demo

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
KEY = "webui-test-key"
REPLY_TIMEOUT = 120


@pytest.fixture(scope="module")
def driver():
    if not (CHROMIUM and CHROMEDRIVER):
        if os.environ.get("CI"):
            pytest.fail("CI must run the browser tests: .ci/run installs chromium and chromium-driver")
        pytest.skip("chromium and chromedriver are not installed (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1000,760",
                "--no-first-run", "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--disable-default-apps"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})  # the DevTools network events
    # An explicit driver path: Selenium would otherwise try to download one.
    browser = webdriver.Chrome(options=options, service=webdriver.ChromeService(CHROMEDRIVER))
    yield browser
    browser.quit()


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(["--demo-draft", "mtp", "-np", "4", "-c", "2048", "--metrics"])
    yield srv
    srv.stop()


class Page:
    """The page at `url`, opened with empty local storage."""

    def __init__(self, driver, url: str):
        self.driver, self.url = driver, url
        driver.get(url + "/")
        driver.execute_script("localStorage.clear()")
        driver.get_log("performance")  # from here on, the log holds only this page's requests
        driver.get(url + "/")

    def el(self, css: str):
        return self.driver.find_element(By.CSS_SELECTOR, css)

    def all(self, css: str) -> list:
        return self.driver.find_elements(By.CSS_SELECTOR, css)

    def wait(self, condition, timeout: float = 30):
        return WebDriverWait(self.driver, timeout, poll_frequency=0.05).until(lambda _: condition())

    def status(self, name: str) -> str:
        return self.el(f"#status-{name}").text

    def set_setting(self, field_id: str, value: str) -> None:
        settings = self.el("#settings")
        if not settings.get_attribute("open"):
            self.el("#settings summary").click()
        field = self.el("#" + field_id)
        field.clear()
        field.send_keys(value)

    def send(self, text: str) -> None:
        self.el("#input").send_keys(text)
        self.el("#send").click()
        self.wait(lambda: self.el("#stop").is_displayed())

    def replying(self) -> bool:
        return self.el("#stop").is_displayed()

    def wait_reply(self) -> None:
        self.wait(lambda: not self.replying(), REPLY_TIMEOUT)

    def reply(self):
        return self.all(".msg.assistant")[-1]

    def reply_text(self) -> str:
        """The last reply's text, read in one go (the page replaces a reply's element as it streams)."""
        return self.driver.execute_script("const r = [...document.querySelectorAll('.msg.assistant')].pop();"
                                          "return r.querySelector('.text').textContent")

    def stat(self, name: str) -> list[str]:
        """The texts of the last reply's `name` stats, read again where the page replaced the reply's element
        meanwhile (it does as a reply finishes)."""
        def read(_):
            return ([e.text for e in self.reply().find_elements(By.CSS_SELECTOR, f'[data-stat="{name}"]')],)

        return WebDriverWait(self.driver, 10, poll_frequency=0.05,
                             ignored_exceptions=(StaleElementReferenceException,)).until(read)[0]

    def requests(self) -> list[dict]:
        """The network requests the page made since it opened (DevTools' Network.requestWillBeSent)."""
        messages = [json.loads(e["message"])["message"] for e in self.driver.get_log("performance")]
        return [m["params"] for m in messages if m["method"] == "Network.requestWillBeSent"]

    def chat_events(self) -> list:
        """The SSE events of the last /v1/chat/completions response, as the browser received them."""
        chats = [r for r in self.requests() if r["request"]["url"].endswith("/v1/chat/completions")]
        body = self.driver.execute_cdp_cmd("Network.getResponseBody", {"requestId": chats[-1]["requestId"]})
        return sse_events(body["body"].splitlines())


def test_page_loads_and_chats_with_no_request_leaving_the_host(driver, server):
    page = Page(driver, server.url)
    page.wait(lambda: page.status("model") == "model: " + demo.SERVED_NAME)
    page.wait(lambda: page.status("drafter").startswith("drafter: mtp"))
    page.wait(lambda: page.status("slots") == "slots: 0 busy, 4 idle")
    page.set_setting("max-tokens", "16")
    page.send("def add(a, b):")
    page.wait_reply()
    # /metrics sampled before and after the reply: its tokens show in the last minute's rate
    page.wait(lambda: (m := re.fullmatch(r"tokens/s \(1 min\): (\d+\.\d)", page.status("rate"))) and float(m[1]) > 0,
              10)
    origin = server.url + "/"
    urls = [r["request"]["url"] for r in page.requests()]
    assert {origin, origin + "webui/app.js", origin + "webui/style.css", origin + "props", origin + "slots",
            origin + "metrics", origin + "v1/chat/completions"} <= set(urls)
    assert all(u.startswith(origin) or u.startswith("data:") for u in urls), urls
    # and what the page itself saw loading
    loaded = driver.execute_script("return performance.getEntries().filter(e => e.name.includes(':'))"
                                   ".map(e => e.name)")
    assert loaded and all(u.startswith(origin) or u.startswith("data:") for u in loaded), loaded


def test_sending_a_message_streams_the_reply_and_the_conversation_survives_a_reload(driver, server):
    page = Page(driver, server.url)
    page.set_setting("max-tokens", "96")
    page.send("def merge_sorted(a, b):")
    lengths = set()
    while page.replying():
        lengths.add(len(page.reply_text()))
    text = page.reply_text()
    assert len({n for n in lengths if 0 < n < len(text)}) >= 3, lengths  # it grew while the reply streamed
    assert text == "".join(e["choices"][0]["delta"].get("content") or ""
                           for e in page.chat_events()[:-1] if e["choices"])
    driver.refresh()
    page.wait(lambda: len(page.all(".msg")) == 2)
    assert page.all(".msg.user")[0].text == "def merge_sorted(a, b):"
    assert page.reply_text() == text


def test_stop_button_aborts_the_request_and_frees_the_slot(driver, server):
    page = Page(driver, server.url)
    page.set_setting("temperature", "0")  # greedy: the demo model runs on to the token limit
    page.set_setting("max-tokens", "1500")
    page.send("def parse_args(argv):")
    with httpx.Client(base_url=server.url, timeout=30) as client:
        page.wait(lambda: page.reply_text())
        assert any(s["is_processing"] for s in client.get("/slots").json())
        started = time.monotonic()
        page.el("#stop").click()
        page.wait(lambda: not page.replying(), 5)
        assert "stopped" in page.reply().text
        page.wait(lambda: not any(s["is_processing"] for s in client.get("/slots").json()), 10)
        # 1500 tokens take far longer than this: the server cancelled the request, it did not run to the end
        assert time.monotonic() - started < 10
    page.wait(lambda: page.status("slots") == "slots: 0 busy, 4 idle", 10)


@pytest.fixture(scope="module")
def finished_reply(driver, server):
    """A sampled reply with the mtp drafter, finished: (the page, the final chunk with `timings`, every chunk
    with draft provenance)."""
    page = Page(driver, server.url)
    page.set_setting("max-tokens", "64")
    page.send("def fibonacci(n):")
    page.wait_reply()
    events = page.chat_events()
    assert events[-1] == "[DONE]"
    final = events[-2]
    tokens = [e for e in events[:-1] if e["choices"] and "draft_provenance" in e["choices"][0]]
    return page, final, tokens


def test_figures_under_a_reply_are_the_final_frames_timings(finished_reply):
    page, final, _ = finished_reply
    t = final["timings"]
    for name in ("prompt_n", "predicted_n", "draft_n", "draft_n_accepted"):
        assert page.stat(name) == [str(t[name])], name
    shown = {name: [float(v) for v in page.stat(name)] for name in ("prompt_ms", "predicted_ms",
                                                                     "predicted_per_second")}
    assert len(shown["prompt_ms"]) == 2  # in the prompt line and beside the browser's TTFT
    for name, values in shown.items():
        assert all(abs(v - t[name]) <= 0.05 + 1e-9 for v in values), (name, values, t[name])
    assert page.stat("draft_kind") == [final["draft_kind"]] == ["mtp"]
    assert abs(float(page.stat("acceptance")[0]) - 100 * t["draft_n_accepted"] / t["draft_n"]) <= 0.05 + 1e-9
    per_round = (t["draft_n_accepted"] + t["draft_rounds"]) / t["draft_rounds"]
    assert abs(float(page.stat("tokens_per_round")[0]) - per_round) <= 0.005 + 1e-9
    # the browser's TTFT spans the request, the prompt's processing and the first chunk's way back
    assert float(page.stat("browser_ttft_ms")[0]) >= t["prompt_ms"] - 1


def test_token_view_marks_as_accepted_drafts_exactly_the_tokens_the_server_counted(finished_reply):
    page, final, chunks = finished_reply
    t = final["timings"]
    page.el("#token-view").click()
    page.wait(lambda: page.reply().find_elements(By.CSS_SELECTOR, ".tok"))
    assert page.el("#legend").is_displayed()
    drafts = page.reply().find_elements(By.CSS_SELECTOR, ".tok.draft")
    own = page.reply().find_elements(By.CSS_SELECTOR, ".tok.own")
    assert len(drafts) == t["draft_n_accepted"] > 0
    assert len(drafts) + len(own) == t["predicted_n"]
    entries = [x for c in chunks for x in c["choices"][0]["draft_provenance"]]
    shown = page.driver.execute_script(
        "return [...arguments[0].querySelectorAll('.tok')].map(s => [s.textContent, s.classList.contains('draft')])",
        page.reply())
    assert shown == [[e["text"], e["accepted_draft"]] for e in entries]
    page.el("#token-view").click()  # back to plain text
    page.wait(lambda: not page.reply().find_elements(By.CSS_SELECTOR, ".tok"))


@pytest.fixture(scope="module")
def keyed_server():
    srv = ServerProcess(["--demo-draft", "none", "-np", "2", "-c", "1024", "--api-key", KEY, "--no-slots"])
    yield srv
    srv.stop()


def test_api_key_flow(driver, keyed_server):
    page = Page(driver, keyed_server.url)  # the page itself needs no key
    page.wait(lambda: page.el("#key-dialog").is_displayed())
    page.wait(lambda: page.status("model") == "model: API key needed")
    page.el("#key-input").send_keys("wrong-key")
    page.el("#key-submit").click()
    page.wait(lambda: page.el("#key-error").is_displayed())  # refused: asked again
    assert page.el("#key-dialog").is_displayed()
    page.el("#key-input").send_keys(KEY)
    page.el("#key-submit").click()
    page.wait(lambda: page.status("model") == "model: " + demo.SERVED_NAME)
    assert not page.el("#key-dialog").is_displayed()
    # /slots and /metrics are off here: the strip says what it cannot know
    page.wait(lambda: "/slots is off" in page.status("slots"))
    assert page.status("drafter") == "drafter: none"
    assert re.fullmatch(r"tokens/s \(1 min, this tab\): \d+\.\d", page.status("rate"))
    page.set_setting("max-tokens", "8")
    page.send("import os")
    page.wait_reply()
    assert page.stat("predicted_n") == ["8"] and not page.stat("draft_n")
    sent = [r["request"] for r in page.requests() if r["request"]["url"].endswith("/v1/chat/completions")]
    assert sent[-1]["headers"].get("Authorization") == f"Bearer {KEY}"


def test_no_webui_answers_404_at_root(driver):
    srv = ServerProcess(["--demo-draft", "none", "-np", "1", "-c", "256", "--no-webui"])
    try:
        driver.get(srv.url + "/")
        body = json.loads(driver.find_element(By.TAG_NAME, "body").text)
        assert body["error"]["code"] == 404 and body["error"]["type"] == "not_found_error"
        assert not driver.find_elements(By.ID, "messages")
        assert httpx.get(srv.url + "/health").status_code == 200  # the server itself is up
    finally:
        srv.stop()
