"""Observability of a running mesh under load: every named metric on the services'
/metrics (parsed with prometheus_client's parser), the metrics service's cluster view, and
its live dashboard in headless Chromium (skipped when chromium/chromedriver are absent;
.ci/run installs them).

Set PREFIXMESH_DASHBOARD_PNG=path to keep the browser test's screenshot (docs/dashboard.png
is made that way).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefixmesh.services.up import LocalMesh
from prefixmesh.shared.models import DEFAULT_MODEL as MODEL  # what sim workers serve

pytestmark = pytest.mark.timeout(240)

WORKERS = 3
# Load: requests over a few shared prefixes (token-id prompts skip the tokenizer hop, and the
# edge tokenizes short text itself, so one long text request per round keeps the tokenizer
# service's metrics alive).
PREFIXES = 4
PREFIX_TOKENS = 512
SUFFIX_TOKENS = 32
# Longer than the edge tokenizes itself (EdgeConfig.local_tokenize_chars): the service does.
LONG_TEXT = "a long text prompt goes through the tokenizer service. " * 40
REQUESTS_PER_ROUND = 48
CONCURRENCY = 8
HTTP_TIMEOUT_S = 60.0
# Seconds to wait for the bus-fed views (load reports every 0.25 s, stats every 1 s).
SETTLE_S = 20.0

E2_KINDS = {"exploit", "explore", "pd_balance", "rebalance", "replicate"}

# Metric samples that must appear on some service's /metrics, by service.
REQUIRED: dict[str, set[str]] = {
    "edge": {
        "prefixmesh_edge_requests_total", "prefixmesh_edge_errors_total",
        "prefixmesh_edge_request_latency_seconds_bucket", "prefixmesh_edge_ttft_seconds_bucket",
        "prefixmesh_edge_tokens_total", "prefixmesh_edge_front_requests_total",
        "prefixmesh_edge_front_handoffs_total",
    },
    "tokenizer": {
        "prefixmesh_tokenizer_requests_total",
        "prefixmesh_tokenizer_request_latency_seconds_bucket",
    },
    "scheduler": {
        "prefixmesh_scheduler_decisions_total", "prefixmesh_scheduler_errors_total",
        "prefixmesh_scheduler_decision_latency_seconds_bucket",
        "prefixmesh_scheduler_tree_nodes", "prefixmesh_scheduler_tree_tokens",
        "prefixmesh_scheduler_kv_event_lag_seconds_bucket", "prefixmesh_scheduler_kv_gaps_total",
        "prefixmesh_scheduler_replicas_total", "prefixmesh_scheduler_workers",
    },
    "worker": {
        "prefixmesh_worker_requests_total", "prefixmesh_worker_step_seconds_bucket",
        "prefixmesh_worker_request_latency_seconds_bucket", "prefixmesh_worker_steps_total",
    },
    "metrics": {
        "prefixmesh_worker_running_requests", "prefixmesh_worker_waiting_requests",
        "prefixmesh_worker_kv_usage_ratio", "prefixmesh_worker_cache_hit_ratio",
        "prefixmesh_worker_decode_share_ratio", "prefixmesh_worker_avg_step_seconds",
        "prefixmesh_cluster_requests_completed_total",
        "prefixmesh_cluster_request_latency_seconds_bucket",
    },
}


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as resp:
        return json.loads(resp.read())


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as resp:
        return resp.read()


def cluster(mesh: LocalMesh) -> dict:
    return json.loads(_get(mesh.metrics_url + "/cluster"))


def load_round(mesh: LocalMesh, seed: int, requests: int = REQUESTS_PER_ROUND) -> int:
    """Send ``requests`` completions over shared prefixes (half streamed); returns how many
    succeeded."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, 40_000) for _ in range(PREFIX_TOKENS)]
                for _ in range(PREFIXES)]
    url = mesh.url + "/v1/completions"

    def one(i: int) -> bool:
        prompt = prefixes[i % PREFIXES] + [rng.randrange(100, 40_000)
                                            for _ in range(SUFFIX_TOKENS)]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "ignore_eos": True,
                "stream": i % 2 == 1}
        if i % 2:
            with urllib.request.urlopen(urllib.request.Request(
                    url, data=json.dumps(body).encode(),
                    headers={"Content-Type": "application/json"}), timeout=HTTP_TIMEOUT_S) as r:
                return b"[DONE]" in r.read()
        return _post(url, body)["usage"]["completion_tokens"] == 8

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        ok = sum(pool.map(one, range(requests)))
    _post(url, {"model": MODEL, "prompt": LONG_TEXT, "max_tokens": 4})
    return ok


def wait_for(what: str, check, timeout: float = SETTLE_S):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def mesh_config() -> dict:
    return {"workers": WORKERS}


