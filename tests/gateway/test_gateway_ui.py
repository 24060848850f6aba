"""The web page at /ui/, in a real headless Chromium, against real gateways, Redis and workers.

One module-scoped stack: a batch-invariant and a default-mode worker on the tiny model, a
gateway with two tenants' keys in front of the first, an open-mode gateway in front of the
second. Screenshots go to $DETGATE_TEST_ARTIFACTS (default: a pytest temporary folder).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import httpx
import orjson
import pytest
import redis

from detgate.gateway.keys import Keys

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
KEYS = "team-a:key-a,team-b:key-b"
WAIT_S = 120  # a replay under load on two CPU cores

# Every way a record's text could turn into markup or script if it were rendered as HTML.
HOSTILE = ['<script>window.__pwned = "script"</script>',
           '<img src=x onerror="window.__pwned = \'img\'">',
           '<a href="javascript:window.__pwned = \'link\'">click me</a>',
           "javascript:window.__pwned='url'"]
# Installed before any page script: counts what must never happen.
WATCH = """
window.__violations = [];
document.addEventListener('securitypolicyviolation',
  (e) => window.__violations.push(e.violatedDirective + ' ' + e.blockedURI));
window.alert = () => { window.__pwned = 'alert'; };
"""


def _browser_or_skip() -> None:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).exists()]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("the selenium package")
    if missing:
        why = f"{', '.join(missing)} missing (.ci/system-deps installs Debian's chromium)"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    configured = os.environ.get("DETGATE_TEST_ARTIFACTS")
    out = Path(configured) if configured else tmp_path_factory.mktemp("ui-artifacts")
    out.mkdir(parents=True, exist_ok=True)
    print(f"web UI screenshots: {out}")
    return out


@pytest.fixture(scope="module")
def browser():
    _browser_or_skip()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="detgate-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--window-size=1400,1000",
                f"--user-data-dir={profile}"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": WATCH})
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def workers(start_workers_module):
    return start_workers_module(["batch_invariant", "default"])


@pytest.fixture(scope="module")
def gw(start_gateway_module, workers):
    """Two tenants, in front of the batch-invariant worker."""
    return start_gateway_module([workers[0].url], api_keys=KEYS)


@pytest.fixture(scope="module")
def open_gw(start_gateway_module, workers):
    """Open mode on loopback, in front of the default-mode worker."""
    return start_gateway_module([workers[1].url])


@pytest.fixture(scope="module")
def model(gw):
    return gw.client("key-a").models.list().data[0].id


def chat(gw, key: str, content: str, **kw) -> str:
    answer = gw.client(key).chat.completions.create(
        model=kw.pop("model", "tiny"), messages=[{"role": "user", "content": content}],
        **{"max_tokens": 24, "temperature": 0, **kw})
    return answer.id


def api_record(gw, key: str | None, rid: str) -> dict:
    with gw.http(key) as http:
        r = http.get(f"/v1/requests/{rid}")
    assert r.status_code == 200, r.text
    return r.json()


class Page:
    """The browser on one gateway's /ui/, with the waits and reads the tests need."""

    def __init__(self, driver, base: str, artifacts: Path) -> None:
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support.ui import WebDriverWait

        self.d, self.base, self.artifacts = driver, base, artifacts
        self.By, self.Wait = By, WebDriverWait

    def open(self, fragment: str = "#/") -> None:
        """A fresh load (a bare fragment change would not reload the page); the tab's
        session storage, and so the key, stays."""
        self.d.get("about:blank")
        self.d.get(f"{self.base}/ui/{fragment}")

    def wait(self, css: str, timeout: float = 30):
        By = self.By
        return self.Wait(self.d, timeout).until(lambda d: d.find_element(By.CSS_SELECTOR, css))

    def all(self, css: str) -> list:
        return self.d.find_elements(self.By.CSS_SELECTOR, css)

    def text(self, css: str) -> str:
        return self.wait(css).text

    def click(self, css: str) -> None:
        self.wait(css).click()

    def hover(self, css: str) -> str:
        from selenium.webdriver.common.action_chains import ActionChains

        ActionChains(self.d).move_to_element(self.wait(css)).perform()
        self.Wait(self.d, 10).until(
            lambda d: d.find_element(self.By.ID, "tooltip").is_displayed())
        return self.d.find_element(self.By.ID, "tooltip").text

    def enter_key(self, key: str) -> None:
        field = self.wait("#api-key")
        field.clear()
        field.send_keys(key)
        self.click("#key-form button[type=submit]")

    def replay_now(self, load: int) -> str:
        """Press Replay now; the comparison it shows, as the verdict's text."""
        old = self.d.current_url
        field = self.wait("#replay-load")
        field.clear()
        field.send_keys(str(load))
        self.click("#replay-now")
        self.Wait(self.d, WAIT_S).until(lambda d: d.current_url != old and "/replays/" in
                                        d.current_url and d.find_elements(self.By.ID, "verdict"))
        return self.text("#verdict")

    def shot(self, name: str) -> Path:
        """A full-page screenshot."""
        height = self.d.execute_script("return document.documentElement.scrollHeight")
        self.d.set_window_size(1400, min(max(height, 600) + 20, 5000))
        path = self.artifacts / f"{name}.png"
        self.d.save_screenshot(str(path))
        self.d.set_window_size(1400, 1000)
        return path

    def assert_nothing_ran(self) -> None:
        assert self.d.execute_script("return window.__pwned") is None
        assert self.d.execute_script("return window.__violations") == []
        assert self.all("img, iframe, object, embed") == []
        assert [s.get_attribute("src") for s in self.all("script")] == [
            f"{self.base}/ui/drift.js", f"{self.base}/ui/app.js"]
        for a in self.all("a"):
            assert a.get_attribute("href").startswith(f"{self.base}/ui/#/"), \
                a.get_attribute("href")


