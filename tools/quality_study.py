"""The harness of the CPU quality studies (tools/swiglu_bf16_quality.py, tools/gdn_tf32_quality.py).

A study is a FastCPUModel subclass whose numerics follow a configuration name (by default its
`mode` attribute, set per configuration), a tuple of configuration names (the first is the one the
model is left in between forwards) and (reference, variant) pairs. Every text is prefilled
teacher-forced in chunks of --chunk tokens under every configuration, each with its own sequence
state, and compared chunk by chunk: per pair, mean / p99 / p99.9 / max KL(ref || variant) of the
next-token distribution, greedy top-1 agreement, the text's mean NLL under each and the
difference, and max |logit diff| over the logit scale (max |logit| of the reference run over the
same positions, per text, worst text; as tests/gpu/test_forward.py measures it).

Text (held out: the tiny models ship no held-out split, so as tools/a8_quality.py and
q27py/bench/kv_quality.py do, text neither model was trained on): this repository's own source
(q27py/engine/*.py, a8_quality's text) and the shared reference notes on real agent traffic
(clients.md + peers.md, kv_quality's agent text), --tokens of each.

A study's tool calls `main(model_cls, configs, pairs)`; the CLI (--models, --tokens, --chunk,
--json), the printed tables and the JSON (per model: "all", "code", "agent" summaries and
"seconds"; a summary holds "positions", "nll" per configuration and "<variant>_vs_<reference>"
per pair) are the same for every study.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from q27py import DEFAULT_MODEL_DIR  # noqa: E402

SHARED = next((p for p in (ROOT.parent / "shared", Path("/work/shared")) if p.is_dir()), ROOT.parent / "shared")

Pair = tuple[str, str]  # (reference, variant)


def set_mode(model, config: str) -> None:
    """The default configuration switch: the model's `mode` attribute."""
    model.mode = config


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def texts(tok, n: int) -> dict[str, list[int]]:
    code = "\n".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "q27py" / "engine").glob("*.py")))
    agent = "\n\n".join((SHARED / "reference" / f).read_text(encoding="utf-8") for f in ("clients.md", "peers.md"))
    out = {"code": tok.encode(code)[:n], "agent": tok.encode(agent)[:n]}
    for k, v in out.items():
        assert len(v) == n, f"{k} text has only {len(v)} tokens"
    return out


def run_text(model, ids: list[int], chunk: int, configs: Sequence[str], pairs: Sequence[Pair],
             switch: Callable[[object, str], None] = set_mode) -> dict:
    """Teacher-forced prefill of ids in chunks under every configuration, compared chunk by chunk
    (no [T, V] array of all positions is kept). Returns per-position arrays."""
    states = {c: model.new_state() for c in configs}
    tgt_all = np.asarray(ids[1:])
    acc = {"nll": {c: [] for c in configs}, "top1": {c: [] for c in configs},
           "kl": {pr: [] for pr in pairs}, "dmax": {pr: [] for pr in pairs}, "scale": {c: 0.0 for c in configs}}
    for s in range(0, len(ids) - 1, chunk):
        piece = ids[s:s + chunk]
        tgt = tgt_all[s:s + len(piece)]
        rows = np.arange(len(tgt))
        logits, logp = {}, {}
        for c in configs:
            switch(model, c)
            lg = model.forward(states[c], piece, logits_rows="all").logits.astype(np.float32)[: len(tgt)]
            logits[c], logp[c] = lg, _log_softmax(lg)
            acc["nll"][c].append(-logp[c][rows, tgt])
            acc["top1"][c].append(lg.argmax(-1))
            acc["scale"][c] = max(acc["scale"][c], float(np.abs(lg).max()))
        switch(model, configs[0])
        for r, v in pairs:
            acc["kl"][(r, v)].append(np.maximum((np.exp(logp[r]) * (logp[r] - logp[v])).sum(-1), 0.0))
            acc["dmax"][(r, v)].append(np.abs(logits[r].astype(np.float64) - logits[v]).max(-1))
    cat = lambda d: {k: np.concatenate(x) for k, x in d.items()}  # noqa: E731
    return {"nll": cat(acc["nll"]), "top1": cat(acc["top1"]), "kl": cat(acc["kl"]), "dmax": cat(acc["dmax"]),
            "scale": acc["scale"]}


