"""/dashboard in a real headless Chromium, against `q27py serve` with the bundled model.

Chromium is an external test tool (.ci/run: `apt-get install chromium`); without it these tests
skip. Chromium runs the page's own script (--dump-dom after a few seconds of virtual time), so
what is checked is what a person would see: the numbers it drew, in each element's data-value,
compared with the server's /metrics scraped right after.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from promtext import histogram, parse, value

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import fleet as fleet_tool  # noqa: E402

pytestmark = pytest.mark.slow

KEY = "dash-key"


def _chromium() -> str | None:
    for name in (os.environ.get("Q27_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        path = name and shutil.which(name)
        if path:
            return path
    return None


@pytest.fixture(scope="module")
def served():
    env = dict(os.environ, PYTHONPATH=str(fleet_tool.REPO), OMP_NUM_THREADS="1")
    env.pop("Q27_API_KEY", None)
    replica = fleet_tool.Replica(0, ["--max-context", "2048", "--no-think", "--api-key", KEY], env)
    replica.wait_ready(__import__("time").monotonic() + 60)
    yield replica
    replica.stop()


def _browser(tmp_path, *args: str, url: str) -> subprocess.CompletedProcess:
    chromium = _chromium()
    if chromium is None:
        pytest.skip("chromium not installed (.ci/run: apt-get install chromium)")
    profile = tmp_path / "profile"
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--no-first-run", "--disable-extensions", f"--user-data-dir={profile}",
           "--virtual-time-budget=4000", *args, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90)


def _page_values(dom: str) -> dict[str, str]:
    return dict(re.findall(r'id="([a-z_]+)" data-value="([^"]*)"', dom))


def _scrape(replica) -> dict:
    status, text = fleet_tool.request(replica.url + "/metrics", headers={"authorization": f"Bearer {KEY}"})
    assert status == 200
    return parse(text)


def test_dashboard_numbers_move_and_match_metrics(served, tmp_path):
    url = served.url + f"/dashboard#key={KEY}"  # the fragment never reaches the server
    first = _browser(tmp_path, "--dump-dom", url=url)
    assert first.returncode == 0, first.stderr[-2000:]
    assert re.search(r'<body[^>]*data-polls="[1-9]', first.stdout), "the page never polled /dashboard.json"
    v0 = _page_values(first.stdout)
    model = fleet_tool.request(served.url + "/v1/models", headers={"authorization": f"Bearer {KEY}"})[1]["data"][0]["id"]
    assert v0["model"] == model and v0["generations"] == "0"  # whichever model is bundled

    history = [{"role": "system", "content": fleet_tool.session_system(1)}]
    for t in range(3):
        history.append({"role": "user", "content": fleet_tool.session_turn(1, t)})
        status, body = fleet_tool.request(served.url + "/v1/chat/completions",
                                          {"model": model, "max_tokens": 5, "messages": history},
                                          {"authorization": f"Bearer {KEY}"})
        assert status == 200, body
        history.append({"role": "assistant", "content": body["choices"][0]["message"]["content"] or "ok"})

    second = _browser(tmp_path, "--dump-dom", url=url)
    assert second.returncode == 0, second.stderr[-2000:]
    v = _page_values(second.stdout)
    fams = _scrape(served)
    assert int(v["generations"]) == 3 == histogram(fams, "vllm:e2e_request_latency_seconds")["count"]
    assert int(v["generation_tokens"]) == value(fams, "vllm:generation_tokens_total") > int(v0["generation_tokens"])
    assert int(v["ttft_count"]) == histogram(fams, "vllm:time_to_first_token_seconds")["count"]
    ttft = histogram(fams, "vllm:time_to_first_token_seconds")
    assert float(v["ttft_mean"]) == pytest.approx(ttft["sum"] / ttft["count"], rel=1e-6)
    assert int(v["prefix_hit_tokens"]) == value(fams, "vllm:prefix_cache_hits_total") > 0  # turns 2 and 3 reused
    assert int(v["prefix_query_tokens"]) == value(fams, "vllm:prefix_cache_queries_total")
    assert int(v["prefix_hits"]) == value(fams, "q27py_prefix_cache_hits_total") >= 2
    assert int(v["slots_in_use"]) == value(fams, "q27py_slots_in_use") >= 1
    assert int(v["slots_total"]) == value(fams, "q27py_slots_total")
    for drafter in ("mtp", "suffix"):
        assert int(v[f"accepted_{drafter}"]) == value(fams, "q27py_spec_accepted_tokens_total", drafter=drafter)
        assert int(v[f"drafted_{drafter}"]) == value(fams, "q27py_spec_draft_tokens_total", drafter=drafter)
    assert float(v["tokens_per_s"]) > 0  # the last seconds held generated tokens
    assert int(v["running"]) == 0 and int(v["waiting"]) == 0


def test_dashboard_without_the_key_asks_for_it(served, tmp_path):
    result = _browser(tmp_path, "--dump-dom", url=served.url + "/dashboard")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "needs the API key" in result.stdout
    assert _page_values(result.stdout).get("generations", "") == ""  # no data was shown


def test_dashboard_screenshot(served, tmp_path):
    shot = tmp_path / "dashboard.png"
    result = _browser(tmp_path, f"--screenshot={shot}", "--window-size=1280,900", url=served.url + f"/dashboard#key={KEY}")
    assert result.returncode == 0, result.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