@pytest.fixture
def page(browser, gw, artifacts) -> Page:
    browser.delete_all_cookies()
    p = Page(browser, gw.url, artifacts)
    p.open()
    browser.execute_script("sessionStorage.clear()")
    return p


def test_ui_headers_and_routes(gw):
    r = httpx.get(gw.url + "/ui/", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert "require-trusted-types-for 'script'" in csp
    assert r.headers["x-content-type-options"] == "nosniff"
    assert httpx.get(gw.url + "/ui/app.js", timeout=10).headers["content-type"].startswith(
        "text/javascript")
    assert httpx.get(gw.url + "/ui", timeout=10).headers["location"] == "/ui/"
    assert httpx.get(gw.url + "/ui/../v1/models", timeout=10).status_code in (401, 404)
    assert httpx.get(gw.url + "/ui/nothing.js", timeout=10).status_code == 404
    # The page is public, its data is not: the API behind it still wants the key.
    assert httpx.get(gw.url + "/v1/requests", timeout=10).status_code == 401


def test_list_pages_and_filters_through_the_api(gw, model):
    ids = [chat(gw, "key-a", f"page test {i}", max_tokens=2) for i in range(5)]
    with gw.http("key-a") as http:
        first = http.get("/v1/requests", params={"limit": 2}).json()
        assert [r["id"] for r in first["data"]] == ids[:-3:-1] and first["has_more"]
        assert first["first_id"] == ids[-1] and first["last_id"] == ids[-2]
        second = http.get("/v1/requests", params={"limit": 2, "after": first["last_id"]}).json()
        assert [r["id"] for r in second["data"]] == [ids[2], ids[1]]
        assert http.post(f"/replay/{ids[3]}", json={"load": 0}).json()["match"] is True
        matched = http.get("/v1/requests", params={"replay": "match"}).json()["data"]
        assert ids[3] in [r["id"] for r in matched]
        assert all(r["replays"][-1]["match"] for r in matched)
        never = http.get("/v1/requests", params={"replay": "none", "status": "complete"})
        assert ids[3] not in [r["id"] for r in never.json()["data"]]
        for bad in ({"status": "done"}, {"replay": "yes"}, {"after": "chatcmpl-nope"}):
            r = http.get("/v1/requests", params=bad)
            assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(bad))
    with gw.http("key-b") as http:  # another tenant's cursor is no cursor
        assert http.get("/v1/requests", params={"after": ids[0]}).status_code == 400