def summarize(parts: list[dict], configs: Sequence[str], pairs: Sequence[Pair]) -> dict:
    """Pair metrics over the concatenated positions of several texts."""
    nll = {c: np.concatenate([p["nll"][c] for p in parts]) for c in configs}
    top1 = {c: np.concatenate([p["top1"][c] for p in parts]) for c in configs}
    out = {"positions": int(nll[configs[0]].size), "nll": {c: float(nll[c].mean()) for c in configs}}
    for r, v in pairs:
        kl = np.concatenate([p["kl"][(r, v)] for p in parts])
        # logit diff over the reference's logit scale, per text, worst text
        rel = max(float(p["dmax"][(r, v)].max()) / p["scale"][r] for p in parts)
        out[f"{v}_vs_{r}"] = {
            "kl_mean": float(kl.mean()), "kl_p99": float(np.quantile(kl, 0.99)),
            "kl_p999": float(np.quantile(kl, 0.999)), "kl_max": float(kl.max()),
            "top1_agree": float((top1[r] == top1[v]).mean()),
            "dnll_mean": float((nll[v] - nll[r]).mean()), "dnll_abs_mean": float(np.abs(nll[v] - nll[r]).mean()),
            "max_logit_diff_rel": rel,
        }
    return out


def fmt(name: str, s: dict, configs: Sequence[str], pairs: Sequence[Pair]) -> str:
    nll = " ".join(f"{c} {s['nll'][c]:.5f}" for c in configs)
    lines = [f"{name}: {s['positions']} positions, NLL {nll}"]
    for r, v in pairs:
        m = s[f"{v}_vs_{r}"]
        lines.append(f"  {v} vs {r}: KL mean {m['kl_mean']:.2e} p99 {m['kl_p99']:.2e} p99.9 {m['kl_p999']:.2e} "
                     f"max {m['kl_max']:.2e}, top-1 agree {m['top1_agree']:.4f}, dNLL {m['dnll_mean']:+.2e} "
                     f"(|dNLL| {m['dnll_abs_mean']:.2e}), max |dlogit| / scale {m['max_logit_diff_rel']:.2e}")
    return "\n".join(lines)


def main(model_cls, configs: Sequence[str], pairs: Sequence[Pair], argv=None,
         switch: Callable[[object, str], None] = set_mode, description: str | None = None) -> int:
    """The CLI of a study: every model of --models (absent ones skipped), both texts, tables printed
    per model ("all", then per text) and, with --json, written as one object keyed by model name."""
    from q27py.tokenizer import Tokenizer

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--models", nargs="+", default=[str(DEFAULT_MODEL_DIR), str(SHARED / "models" / "q36-tiny-code")])
    ap.add_argument("--tokens", type=int, default=3072, help="tokens of each text (code, agent)")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens per forward)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    results = {}
    t00 = time.perf_counter()
    for md in map(Path, args.models):
        if not md.is_dir():
            print(f"{md}: not present, skipped")
            continue
        t0 = time.perf_counter()
        model = model_cls.load(md)
        tok = Tokenizer.from_model_dir(md)
        per_text = {}
        for tname, ids in texts(tok, args.tokens).items():
            per_text[tname] = run_text(model, ids, args.chunk, configs, pairs, switch)
        res = {"all": summarize(list(per_text.values()), configs, pairs)}
        res.update({k: summarize([v], configs, pairs) for k, v in per_text.items()})
        res["seconds"] = time.perf_counter() - t0
        results[md.name] = res
        for k in ("all", *per_text):
            print(fmt(f"{md.name} [{k}]", res[k], configs, pairs))
        print(f"  ({res['seconds']:.0f} s)", flush=True)
    print(f"total {time.perf_counter() - t00:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0