@pytest.fixture(scope="module", autouse=True)
def initial_load(mesh: LocalMesh) -> None:
    """The load every test here observes, sent once before the first of them."""
    assert load_round(mesh, seed=1) == REQUESTS_PER_ROUND
    assert bad_request(mesh) == 400  # errors are part of the load


def bad_request(mesh: LocalMesh) -> int:
    req = urllib.request.Request(mesh.url + "/v1/completions", data=b"{not json",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S)
    exc.value.close()
    return exc.value.code


def families(url: str) -> list:
    """The metric families of one /metrics page (parsed, so the format is checked too)."""
    return list(text_string_to_metric_families(_get(url).decode()))


def scrape(url: str) -> dict[str, list]:
    """Sample name -> samples of one /metrics page."""
    samples: dict[str, list] = {}
    for family in families(url):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s)
    return samples


def decisions(mesh: LocalMesh) -> Counter[str]:
    """The schedulers' routing decisions so far, by kind."""
    out: Counter[str] = Counter()
    for name, url in mesh.scrape_urls().items():
        if name.split("-")[0] == "scheduler":
            for s in scrape(url).get("prefixmesh_scheduler_decisions_total", []):
                out[s.labels["kind"]] += int(s.value)
    return out


def test_every_named_metric_is_exported_under_load(mesh: LocalMesh) -> None:
    urls = mesh.scrape_urls()
    by_service: dict[str, dict[str, list]] = {}
    for name, url in urls.items():
        service = name.split("-")[0]
        for k, v in scrape(url).items():
            by_service.setdefault(service, {}).setdefault(k, []).extend(v)
    for service, names in REQUIRED.items():
        missing = names - set(by_service.get(service, {}))
        assert not missing, f"{service} does not export {sorted(missing)}"
    # Prometheus conventions: one prefix for everything of ours (the client library's own
    # process_ and python_ families aside), counters end in _total.
    for name, url in urls.items():
        for family in families(url):
            if family.name.startswith(("process_", "python_")):
                continue
            assert family.name.startswith("prefixmesh_"), (name, family.name)
            if family.type == "counter":
                assert all(s.name.endswith(("_total", "_created")) for s in family.samples), (
                    name, family.name)
    sched = by_service["scheduler"]
    kinds = {s.labels["kind"] for s in sched["prefixmesh_scheduler_decisions_total"]}
    assert kinds <= E2_KINDS | {"affinity", "none"}, kinds
    # Every request routed is one decision, counted at once; shared prefixes are exploited.
    before = decisions(mesh)
    front_before = _front_counts(mesh)
    assert load_round(mesh, seed=3) == REQUESTS_PER_ROUND
    after = decisions(mesh)
    assert after.total() - before.total() == REQUESTS_PER_ROUND + 1  # + the text prompt
    assert after["exploit"] > before["exploit"], (before, after)
    # The edge's lean front answered every request not streamed (each on a connection of
    # its own, + the text prompt); each streamed one, and each scrape, went to aiohttp.
    answered, handoffs = (a - b for a, b in zip(_front_counts(mesh), front_before))
    assert answered == REQUESTS_PER_ROUND // 2 + 1
    assert handoffs >= REQUESTS_PER_ROUND // 2
    edge = by_service["edge"]
    tenants = {s.labels["tenant"] for s in edge["prefixmesh_edge_ttft_seconds_bucket"]}
    assert tenants == {"default"}
    gauges = by_service["metrics"]["prefixmesh_worker_kv_usage_ratio"]
    assert {s.labels["worker"] for s in gauges} == {f"w{i}" for i in range(WORKERS)}


def _front_counts(mesh: LocalMesh) -> tuple[float, float]:
    """The edge's requests answered by its lean front, and connections handed to aiohttp."""
    page = scrape(mesh.url + "/metrics")
    return (page["prefixmesh_edge_front_requests_total"][0].value,
            page["prefixmesh_edge_front_handoffs_total"][0].value)


def test_edge_counts_errors(mesh: LocalMesh) -> None:
    before = sum(s.value for s in scrape(mesh.url + "/metrics")["prefixmesh_edge_errors_total"])
    assert bad_request(mesh) == 400
    errors = scrape(mesh.url + "/metrics")["prefixmesh_edge_errors_total"]
    assert any(s.labels["status"] == "400" and s.value >= 1 for s in errors)
    assert sum(s.value for s in errors) == before + 1