def test_list_record_and_replay_now_show_an_exact_match(page, gw, model):
    """batch_invariant: a replay under load is the same answer, bit for bit."""
    plain = chat(gw, "key-a", "Tell me about Richard Feynman.")
    rid = chat(gw, "key-a", "What happened in Queens, New York?", logprobs=True,
               top_logprobs=3)
    theirs = chat(gw, "key-b", "team b only")
    rec = api_record(gw, "key-a", rid)

    page.open()
    page.enter_key("key-a")
    page.wait("#records")
    assert "key-a" not in page.d.current_url
    assert page.d.execute_script("return sessionStorage.getItem('detgate.apiKey')") == "key-a"
    listed = [r.get_attribute("data-id") for r in page.all("#records tr.record-row")]
    assert listed[:2] == [rid, plain]  # newest first
    assert theirs not in listed
    row = page.text(f'tr[data-id="{rid}"]')
    assert "chat" in row and "complete" in row and str(rec["usage"]["completion_tokens"]) in row
    page.shot("01-records")

    page.click(f'tr[data-id="{rid}"] a')
    page.wait("#answer .tok")
    assert page.text("#record-id") == rid
    assert "What happened in Queens, New York?" in page.text("#request")
    assert page.text("#param-temperature") == "0"
    assert page.text("#fingerprint") == rec["system_fingerprint"]
    threads = rec["machine"]["torch_threads"]
    assert rec["machine"]["cpu"] in page.text("#machine") and f"{threads} threads" in \
        page.text("#machine")
    choice = rec["choices"][0]
    chips = page.all("#answer .tok")
    assert len(chips) == len(choice["token_ids"])
    tip = page.hover("#tok-0-1")
    assert str(choice["token_ids"][1]) in tip
    # The logprob shown is the stored float: JavaScript's shortest round-trip text of it.
    shown = next(line for line in tip.splitlines() if line.startswith("logprob"))
    assert float(shown.split()[-1]) == choice["logprobs"][1]
    assert "top logprobs" in tip and len(choice["top_logprobs"][1]) == 3
    page.shot("02-record")

    verdict = page.replay_now(load=16)
    assert verdict.startswith("exact match"), (
        f"batch_invariant replay under load differed (kernels?): {verdict}")
    assert page.text("#first-divergence-value") == "none"
    assert page.text("#max-delta") == "0"
    assert page.all("#no-token-divergence") and not page.all("#aligned td.first-divergence")
    assert len(page.all("#delta-chart circle.zero")) == len(choice["token_ids"])
    assert page.all("#delta-chart rect.bar") == []
    assert "16 other requests" in page.text("#load")
    assert f"{threads} threads" in page.text("#replay-machine")
    page.shot("03-comparison-exact-match")

    page.open("#/?replay=match")
    page.wait("#records")
    matched = [r.get_attribute("data-id") for r in page.all("#records tr.record-row")]
    assert rid in matched and plain not in matched
    assert "exact match" in page.text(f'tr[data-id="{rid}"] .last-replay')
    page.open("#/?limit=1")  # paging: older, then back to the newest
    page.wait("#records")
    assert [r.get_attribute("data-id") for r in page.all("tr.record-row")] == [rid]
    page.click("#older")
    page.wait(f'tr[data-id="{plain}"]')
    page.click("#newest")
    page.wait(f'tr[data-id="{rid}"]')
    select = page.wait("#filter-status")
    select.find_element(page.By.CSS_SELECTOR, 'option[value="failed"]').click()
    page.wait("#no-records")
    page.assert_nothing_ran()


