// q27py dashboard: polls /dashboard.json and redraws. No libraries, no external requests.
// Each number's raw value is also kept in its element's data-value, so tests (and scripts)
// can compare the page with /metrics without parsing the formatted text.
"use strict";

const POLL_MS = Number(new URLSearchParams(location.search).get("interval_ms")) || 1000;
const RATE_WINDOW_S = 10; // tokens/s tile: the last few buckets, so it follows bursts

function takeKey() {
  // The fragment never reaches the server (or its log); drop it from the address bar once read.
  const m = location.hash.match(/key=([^&]+)/);
  if (m) {
    sessionStorage.setItem("q27py-key", decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
  return sessionStorage.getItem("q27py-key");
}

function set(id, value, text) {
  const el = document.getElementById(id);
  if (!el) return;
  el.dataset.value = String(value);
  el.textContent = text === undefined ? String(value) : text;
}

const fixed = (x, n) => (x === null || !isFinite(x) ? "-" : x.toFixed(n));
const share = (a, b) => (b > 0 ? a / b : null);
const pct = (x) => (x === null ? "-" : (100 * x).toFixed(1) + "%");

function line(id, values) {
  const el = document.getElementById(id);
  if (!el || !values.length) return;
  const top = Math.max(1e-9, ...values.map((v) => (v === null ? 0 : v)));
  const step = 300 / Math.max(1, values.length - 1);
  el.setAttribute("points", values
    .map((v, i) => `${(i * step).toFixed(1)},${(68 - 66 * ((v || 0) / top)).toFixed(1)}`)
    .join(" "));
}

function render(d) {
  const t = d.totals, g = d.gauges, s = d.series, b = d.bucket_s;
  set("model", d.model);
  set("window", Math.round((s.t.length * b) / 60));
  set("updated", d.time, new Date(d.time * 1000).toLocaleTimeString());

  const recent = Math.max(1, Math.round(RATE_WINDOW_S / b));
  const tokens = s.generated_tokens.slice(-recent).reduce((x, y) => x + y, 0);
  set("tokens_per_s", tokens / (recent * b), fixed(tokens / (recent * b), 1));
  set("generation_tokens", t.generation_tokens);
  set("generations", t.generations);
  line("chart_tokens", s.generated_tokens.map((n) => n / b));

  const ttft = share(t.ttft_sum, t.ttft_count);
  set("ttft_mean", ttft, fixed(ttft, 3));
  set("ttft_count", t.ttft_count);
  set("itl_mean", share(t.itl_sum, t.itl_count), fixed(share(t.itl_sum, t.itl_count), 4));
  set("e2e_mean", share(t.e2e_sum, t.e2e_count), fixed(share(t.e2e_sum, t.e2e_count), 3));
  line("chart_ttft", s.ttft_sum.map((x, i) => share(x, s.ttft_count[i])));

  for (const drafter of ["mtp", "suffix"]) {
    const a = t.spec_accepted[drafter], n = t.spec_drafted[drafter];
    set("accept_" + drafter, share(a, n), pct(share(a, n)));
    set("accepted_" + drafter, a);
    set("drafted_" + drafter, n);
    line("chart_" + drafter, s[drafter + "_accepted"].map((x, i) => share(x, s[drafter + "_drafted"][i])));
  }

  const restored = share(t.prefix_hit_tokens, t.prefix_query_tokens);
  set("cache_token_share", restored, pct(restored));
  set("prefix_hit_tokens", t.prefix_hit_tokens);
  set("prefix_query_tokens", t.prefix_query_tokens);
  set("prefix_hits", t.prefix_hits);
  set("prefix_misses", t.prefix_misses);
  line("chart_cache", s.cached_tokens);
  line("chart_prompt", s.prompt_tokens);

  set("slots_in_use", g.slots_in_use);
  set("slots_total", g.slots_total === null ? "" : g.slots_total, g.slots_total === null ? "-" : String(g.slots_total));
  set("kv_cache_usage", g.kv_cache_usage, pct(g.kv_cache_usage));
  line("chart_slots", s.slots);

  set("running", g.running);
  set("waiting", g.waiting);
  line("chart_running", s.running);
  line("chart_waiting", s.waiting);
}

function status(text, error) {
  const el = document.getElementById("status");
  el.textContent = text;
  el.className = error ? "error" : "dim";
}

let polls = 0;
async function poll() {
  const key = takeKey();
  try {
    const r = await fetch("/dashboard.json", { headers: key ? { Authorization: "Bearer " + key } : {}, cache: "no-store" });
    if (r.status === 401) {
      document.getElementById("login").style.display = "block";
      status("needs the API key", true);
    } else if (!r.ok) {
      status("HTTP " + r.status, true);
    } else {
      render(await r.json());
      polls += 1;
      document.body.dataset.polls = String(polls);
      status("live", false);
    }
  } catch (e) {
    status("server unreachable", true);
  }
  setTimeout(poll, POLL_MS);
}

document.getElementById("login").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem("q27py-key", document.getElementById("key").value);
  document.getElementById("login").style.display = "none";
});

poll();
