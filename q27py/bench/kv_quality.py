"""KV format quality on a trained model (numpy reference, CPU): tail damage, not just perplexity.

For each model and each long held-out sequence, the reference runs once with bf16 KV (the
baseline) and once per lossy format; per position it compares the next-token loss and the full
distribution:

- dNLL %: mean loss change (what perplexity sees; signed errors cancel in it),
- KL: mean KL(baseline || format) over positions,
- catastrophic: positions the baseline predicts well (loss < 0.1) that the format loses (loss > 1.0),
- top-1 agreement with the baseline's argmax,
- needle: a few key = value facts planted early in a long haystack, asked for at its end;
  retrieved = every digit of the value is the argmax at its position (teacher-forced).

Sequences: the trained models ship no held-out split, so the harness uses long text neither
model was trained on: this repository's own Python source (code) and the shared reference notes
on real agent traffic (clients.md, peers.md: JSON requests, tool schemas, prose). Run:

    python3 tools/kv_quality.py [--tokens 4096] [--needle-tokens 8192] [--json]
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from q27py.model import kvformat as F
from q27py.model.kvbudget import GIB, card_capacity

REPO = Path(__file__).resolve().parents[2]
SHARED = Path("/work/shared")
MODELS = (SHARED / "models" / "q36-tiny-agent", SHARED / "models" / "q36-tiny-code")
LOSSY = ("fp8", "k5v3", "k3v3")
CATASTROPHIC_REF, CATASTROPHIC_Q = 0.1, 1.0


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return (x - np.log(np.exp(x).sum(axis=-1, keepdims=True))).astype(np.float32)


@dataclass
class Compare:
    """Per-position comparison of one format's run against the baseline's."""

    nll_ref: np.ndarray
    nll_q: np.ndarray
    kl: np.ndarray
    agree: np.ndarray

    @property
    def catastrophic(self) -> int:
        return int(np.sum((self.nll_ref < CATASTROPHIC_REF) & (self.nll_q > CATASTROPHIC_Q)))

    def summary(self) -> dict:
        return {
            "positions": int(self.nll_ref.size),
            "nll_ref": float(self.nll_ref.mean()),
            "dnll_pct": float(100 * (self.nll_q.mean() - self.nll_ref.mean()) / self.nll_ref.mean()),
            "kl_mean": float(self.kl.mean()),
            "kl_p999": float(np.quantile(self.kl, 0.999)),
            "catastrophic": self.catastrophic,
            # a graded tail the tiny models populate more densely: loss up by more than 0.5 nats
            "tail_gt_0p5": int(np.sum(self.nll_q - self.nll_ref > 0.5)),
            "top1_agree": float(self.agree.mean()),
            "max_dnll": float(np.max(self.nll_q - self.nll_ref)),
        }


def compare(logp_ref: np.ndarray, logp_q: np.ndarray, targets: np.ndarray) -> Compare:
    """logp_*: [T, V] log-probabilities of the next token at each position; targets [T]."""
    rows = np.arange(targets.size)
    p = np.exp(logp_ref.astype(np.float64))
    kl = np.sum(p * (logp_ref.astype(np.float64) - logp_q.astype(np.float64)), axis=-1)
    return Compare(-logp_ref[rows, targets].astype(np.float64), -logp_q[rows, targets].astype(np.float64),
                   np.maximum(kl, 0.0), logp_ref.argmax(-1) == logp_q.argmax(-1))


def run_logprobs(model, ids: list[int], chunk: int = 1024) -> np.ndarray:
    """Teacher-forced log-probabilities [T, V] of one sequence, prefilled in chunks (as the engine does)."""
    st = model.new_state()
    out = []
    for i in range(0, len(ids), chunk):
        out.append(log_softmax(model.forward(st, ids[i : i + chunk]).logits))
    return np.concatenate(out)


# ------------------------------------------------------------------ corpora


def corpus_texts() -> dict[str, str]:
    code = "\n\n".join(p.read_text(encoding="utf-8") for p in sorted((REPO / "q27py").rglob("*.py")))
    agent = "\n\n".join((SHARED / "reference" / n).read_text(encoding="utf-8") for n in ("clients.md", "peers.md"))
    return {"code": code, "agent": agent}


NEEDLES = [("alpha", "48213"), ("bravo", "90657"), ("delta", "31740"), ("omega", "66182")]


def needle_sequence(tok, filler_ids: list[int], n_tokens: int) -> tuple[list[int], list[tuple[int, list[int]]]]:
    """Facts `KEY_<name> = <value>` planted in the first fifth of a code haystack, then asked for at
    its end; returns (ids, [(position of each value's first digit token, value ids)])."""
    fact = lambda k, v: tok.encode(f"\nKEY_{k.upper()} = {v}\n")  # noqa: E731
    query = [tok.encode(f"\nassert KEY_{k.upper()} == ") for k, _ in NEEDLES]
    values = [tok.encode(v) for _, v in NEEDLES]
    tail = sum(len(q) + len(v) + 1 for q, v in zip(query, values))
    body = list(filler_ids[: n_tokens - tail - sum(len(fact(k, v)) for k, v in NEEDLES)])
    for j, (k, v) in enumerate(NEEDLES):  # depths 2% .. 20%
        at = int(len(body) * (0.02 + 0.06 * j))
        body[at:at] = fact(k, v)
    ids, where = body, []
    nl = tok.encode("\n")
    for q, v in zip(query, values):
        ids = ids + q
        where.append((len(ids), v))
        ids = ids + v + nl
    return ids, where


def needle_hits(logp: np.ndarray, where) -> dict:
    """Value tokens that are the argmax at their position (logp row p predicts token p+1), whole
    values retrieved, and the mean loss of the value tokens. The tiny models copy a 5-digit value
    from thousands of tokens back only partly, so digits and loss grade what a yes/no would not."""
    digits = total = whole = 0
    nll = []
    for pos, v in where:
        ok = [int(logp[pos - 1 + j].argmax()) == t for j, t in enumerate(v)]
        nll += [-float(logp[pos - 1 + j][t]) for j, t in enumerate(v)]
        digits, total, whole = digits + sum(ok), total + len(v), whole + all(ok)
    return {"digits": f"{digits}/{total}", "values": f"{whole}/{len(where)}", "nll": float(np.mean(nll))}


# ------------------------------------------------------------------ capacity


def capacity_table(weight_bytes: int = int(15.5e9), overhead_bytes: int = 2 * GIB) -> dict:
    """27B window (tokens, one sequence) per format on 24 / 32 / 80 / 141 GB cards with q4s weights."""
    gdn = 48 * (48 * 128 * 128 + 3 * 10240) * 4  # GDN state + conv windows of one sequence
    cards = {"24": 24 * GIB, "32": 32 * GIB, "80": 80 * GIB, "141": 141 * 10 ** 9}
    out = {}
    for fmt in F.FORMATS:
        bpt = F.bytes_per_token(fmt, F.Q27B_KV_LAYERS, F.Q27B_KV_HEADS, F.Q27B_HEAD_DIM)
        row = {"bytes_per_token": bpt}
        for name, size in cards.items():
            row[f"tokens_{name}GB"] = card_capacity(size, weight_bytes, fmt, F.Q27B_KV_LAYERS, F.Q27B_KV_HEADS,
                                                    F.Q27B_HEAD_DIM, overhead_bytes=overhead_bytes,
                                                    fixed_per_sequence=gdn)
        out[fmt] = row
    return out


# ------------------------------------------------------------------ V rotation study


def v_rotation_study(model, ids: list[int]) -> dict:
    """Relative MSE of 3-bit V rows with and without the rotation, on the model's own V rows."""
    st = model.new_state()
    model.forward(st, ids)
    rows = np.concatenate([kv.v[: kv.length].reshape(-1, model.cfg.head_dim) for kv in st.kv.values()])
    d = rows.shape[-1]
    err_rot = F.lm_dequantize(*F.lm_quantize(rows, 3), 3, d) - rows
    n = np.linalg.norm(rows, axis=-1, keepdims=True)
    z = rows / np.where(n > 0, n, 1) * np.sqrt(d)
    c = F.CODEBOOKS[3][np.searchsorted(F.codebook_edges(3), z)]
    plain = c / np.linalg.norm(c, axis=-1, keepdims=True) * n
    tot = float(np.sum(rows ** 2))
    kurt = lambda a: float(np.mean(a ** 4) / np.mean(a ** 2) ** 2)  # noqa: E731
    return {"rows": int(rows.shape[0]), "rel_mse_rotated": float(np.sum(err_rot ** 2) / tot),
            "rel_mse_unrotated": float(np.sum((plain - rows) ** 2) / tot),
            "kurtosis_unrotated": kurt(z), "kurtosis_rotated": kurt(F.rotate(rows) / np.where(n > 0, n, 1) * np.sqrt(d))}


# ------------------------------------------------------------------ driver


@dataclass
class Result:
    models: dict = field(default_factory=dict)
    capacity: dict = field(default_factory=dict)
    seconds: float = 0.0


def run(models=MODELS, tokens: int = 4096, needle_tokens: int = 8192, formats=LOSSY, log=print,
        corpora: bool = True) -> dict:
    from q27py.model.reference import ReferenceModel
    from q27py.tokenizer import Tokenizer

    t0 = time.perf_counter()
    texts = corpus_texts()
    result = {"tokens": tokens, "needle_tokens": needle_tokens, "models": {}, "capacity_27b_q4s": capacity_table()}
    for mdir in models:
        mdir = Path(mdir)
        tok = Tokenizer.from_model_dir(mdir)
        seqs = {name: tok.encode(text)[: tokens + 1] for name, text in texts.items()}
        runs = {kv: ReferenceModel.load(mdir, kv=kv) for kv in ("bf16",) + tuple(formats)}
        runs["fp32"] = ReferenceModel.load(mdir)
        mres = {"corpora": {}, "needle": {}}
        for cname, ids in (seqs.items() if corpora else ()):
            x, y = ids[:-1], np.asarray(ids[1:])
            ref = run_logprobs(runs["bf16"], x)
            rows = {}
            for kv in ("fp32",) + tuple(formats):
                t1 = time.perf_counter()
                rows[kv] = compare(ref, run_logprobs(runs[kv], x), y).summary()
                log(f"{mdir.name} {cname} {kv}: {rows[kv]} ({time.perf_counter() - t1:.0f} s)")
            rows["bf16"] = {"positions": int(y.size), "nll_ref": float(compare(ref, ref, y).nll_ref.mean())}
            mres["corpora"][cname] = rows
        if needle_tokens:
            filler = tok.encode(texts["code"])
            ids, where = needle_sequence(tok, filler[tokens:], needle_tokens)  # filler past the scored text
            for kv in ("bf16",) + tuple(formats):
                t1 = time.perf_counter()
                mres["needle"][kv] = needle_hits(run_logprobs(runs[kv], ids), where)
                log(f"{mdir.name} needle at {len(ids)} tokens {kv}: {mres['needle'][kv]} ({time.perf_counter() - t1:.0f} s)")
            mres["needle_context"] = result["needle_context"] = len(ids)
        mres["v_rotation"] = v_rotation_study(runs["fp32"], seqs["agent"][:1024])
        result["models"][mdir.name] = mres
    result["seconds"] = time.perf_counter() - t0
    return result


def markdown(result: dict) -> str:
    """The docs/KV.md tables."""
    lines = [f"| model | corpus | KV | dNLL % | mean KL | KL p99.9 | catastrophic | dloss > 0.5 | top-1 agree | needle @ {result.get('needle_context', '?')} |",
             "|---|---|---|--:|--:|--:|--:|--:|--:|--:|"]
    for mname, m in result["models"].items():
        for cname, rows in m["corpora"].items():
            for kv in ("fp32",) + LOSSY:
                if kv not in rows:
                    continue
                r = rows[kv]
                nd = m.get("needle", {}).get(kv) if cname == "code" else None
                needle = f"{nd['digits']} digits, loss {nd['nll']:.2f}" if nd else ""
                lines.append(f"| {mname} | {cname} ({r['positions']} pos) | {kv} | {r['dnll_pct']:+.3f} | "
                             f"{r['kl_mean']:.2e} | {r['kl_p999']:.2e} | {r['catastrophic']} | {r['tail_gt_0p5']} | {r['top1_agree']:.4f} | {needle} |")
            if cname == "code" and "bf16" in m.get("needle", {}):
                nd = m["needle"]["bf16"]
                lines.append(f"| {mname} | code | bf16 (baseline, mean loss {rows['bf16']['nll_ref']:.3f}) | 0 | 0 | 0 | 0 | 0 | 1 | "
                             f"{nd['digits']} digits, loss {nd['nll']:.2f} |")
    lines += ["", "| KV | bytes/token (27B) | tokens @ 24 GB | @ 32 GB | @ 80 GB | @ 141 GB |", "|---|--:|--:|--:|--:|--:|"]
    for fmt, row in result["capacity_27b_q4s"].items():
        lines.append(f"| {fmt} | {row['bytes_per_token']:,} | {row['tokens_24GB']:,} | {row['tokens_32GB']:,} | "
                     f"{row['tokens_80GB']:,} | {row['tokens_141GB']:,} |")
    return "\n".join(lines)