def test_negative_control_default_mode_shows_the_divergence(browser, open_gw, artifacts):
    """Invariance off: a replay under load must show a difference, or the test above proves
    nothing. Open mode on loopback: no key asked."""
    page = Page(browser, open_gw.url, artifacts)
    seen = []
    for i in range(4):
        rid = chat(open_gw, "open", f"Story number {i}:", max_tokens=32)
        page.open(f"#/records/{rid}")
        page.wait("#answer .tok")
        assert page.all("#api-key") == []
        verdict = page.replay_now(load=16)
        seen.append(verdict)
        if verdict.startswith("diverged"):
            break
    assert verdict.startswith("diverged"), seen
    if page.all("#aligned td.first-divergence"):
        div = int(page.text("#first-divergence-value"))
        assert page.text("#aligned th.first-divergence").startswith(str(div))
        assert page.text("#cont-original") != page.text("#cont-replay")
        assert page.all("#delta-chart line.divline")
    else:  # the CPU difference usually shows as logprob bits, the same tokens
        assert float(page.text("#max-delta")) > 0
        assert page.all("#delta-chart rect.bar")
        assert page.all("#aligned td.lpdiff")
    cmp = api_record(open_gw, None, rid)["replays"][-1]
    assert cmp["match"] is False
    page.hover("#a-0")
    page.shot("04-comparison-default-mode-diverged")
    page.assert_nothing_ran()


def hostile_record(gw, tenant: str) -> str:
    """A record whose every string is hostile markup, written as the gateway writes records
    (one JSON document per key, indexed, with a replay in its own list)."""
    rid = "chatcmpl-hostile" + os.urandom(4).hex()
    text = " ".join(HOSTILE)
    tokens = HOSTILE + ["\n", " plain"]
    lps = [-0.5, -1.25, -0.125, -3.0, -0.75, -2.5]
    choice = {"index": 0, "text": text, "finish_reason": "stop", "token_ids": [5, 6, 7, 8, 9, 10],
              "logprobs": lps, "tokens": tokens,
              "top_logprobs": [[{"token": h, "logprob": -0.1}] for h in HOSTILE + HOSTILE[:2]]}
    other = {**choice, "token_ids": [5, 6, 70, 80, 90, 100], "tokens": list(reversed(tokens)),
             "logprobs": [-0.5, -1.2500001, -4.0, -1.0, -2.0, -0.5]}
    record = {"id": rid, "created": 1764500000.123, "endpoint": "/v1/chat/completions",
              "model": HOSTILE[0], "worker": HOSTILE[3], "system_fingerprint": HOSTILE[1],
              "status": "complete", "error": HOSTILE[2],
              "machine": {"cpu": HOSTILE[0], "isa_class": HOSTILE[2], "torch_threads": 2},
              "request": {"model": HOSTILE[0], "temperature": 0, "stop": HOSTILE[3],
                          "messages": [{"role": "user", "content": text},
                                       {"role": "system", "content": [
                                           {"type": "text", "text": HOSTILE[1]}]}]},
              "choices": [choice],
              "usage": {"prompt_tokens": 9, "completion_tokens": 6, "total_tokens": 15}}
    comparison = {"id": rid, "replay_id": "rpl-" + HOSTILE[1], "match": False,
                  "tokens_compared": 6, "first_divergence": 2, "token_agreement": 2 / 6,
                  "logprob_mse": 5e-15, "max_abs_logprob_diff": 1e-7,
                  "original_fingerprint": HOSTILE[1], "replay_fingerprint": HOSTILE[0],
                  "worker": HOSTILE[3], "load": 3, "created": 1764500001.0,
                  "original_machine": {"cpu": HOSTILE[0]}, "replay_machine": {"gpu": HOSTILE[1]},
                  "replay_choices": [other]}
    keys = Keys(gw.prefix)
    client = redis.Redis.from_url(gw.redis_url)
    try:
        client.set(keys.record(tenant, rid), orjson.dumps(record), ex=3600)
        client.zadd(keys.index(tenant), {rid: 1764500000.123 + 10 ** 9})  # listed first
        client.rpush(keys.replays(tenant, rid), orjson.dumps(comparison))
        client.expire(keys.replays(tenant, rid), 3600)
    finally:
        client.close()
    return rid