def test_cluster_view_shows_workers_decisions_and_hot_prefixes(mesh: LocalMesh) -> None:
    def ready() -> dict | None:
        view = cluster(mesh)
        s = view["scheduler"]
        # Summaries come every second: wait for one taken after the fixture's load.
        fresh = s and sum(s["decisions"].values()) >= REQUESTS_PER_ROUND
        return view if fresh and s["hot_prefixes"] and len(view["history"]) >= 2 else None

    view = wait_for("a scheduler summary of the load, with hot prefixes", ready)
    assert [w["worker_id"] for w in view["workers"]] == [f"w{i}" for i in range(WORKERS)]
    assert view["completed_total"] >= REQUESTS_PER_ROUND
    assert sum(w["completed"] for w in view["workers"]) == view["completed_total"]
    s = view["scheduler"]
    assert s["policy"] == "e2" and s["tree_nodes"] > 0 and s["workers"] == WORKERS
    assert sum(s["decisions"].values()) >= REQUESTS_PER_ROUND
    assert set(s["decisions"]) <= E2_KINDS | {"affinity", "none"}
    top = s["hot_prefixes"][0]
    # The shared prefixes are the hottest: PREFIX_TOKENS long (whole blocks), cached somewhere.
    assert top["tokens"] == PREFIX_TOKENS
    assert top["requests"] >= 2
    assert set(top["workers"]) <= {f"w{i}" for i in range(WORKERS)} and top["workers"]
    assert view["recent"]["cache_hit_ratio"] > 0.5
    assert view["recent"]["latency_p99_s"] >= view["recent"]["latency_p50_s"] > 0


# ------------------------------------------------------------------------------------------
# The dashboard in headless Chromium
# ------------------------------------------------------------------------------------------

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run", "--window-size=1400,1100")
BROWSER_WAIT_S = 30.0


def _browser_binaries() -> tuple[str, str]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("headless browser test needs chromium and chromedriver "
                    "(apt-get install chromium chromium-driver; .ci/run does)")
    return chromium, driver


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    chromium, driver = _browser_binaries()
    from selenium import webdriver  # the [test] extra
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    drv = webdriver.Chrome(service=Service(executable_path=driver), options=options)
    try:
        yield drv
    finally:
        drv.quit()


def _text(drv, css: str) -> str:
    from selenium.webdriver.common.by import By

    return drv.find_element(By.CSS_SELECTOR, css).text


def _page_wait(drv, what: str, check, timeout: float = BROWSER_WAIT_S):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(drv, timeout, poll_frequency=0.2).until(
        lambda d: check(d), message=f"dashboard: {what}")


def test_dashboard_shows_every_worker_and_updates_under_load(mesh: LocalMesh, browser,
                                                             tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    drv = browser
    drv.get(mesh.metrics_url + "/")
    assert "prefixmesh" in drv.title
    _page_wait(drv, "first update", lambda d: d.find_element(By.TAG_NAME, "body")
               .get_attribute("data-updates"))
    rows = _page_wait(drv, "a row per worker", lambda d: d.find_elements(
        By.CSS_SELECTOR, "#workers tbody tr[data-worker]") if len(d.find_elements(
            By.CSS_SELECTOR, "#workers tbody tr[data-worker]")) == WORKERS else None)
    assert sorted(r.get_attribute("data-worker") for r in rows) == [f"w{i}"
                                                                    for i in range(WORKERS)]
    before = int(_text(drv, "#completed-total"))
    per_worker = {w: int(_text(drv, f'#workers tr[data-worker="{w}"] td.completed'))
                  for w in (f"w{i}" for i in range(WORKERS))}
    assert load_round(mesh, seed=2) == REQUESTS_PER_ROUND
    _page_wait(drv, "completed count grows", lambda d: int(_text(d, "#completed-total"))
               >= before + REQUESTS_PER_ROUND)
    after = {w: int(_text(drv, f'#workers tr[data-worker="{w}"] td.completed'))
             for w in per_worker}
    assert sum(after.values()) - sum(per_worker.values()) >= REQUESTS_PER_ROUND
    # Decision mix, hot prefixes (with where they are cached) and the charts are drawn.
    _page_wait(drv, "decision mix", lambda d: d.find_elements(
        By.CSS_SELECTOR, "#decisions .decision[data-kind]"))
    _page_wait(drv, "hot prefixes", lambda d: d.find_elements(
        By.CSS_SELECTOR, "#prefixes tbody tr[data-prefix]"))
    cached_on = _text(drv, "#prefixes tbody tr td.cached-on")
    assert any(f"w{i}" in cached_on for i in range(WORKERS))
    _page_wait(drv, "latency chart", lambda d: int(d.find_element(
        By.ID, "latency-chart").get_attribute("data-points") or 0) >= 2)
    assert drv.find_elements(By.CSS_SELECTOR, "#latency-chart polyline")
    assert not drv.find_elements(By.CSS_SELECTOR, "#status.bad")
    shot = Path(os.environ.get("PREFIXMESH_DASHBOARD_PNG") or tmp_path / "dashboard.png")
    assert drv.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