def test_hostile_strings_render_as_text_and_run_nothing(page, gw, model):
    rid = hostile_record(gw, "team-a")
    through_api = chat(gw, "key-a", " ".join(HOSTILE), max_tokens=4)
    page.open()
    page.enter_key("key-a")
    page.wait("#records")
    assert HOSTILE[1][:14] in page.text(f'tr[data-id="{rid}"]')  # the fingerprint, as text
    page.assert_nothing_ran()

    page.open(f"#/records/{through_api}")
    page.wait("#answer .tok")
    assert " ".join(HOSTILE) in page.text("#request")
    page.assert_nothing_ran()

    page.open(f"#/records/{rid}")
    page.wait("#answer .tok")
    body = page.text("main")
    for h in HOSTILE:
        assert h in body, h
    assert page.text("#fingerprint") == HOSTILE[1]
    assert HOSTILE[0] in page.text("#machine") and HOSTILE[2] in page.text("#machine")
    assert json.dumps(HOSTILE[0]) in page.hover("#tok-0-0")  # JSON-quoted in the card
    page.shot("05-hostile-record")
    page.assert_nothing_ran()

    page.click("tr.replay-row a")
    page.wait("#verdict")
    assert page.text("#verdict").startswith("diverged")
    assert page.text("#first-divergence-value") == "2"
    assert HOSTILE[2] in page.text("#cont-original") and HOSTILE[1] in page.text("#cont-replay")
    assert HOSTILE[0] in page.text("#summary")
    page.shot("06-hostile-comparison")
    page.assert_nothing_ran()


def test_another_tenants_record_is_not_found(page, gw, model):
    theirs = chat(gw, "key-b", "team b's secret")
    with gw.http("key-a") as http:
        assert http.get(f"/v1/requests/{theirs}").status_code == 404
    page.open(f"#/records/{theirs}")
    page.enter_key("key-a")
    assert "not found" in page.text("#not-found").lower()
    assert "team b's secret" not in page.text("main")
    page.open(f"#/records/{theirs}/replays/rpl-x")
    assert "not found" in page.wait("#not-found").text.lower()
    # The owner sees it, and an id made of markup is only text in the message.
    page.d.execute_script("sessionStorage.setItem('detgate.apiKey', 'key-b')")
    page.open(f"#/records/{theirs}")
    assert "team b's secret" in page.text("#request")
    page.open("#/records/" + json.dumps(HOSTILE[1]))
    assert "not found" in page.text("#not-found").lower()
    page.shot("07-not-found")
    page.assert_nothing_ran()
    page.click("#forget-key")  # the key leaves the tab; the API asks for one again
    page.wait("#api-key")
    assert page.d.execute_script("return sessionStorage.getItem('detgate.apiKey')") is None


def test_drift_page_shows_the_last_report(page, gw, model):
    """The tenant's last drift report (here: its records replayed on their own fingerprint,
    so every one reproduces); a tenant without one is told how to make it."""
    rid = chat(gw, "key-a", "drift page")
    fp = api_record(gw, "key-a", rid)["system_fingerprint"]
    with gw.http("key-a") as http:
        r = http.post("/v1/drift", json={"from_fingerprint": fp, "to_fingerprint": fp,
                                         "sample": 3})
    assert r.status_code == 200, r.text
    report = r.json()
    page.open("#/drift")
    page.enter_key("key-a")
    summary = page.text("#drift-summary")
    assert "every record reproduces" in summary and fp in summary
    shares = [c.text for c in page.all("#drift-groups td.share")]
    assert shares[0] == f"100.0% ({report['selected']}/{report['selected']})"
    assert page.all("#drift-records") == []
    page.shot("08-drift")
    page.assert_nothing_ran()
    page.d.execute_script("sessionStorage.setItem('detgate.apiKey', 'key-b')")
    page.open("#/drift")
    assert "No drift report yet" in page.text("#no-drift")
