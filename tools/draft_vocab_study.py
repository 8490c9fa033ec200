"""Vocabulary-restricted MTP drafting: how much speculative acceptance is lost (CPU, trained tiny models).

Question: on the GPU one MTP draft step streams the whole lm_head (248,320 rows, ~675 MB); drafting
the head's argmax over only V' rows would make that step cheaper. Verification keeps the output
exact, so only acceptance can drop. This tool measures that drop on the trained small models.

Method (nothing in the repo is modified; the engine's own pieces are reused):

1. For every prompt, plain greedy decoding with the model (reference numpy path by default), keeping
   every main-model hidden row; the prompt is prefilled in the engine's chunks and its MTP rows are
   warmed as SpecDecoder warms them. Generation ends after the model's eos ids (as the server runs
   it); --no-stop runs without stop ids, as tools/record_traces.py recorded the traces (then the
   tiny models repeat <|im_end|> after an answer, positions no drafter is ever right about).
2. At every generated position P (pending token x_P), the MTP ladder exactly as MTPLadder.draft runs
   it: step 0 = MTP row (h_{P-1}, x_P); step k feeds the MTP's post-norm output and draft k at
   position P-1+k. Two chains of depth D (default 3 = SpecConfig.max_depth) are run:
     - the full-vocab draft chain (drafts = full argmax), for "does the restricted chain equal the
       full chain";
     - the teacher-forced chain (step k fed the greedy token x_{P+k}). A draft k is accepted only if
       drafts 1..k-1 were, i.e. equal x_{P+1..P+k-1}; then the real chain's inputs ARE the
       teacher-forced ones, so argmax_S(teacher-forced logits) decides acceptance exactly for every
       subset S at once.
   For each subset S, the draft is argmax over logits[S] (numpy tie rule: lowest id).
3. Acceptance per variant: (a) per position, fixed depth D, MTP only: accepted drafts =
   leading matches against the main model's greedy tokens (= what verification picks: greedy
   speculative output is token-identical to plain decoding); (b) rounds of an MTP-only fixed-depth
   ladder (round starts follow acceptance); (c) the engine's default round policy replayed exactly
   (DraftPlanner "agree" arbitration with the real SuffixIndex, the real DepthController, width 8,
   max_tokens), which is what tools/record_traces.py records (tokens/round as DecodeStats counts
   it: the prefill is round one). With --no-stop --backend fast the full-vocabulary replay gives
   the recorded traces' tokens/round (q27py/bench/data/spec_traces*.json) for all 12 of their prompts.
4. --check K: for the first K prompts, the real SpecDecoder is run with model.mtp_forward wrapped
   so its logits outside S are -inf (a wrapper, no repo edit), for a few variants; its round trace
   must equal the replay's of (c), and its output plain decoding's.

Subsets (ids of the model's vocabulary; the tiny models' vocabulary `qwen36-first16384` is the real
Qwen3.6 vocabulary's first 16,384 BPE ranks, with the 33 specials moved from 248,044.. to 16,384..):
  first-V'     ids < V' (literally the first V' lm_head rows; on the real vocabulary this excludes
               the specials, which sit at 248,044..248,076)
  first-V'+sp  ids < V' plus the 33 special ids
  freq-V'+sp   the V' ids ranked first by (count in the model's greedy outputs on the BUILD prompts,
               count in the build prompts' source text, then id), plus the specials. Build prompts
               are disjoint from the evaluated ones (different chat tasks, different scipy files,
               different agent tasks).
On these models V' >= 16,384 contains every regular token, so first-32768 / first-65536 equal
first-16384: the tiny models cannot measure those sizes. --real-vocab adds a text-level proxy for
the real 248K vocabulary: the share of tokens with id >= V' when held-out text (and the tiny
models' own greedy text) is encoded with the real tokenizer, and the same for freq-V' subsets built
from disjoint text. That is a statement about text, not about the 27B model's drafts.

Prompts: the 12 held-out prompts of tools/spec_measure.py (the source of the recorded traces
q27py/bench/data/spec_traces*.json) + held-out ones in the same style written here: chat-framed
function requests, code prefixes cut from scipy sources (held out of the models' training data), and
agent-style tool prompts rendered with the official template.

    OMP_NUM_THREADS=1 python3 tools/draft_vocab_study.py --model ../shared/models/q36-tiny-code \
        [--max-tokens 128] [--depth 3] [--check 4] [--real-vocab] [--no-stop] [--backend fast] [--json out.json]

About 3 minutes per model on a 2-core machine (30 eval + 22 build prompts, 128 tokens).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from q27py import DEFAULT_MODEL_DIR  # noqa: E402
from q27py.config import Q27Config, SpecConfig  # noqa: E402
from q27py.engine.drafters import NONE, MTP, SUFFIX, DepthController, SuffixIndex  # noqa: E402

# ---------------------------------------------------------------------------------------------
# prompts

CHAT = "<|im_start|>user\nWrite a Python function `{}`: {}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"

CHAT_EVAL_EXTRA = [
    ("flatten(nested)", "Flatten an arbitrarily nested list of lists into a single flat list."),
    ("is_palindrome(text)", "Return True if text reads the same backwards, ignoring case and non-letters."),
    ("moving_average(values, window)", "Return the list of moving averages of values over a sliding window."),
    ("group_by_key(records, key)", "Group a list of dicts into a dict of lists by the value of key."),
    ("to_snake_case(name)", "Convert a CamelCase or mixedCase identifier to snake_case."),
    ("read_csv_rows(path)", "Read a CSV file and return its rows as a list of dicts keyed by the header."),
]

CHAT_BUILD = [
    ("fibonacci(n)", "Return the first n Fibonacci numbers as a list."),
    ("unique_sorted(items)", "Return the unique items of a list in sorted order."),
    ("count_lines(path)", "Count the non-empty lines of a text file."),
    ("transpose(matrix)", "Return the transpose of a matrix given as a list of rows."),
    ("retry(func, attempts)", "Call func, retrying up to attempts times when it raises an exception."),
    ("parse_query(url)", "Parse the query string of a URL into a dict of lists."),
    ("topological_sort(graph)", "Sort the nodes of a DAG given as an adjacency dict topologically."),
    ("format_bytes(n)", "Format a byte count as a human readable string like '1.5 MB'."),
]

TOOLS = [
    {"type": "function", "function": {"name": "bash", "description": "Run a shell command and return its output.",
     "parameters": {"type": "object", "properties": {"command": {"type": "string", "description": "the command"},
                    "timeout": {"type": "number"}}, "required": ["command"]}}},
    {"type": "function", "function": {"name": "read_file", "description": "Read a file from the workspace.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "offset": {"type": "integer"},
                    "limit": {"type": "integer"}}, "required": ["path"]}}},
    {"type": "function", "function": {"name": "grep", "description": "Search files for a regular expression.",
     "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}, "path": {"type": "string"}},
                    "required": ["pattern"]}}},
    {"type": "function", "function": {"name": "edit_file", "description": "Replace a string in a file.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "old": {"type": "string"},
                    "new": {"type": "string"}}, "required": ["path", "old", "new"]}}},
]

AGENT_SYSTEM = "You are a coding assistant working in the user's repository. Use the tools to inspect and change files."

# (user request, optional (tool name, arguments, tool result) already done, enable_thinking)
AGENT_EVAL = [
    ("List the Python files under src/ and tell me which one defines the CLI.", None, False),
    ("Run the test suite and summarize any failures.", None, True),
    ("Find where the database connection string is read.", ("grep", {"pattern": "DATABASE_URL"},
     "src/app/settings.py:14:DATABASE_URL = os.environ.get(\"DATABASE_URL\", \"sqlite:///app.db\")"), False),
    ("Rename the function load_cfg to load_config in utils.py.", None, False),
    ("What does the main function in scripts/build.py do?", ("read_file", {"path": "scripts/build.py"},
     "import sys\n\n\ndef main(argv):\n    target = argv[1] if len(argv) > 1 else \"all\"\n    print(f\"building {target}\")\n"
     "    return 0\n\n\nif __name__ == \"__main__\":\n    sys.exit(main(sys.argv))\n"), True),
    ("Check which version of numpy is installed.", None, False),
]

AGENT_BUILD = [
    ("Show me the contents of README.md.", None, False),
    ("Search the code for TODO comments.", None, True),
    ("Add a --verbose flag to the argument parser in cli.py.", ("read_file", {"path": "cli.py"},
     "import argparse\n\n\ndef build_parser():\n    p = argparse.ArgumentParser()\n    p.add_argument(\"input\")\n    return p\n"), False),
    ("How many lines of code are in the lib directory?", None, False),
    ("Fix the failing import in tests/test_models.py.", ("bash", {"command": "python -m pytest tests/test_models.py -x"},
     "E   ModuleNotFoundError: No module named 'app.model'"), True),
    ("Print the git log of the last five commits.", None, False),
]


def _scipy_files() -> list[Path]:
    """Held-out code: scipy sources (the models were trained on Python package sources excluding
    sklearn and scipy). Deterministic pick: non-test modules of 4-60 KB, sorted by path."""
    try:
        import scipy
    except ImportError:
        return []
    base = Path(scipy.__file__).parent
    out = []
    for p in sorted(base.rglob("*.py")):
        rel = p.relative_to(base).as_posix()
        if "/tests/" in f"/{rel}" or p.name.startswith("test") or "_lib/" in rel or "/_precompute/" in rel:
            continue
        if 4000 <= p.stat().st_size <= 60000:
            out.append(p)
    return out


def _code_prefix(text: str, max_chars: int = 520) -> str | None:
    """From the first top-level def/class to about max_chars, cut at a line end."""
    m = re.search(r"^(def|class) \w+", text, flags=re.M)
    if m is None:
        return None
    body = text[m.start():]
    if len(body) < max_chars + 200:
        return None
    cut = body.rfind("\n", 0, max_chars)
    return body[: cut + 1] if cut > 0 else None


def scipy_prompts(n_eval: int, n_build: int) -> tuple[list[tuple[str, str]], list[tuple[str, str]], str]:
    """(eval prefixes, build prefixes, build corpus text): eval and build come from different files."""
    files = _scipy_files()
    if not files:
        return [], [], ""
    step = max(1, len(files) // (2 * (n_eval + n_build)))
    picked = []
    for p in files[::step]:
        pre = _code_prefix(p.read_text(encoding="utf-8", errors="replace"))
        if pre is not None:
            picked.append((p, pre))
    ev = [(f"scipy:{p.parent.name}/{p.stem}", pre) for p, pre in picked[0::2][:n_eval]]
    bd_files = picked[1::2][:n_build]
    bd = [(f"scipy:{p.parent.name}/{p.stem}", pre) for p, pre in bd_files]
    # the frequency ranking's text: every build-side file picked (never an eval file)
    corpus = "\n".join(p.read_text(encoding="utf-8", errors="replace") for p, _ in picked[1::2])
    return ev, bd, corpus


def agent_prompt(model_dir, user: str, done, thinking: bool) -> str:
    from q27py.chat.render import detect_template, render_messages

    msgs = [{"role": "system", "content": AGENT_SYSTEM}, {"role": "user", "content": user}]
    if done is not None:
        name, args, result = done
        msgs.append({"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": name, "arguments": args}}]})
        msgs.append({"role": "tool", "content": result})
    return render_messages(msgs, TOOLS, template=detect_template(model_dir), add_generation_prompt=True,
                           enable_thinking=thinking).text


def build_prompt_sets(tok, model_dir, n_scipy_eval: int = 6, n_scipy_build: int = 8):
    from spec_measure import prompts as spec_measure_prompts  # the traces' prompt source

    ev = list(spec_measure_prompts(tok))
    ev += [(f"chat:{n.split('(')[0]}", tok.encode(CHAT.format(n, d))) for n, d in CHAT_EVAL_EXTRA]
    sc_ev, sc_bd, sc_corpus = scipy_prompts(n_scipy_eval, n_scipy_build)
    ev += [(name, tok.encode(text)) for name, text in sc_ev]
    ev += [(f"agent:{i}", tok.encode(agent_prompt(model_dir, *a))) for i, a in enumerate(AGENT_EVAL)]
    bd_texts = [(f"chat:{n.split('(')[0]}", CHAT.format(n, d)) for n, d in CHAT_BUILD]
    bd_texts += sc_bd
    bd_texts += [(f"agent:{i}", agent_prompt(model_dir, *a)) for i, a in enumerate(AGENT_BUILD)]
    bd = [(name, tok.encode(text)) for name, text in bd_texts]
    corpus = sc_corpus + "\n".join(t for _, t in bd_texts)
    return ev, bd, corpus


# ---------------------------------------------------------------------------------------------
# model runs


def load(model_dir: Path, backend: str):
    if backend == "fast":
        from q27py.model.fastcpu import FastCPUModel

        return FastCPUModel.load(model_dir)
    from q27py.model.reference import ReferenceModel

    return ReferenceModel.load(model_dir)


def greedy_with_hidden(model, ids: list[int], n_new: int, chunk: int, mtp_kv=None, stops=frozenset()):
    """Plain greedy decoding of up to n_new tokens, ending after the first stop id (the engine emits
    it). Returns (generated ids, hidden rows: row t = post-norm hidden at position t). With mtp_kv,
    the prompt's MTP rows 0..n-2 are written chunk by chunk as SpecDecoder's warm() writes them."""
    st = model.new_state()
    hidden_rows = []
    n = len(ids)
    for s in range(0, n, chunk):
        piece = ids[s : s + chunk]
        out = model.forward(st, piece, logits_rows="last")
        hid, last = np.array(out.hidden), out.logits[-1]
        hidden_rows.append(hid)
        if mtp_kv is not None:
            known = len(piece) if s + len(piece) < n else len(piece) - 1
            if known > 0:
                model.mtp_forward(mtp_kv, hid[:known], ids[s + 1 : s + 1 + known], mtp_kv.length, logits_rows="none")
    gen = [int(np.argmax(last))]
    while len(gen) < n_new and gen[-1] not in stops:
        out = model.forward(st, [gen[-1]], logits_rows="all")
        hidden_rows.append(np.array(out.hidden))
        gen.append(int(np.argmax(out.logits[-1])))
    return gen, np.concatenate(hidden_rows), st


@dataclass
class Variant:
    name: str
    ids: np.ndarray  # sorted subset of token ids (None = full vocabulary)
    family: str
    size: int


def restricted_argmax(logits: np.ndarray, v: Variant) -> int:
    if v.ids is None:
        return int(np.argmax(logits))
    return int(v.ids[int(np.argmax(logits[v.ids]))])


def study_prompt(model, ids, max_tokens: int, depth: int, chunk: int, variants: list[Variant], stops=frozenset()):
    """Per position j (pending = generated[j]), for each variant: the teacher-forced restricted drafts
    (len depth) and whether the restricted ladder equals the full ladder (first draft, whole chain)."""
    st0 = model.new_state()
    kv = st0.mtp_kv
    gen, hidden, _ = greedy_with_hidden(model, ids, max_tokens + depth, chunk, mtp_kv=kv, stops=stops)
    n, L = len(ids), len(gen)
    assert kv.length == n - 1
    nv = len(variants)
    tf = np.full((max_tokens, nv, depth), -1, dtype=np.int64)  # teacher-forced restricted argmax (-1: none)
    eq_first = np.zeros((max_tokens, nv), dtype=bool)
    eq_chain = np.zeros((max_tokens, nv), dtype=bool)
    full_chain = np.zeros((max_tokens, depth), dtype=np.int64)
    npos = 0
    for j in range(min(max_tokens - 1, L - 1)):  # a pending token at max_tokens-1 starts no round
        if gen[j] in stops:
            break
        npos += 1
        P = n + j  # the pending token's position
        assert kv.length == P - 1
        lg0, hm0 = model.mtp_forward(kv, hidden[P - 1 : P], [gen[j]], P - 1, logits_rows="last")
        warm = kv.length  # == P: row P-1 is committed, it stays
        l0 = lg0[0]
        # full-vocab ladder (the drafts the engine proposes today)
        chain_logits, chain_h = [l0], [hm0[-1:]]
        d = [int(np.argmax(l0))]
        for k in range(1, depth):
            lg, h = model.mtp_forward(kv, chain_h[-1], [d[-1]], P - 1 + k)
            chain_logits.append(lg[0])
            chain_h.append(h)
            d.append(int(np.argmax(lg[0])))
        full_chain[j] = d
        # teacher-forced ladder: step k fed the greedy token at P+k. While the full drafts equal the
        # greedy tokens its inputs are the full chain's (same numbers, reused); from the first
        # mismatch m it is run on: KV rows of steps 1..m kept, the greedy token fed instead.
        m = 0
        while m < depth - 1 and j + 1 + m < L and d[m] == gen[j + 1 + m]:
            m += 1
        tf_logits = chain_logits[: m + 1]
        kv.truncate(warm + m)
        h = chain_h[m]
        for k in range(m + 1, depth):
            if j + k >= L:  # past the end of the generation: no greedy token to feed
                break
            lg, h = model.mtp_forward(kv, h, [gen[j + k]], P - 1 + k)
            tf_logits.append(lg[0])
        kv.truncate(warm)
        for vi, v in enumerate(variants):
            tf[j, vi, : len(tf_logits)] = [restricted_argmax(lg, v) for lg in tf_logits]
            eq_first[j, vi] = restricted_argmax(l0, v) == d[0]
            ok = True
            for k in range(depth):
                if restricted_argmax(chain_logits[k], v) != d[k]:
                    ok = False
                    break
            eq_chain[j, vi] = ok
    return {"gen": gen, "tf": tf, "eq_first": eq_first, "eq_chain": eq_chain, "full_chain": full_chain,
            "positions": npos}


def walk(drafts, gen, j: int, stops=frozenset()) -> tuple[int, int]:
    """SpecDecoder._round's accept walk (greedy): lane t emits the main model's token gen[j+1+t] and
    continues only while it equals draft t and is no stop id. Returns (tokens emitted, drafts accepted)."""
    n = acc = 0
    for t in range(len(drafts) + 1):
        tok = gen[j + 1 + t]
        n += 1
        match = t < len(drafts) and tok == int(drafts[t])
        if match:
            acc += 1
        if tok in stops or not match:
            break
    return n, acc


def accepted_at(tf_row: np.ndarray, gen: list[int], j: int, k_max: int, stops=frozenset()) -> int:
    """Accepted drafts of a ladder of k_max drafts at pending index j (teacher-forced drafts)."""
    return walk(tf_row[:k_max], gen, j, stops)[1]


def replay_fixed_depth(tf_v: np.ndarray, gen, max_tokens: int, depth: int, stops=frozenset()) -> tuple[int, int]:
    """MTP-only ladder of fixed depth: (tokens generated, verify rounds)."""
    j, produced, rounds = 0, 1, 0
    while produced < max_tokens and gen[j] not in stops:
        k = min(depth, max_tokens - produced - 1)
        n, _ = walk(tf_v[j][:k], gen, j, stops)
        produced += n
        j += n
        rounds += 1
    return produced, rounds


def replay_engine(tf_v: np.ndarray, gen, prompt_ids, max_tokens: int, cfg: SpecConfig, stops=frozenset()) -> list[dict]:
    """SpecDecoder's rounds with the default DraftPlanner policy, replayed from the teacher-forced drafts.
    Returns a trace in DecodeStats' format (source, accepted = tokens emitted, lanes, mtp_steps, and
    the accepted draft count). Draft tokens after the first mismatch are not known here (they are
    rejected either way), so only the accepted prefix and the draft count are exact."""
    assert cfg.arbitration == "agree" and cfg.confidence_margin <= 0.0
    suffix = SuffixIndex(key_len=min(4, cfg.suffix_min_match)) if cfg.suffix else None
    if suffix is not None:
        suffix.extend(prompt_ids)
        suffix.extend([gen[0]])
    ctrl = DepthController(cfg.max_depth, cfg.adaptive_depth)
    width = cfg.max_verify_width
    trace = [{"source": NONE, "accepted": 1, "lanes": 0, "mtp_steps": 0, "accepted_drafts": 0}]
    j, produced = 0, 1
    while produced < max_tokens and gen[j] not in stops:
        max_drafts = min(width - 1, max_tokens - produced - 1)
        source, drafts, mtp_steps = NONE, [], 0
        if max_drafts > 0:
            proposal = []
            if suffix is not None:
                proposal, _ = suffix.propose(max_drafts, cfg.suffix_min_match)
            depth = min(max_drafts, ctrl.depth)
            first = int(tf_v[j][0])  # the ladder's first draft (the restricted argmax)
            if proposal and first == proposal[0]:
                # "agree": the ladder stopped after its first pass; the suffix proposal is verified
                source, mtp_steps, drafts = SUFFIX, 1, list(proposal)
            else:
                source, mtp_steps, drafts = MTP, depth, tf_v[j][:depth]
        drafts_n = len(drafts)
        n, matched = walk(drafts, gen, j, stops)
        new = gen[j + 1 : j + 1 + n]
        if source == MTP:
            ctrl.observe(drafts_n, matched)
        if suffix is not None:
            suffix.extend(new)
        trace.append({"source": source, "accepted": n, "lanes": 1 + drafts_n, "mtp_steps": mtp_steps,
                      "accepted_drafts": matched})
        produced += n
        j += n
    return trace


# ---------------------------------------------------------------------------------------------
# variants


REAL_SPECIAL_BASE = 248044  # the real vocabulary's first special id (fixtures/README.md)


def real_ids(vocab: int, n_ranks: int) -> np.ndarray:
    """Each model id's id in the real Qwen3.6 vocabulary: the prefix tokenizers keep the first n_ranks
    BPE ranks as they are and move the specials from 248,044.. to n_ranks.. (same order); rows past the
    specials are padding (mapped past the real specials, so no first-V' subset holds them)."""
    ids = np.arange(vocab, dtype=np.int64)
    return np.where(ids < n_ranks, ids, REAL_SPECIAL_BASE + ids - n_ranks)


def make_variants(vocab: int, n_ranks: int, specials: list[int], ranking: np.ndarray, sizes_first,
                  sizes_freq, log=print) -> list[Variant]:
    """first-V' is taken in REAL-vocabulary ids (what slicing the real lm_head's first V' rows keeps)."""
    sp = np.array(sorted(specials), dtype=np.int64)
    real = real_ids(vocab, n_ranks)
    out = [Variant("full", None, "full", vocab)]
    seen = {}
    for s in sizes_first:
        ids = np.nonzero(real < s)[0]
        key = ids.size
        if key in seen:
            log(f"first-{s}: on this vocabulary ({n_ranks} ranks) the same subset as {seen[key]}; not measurable here")
            continue
        seen[key] = f"first-{s}"
        out.append(Variant(f"first-{s}", ids, "first", s))
        out.append(Variant(f"first-{s}+sp", np.union1d(ids, sp), "first+sp", s))
    for s in sizes_freq:
        out.append(Variant(f"freq-{s}+sp", np.union1d(np.sort(ranking[:s]), sp), "freq+sp", s))
    return out


def frequency_ranking(vocab: int, gen_counts: collections.Counter, text_counts: collections.Counter) -> np.ndarray:
    ids = np.arange(vocab)
    g = np.array([gen_counts.get(i, 0) for i in ids])
    t = np.array([text_counts.get(i, 0) for i in ids])
    return np.lexsort((ids, -t, -g))  # by greedy-output count, then text count, then id


# ---------------------------------------------------------------------------------------------
# cross-check against the real SpecDecoder


def check_with_spec_decoder(model, prompt_ids, max_tokens: int, v: Variant, chunk: int, cfg: SpecConfig,
                            stops=frozenset()):
    """Run the engine's SpecDecoder with the MTP logits masked to the subset (a wrapper on the model
    instance; no repo file changed). Returns (generated ids, DecodeStats.trace)."""
    from q27py.engine.api import SamplingParams
    from q27py.engine.decoder import DecodeStats
    from q27py.engine.spec import SpecDecoder

    orig = model.mtp_forward
    if v.ids is not None:
        mask = np.full(model.cfg.vocab_size, -np.inf, dtype=np.float32)
        mask[v.ids] = 0.0

        def masked(kv, hidden, next_ids, start, logits_rows="all"):
            lg, hm = orig(kv, hidden, next_ids, start, logits_rows)
            return (lg + mask if lg.shape[0] else lg), hm

        model.mtp_forward = masked
    try:
        dec = SpecDecoder(model, replace(cfg, trace=True), prefill_chunk=chunk)
        stats = DecodeStats(record_trace=True)
        out = [t for c in dec.run(model.new_state(), prompt_ids, max_tokens, SamplingParams(), frozenset(stops),
                                  stats=stats) for t in c]
    finally:
        if v.ids is not None:
            del model.mtp_forward  # back to the class method
    return out, stats.trace


# ---------------------------------------------------------------------------------------------
# real-vocabulary text proxy


def real_vocab_proxy(model_texts: list[str], sizes, log) -> dict:
    """Share of tokens with id >= V' (and outside freq-V') when text is encoded with the real Qwen3.6
    vocabulary. Eval text: scipy sources (the eval-side files), the shared agent-traffic notes, this
    repository's docs, and the tiny model's own greedy outputs; freq subsets are ranked on disjoint text
    (the build-side scipy files and the repository's Python sources)."""
    from q27py.model.tiny import FULL_TOKENIZER
    from q27py.tokenizer import Tokenizer

    full = Tokenizer.from_file(FULL_TOKENIZER)
    files = _scipy_files()
    shared = Path(os.environ.get("Q27_SHARED", ROOT.parent / "shared"))

    def read(paths, cap=400_000):
        s, total = [], 0
        for p in paths:
            t = Path(p).read_text(encoding="utf-8", errors="replace")
            s.append(t)
            total += len(t)
            if total > cap:
                break
        return "\n".join(s)

    evals = {
        "code (scipy, held out)": read(files[0::2][::3]),
        "agent notes (shared/reference clients.md + peers.md)": read([p for p in (shared / "reference/clients.md",
                                                                             shared / "reference/peers.md") if p.exists()]),
        "prose (docs/*.md)": read(sorted((ROOT / "docs").glob("*.md"))),
        "tiny-model greedy text": "\n".join(model_texts),
    }
    build_text = read(files[1::2][::3]) + read(sorted((ROOT / "q27py").rglob("*.py")))
    cnt = collections.Counter(full.encode(build_text))
    vocab = 248320
    ids = np.arange(vocab)
    counts = np.zeros(vocab, dtype=np.int64)
    for k, c in cnt.items():
        counts[k] = c
    ranking = np.lexsort((ids, -counts))
    special = set(full.special_ids.values())
    out = {}
    for name, text in evals.items():
        if not text:
            continue
        toks = np.array([t for t in full.encode(text) if t not in special], dtype=np.int64)
        row = {"tokens": int(toks.size)}
        for s in sizes:
            row[f"first-{s}"] = float((toks >= s).mean())
            inset = np.zeros(vocab, dtype=bool)
            inset[ranking[:s]] = True
            row[f"freq-{s}"] = float((~inset[toks]).mean())
        out[name] = row
        log(f"  real-vocab {name}: {row}")
    return out


# ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--backend", choices=("reference", "fast"), default="reference")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=SpecConfig().max_depth)
    ap.add_argument("--first-sizes", default="2048,4096,8192,16384,32768,65536")
    ap.add_argument("--freq-sizes", default="1024,2048,4096,8192")
    ap.add_argument("--scipy-eval", type=int, default=6)
    ap.add_argument("--scipy-build", type=int, default=8)
    ap.add_argument("--limit", type=int, default=0, help="evaluate only the first N eval prompts (0 = all)")
    ap.add_argument("--check", type=int, default=3, help="SpecDecoder cross-check on K prompts spread over the eval set")
    ap.add_argument("--check-variants", default="full,first-8192,freq-2048+sp,first-16384")
    ap.add_argument("--no-stop", action="store_true",
                    help="no stop ids (as tools/record_traces.py recorded the traces); default: stop at the "
                         "model's eos ids, as the server does")
    ap.add_argument("--real-vocab", action="store_true", help="add the real-vocabulary text proxy")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()

    def log(*a):
        print(f"[{time.perf_counter() - t_start:7.1f}s]", *a, flush=True)

    from q27py.tokenizer import Tokenizer

    tok = Tokenizer.from_model_dir(args.model)
    model = load(args.model, args.backend)
    vocab = model.cfg.vocab_size
    specials = sorted(tok.special_ids.values())
    chunk = Q27Config().engine.prefill_chunk  # the chunk tools/record_traces.py's SpecDecoder used
    spec_cfg = SpecConfig()
    depth = args.depth
    stops = frozenset() if args.no_stop else frozenset(tok.eos_ids)
    ev, bd, corpus = build_prompt_sets(tok, args.model, args.scipy_eval, args.scipy_build)
    if args.limit:
        ev = ev[: args.limit]
    log(f"model {args.model} ({args.backend}), vocab {vocab}, {len(specials)} specials; "
        f"{len(ev)} eval prompts, {len(bd)} build prompts, {args.max_tokens} tokens, depth {depth}, "
        f"stop ids {sorted(stops)}")

    # ---- frequency ranking from the build prompts (disjoint from the eval prompts)
    gen_counts: collections.Counter = collections.Counter()
    for name, ids in bd:
        g, _, _ = greedy_with_hidden(model, ids, args.max_tokens, chunk, stops=stops)
        gen_counts.update(g)
    text_counts = collections.Counter(tok.encode(corpus))
    ranking = frequency_ranking(vocab, gen_counts, text_counts)
    log(f"frequency ranking: {sum(gen_counts.values())} greedy tokens ({len(gen_counts)} distinct) + "
        f"{sum(text_counts.values())} text tokens ({len(text_counts)} distinct)")

    n_ranks = min(specials)
    variants = make_variants(vocab, n_ranks, specials, ranking, [int(s) for s in args.first_sizes.split(",")],
                             [int(s) for s in args.freq_sizes.split(",")], log)
    names = [v.name for v in variants]

    # ---- the study
    per_prompt = []
    for name, ids in ev:
        t0 = time.perf_counter()
        r = study_prompt(model, ids, args.max_tokens, depth, chunk, variants, stops)
        r["name"], r["ids"] = name, ids
        per_prompt.append(r)
        acc_full = np.mean([accepted_at(r["tf"][j, 0], r["gen"], j, depth, stops) for j in range(r["positions"])])
        log(f"{name:26s} prompt {len(ids):4d}  generated {min(len(r['gen']), args.max_tokens):4d}  full-vocab mean accepted/position {acc_full:.2f}  "
            f"{time.perf_counter() - t0:.1f}s")

    # ---- aggregate
    M, D = args.max_tokens, depth
    results = {}
    for vi, v in enumerate(variants):
        pos_acc, first_ok, chain_ok, outside, gen_tok = [], [], [], 0, 0
        full_acc_out = 0  # positions where the full draft was accepted at depth 1 but lies outside the subset
        fixed_tok = fixed_rounds = 0
        eng_tok = eng_rounds = eng_lanes = eng_mtp = 0
        eng_src = collections.Counter()
        inset = np.ones(vocab, dtype=bool)
        if v.ids is not None:
            inset[:] = False
            inset[v.ids] = True
        for r in per_prompt:
            gen = r["gen"]
            for j in range(r["positions"]):  # every position a round could start at
                pos_acc.append(accepted_at(r["tf"][j, vi], gen, j, D, stops))
                first_ok.append(r["eq_first"][j, vi])
                chain_ok.append(r["eq_chain"][j, vi])
                if r["tf"][j, 0, 0] == gen[j + 1] and not inset[gen[j + 1]]:
                    full_acc_out += 1
            emitted = np.array(gen[1:M], dtype=np.int64)  # the tokens verification chose (after the prefill's)
            outside += int((~inset[emitted]).sum())
            gen_tok += emitted.size
            t, n = replay_fixed_depth(r["tf"][:, vi], gen, M, D, stops)
            fixed_tok += t
            fixed_rounds += n + 1  # + the prefill round
            tr = replay_engine(r["tf"][:, vi], gen, r["ids"], M, spec_cfg, stops)
            r.setdefault("engine_traces", {})[v.name] = tr
            eng_tok += sum(x["accepted"] for x in tr)
            eng_rounds += len(tr)
            eng_lanes += sum(x["lanes"] for x in tr)
            eng_mtp += sum(x["mtp_steps"] for x in tr)
            eng_src.update(x["source"] for x in tr)
        pa = np.array(pos_acc)
        results[v.name] = {
            "family": v.family, "size": v.size, "rows": int(vocab if v.ids is None else v.ids.size),
            "positions": int(pa.size),
            "draft1_equals_full": float(np.mean(first_ok)),
            "chain_equals_full": float(np.mean(chain_ok)),
            "accepted_per_position_mean": float(pa.mean()),
            "accepted_hist": [float((pa == k).mean()) for k in range(D + 1)],
            "acc_at_1": float((pa >= 1).mean()),
            "fixed_depth_tokens_per_round": fixed_tok / fixed_rounds,
            "engine_tokens_per_round": eng_tok / eng_rounds,
            "engine_tokens_per_verify_round": (eng_tok - len(per_prompt)) / (eng_rounds - len(per_prompt)),
            "engine_lanes_per_token": eng_lanes / (eng_tok - len(per_prompt)),
            "engine_share": {k: c / eng_rounds for k, c in eng_src.items()},
            "greedy_outside_subset": outside / gen_tok,
            "full_depth1_accepts_lost": full_acc_out / max(1, pa.size),
        }

    # ---- cross-check with the real SpecDecoder
    checks = []
    for v in variants:
        if v.name not in args.check_variants.split(","):
            continue
        picks = sorted({int(round(x)) for x in np.linspace(0, len(per_prompt) - 1, args.check)}) if args.check else []
        for r in [per_prompt[i] for i in picks]:
            out, trace = check_with_spec_decoder(model, r["ids"], M, v, chunk, spec_cfg, stops)
            mine = r["engine_traces"][v.name]
            same_out = out == r["gen"][:M]
            same_rounds = [(x["source"], x["accepted"], x["lanes"], x["mtp_steps"]) for x in trace] == \
                          [(x["source"], x["accepted"], x["lanes"], x["mtp_steps"]) for x in mine]
            checks.append({"variant": v.name, "prompt": r["name"], "output_equals_plain": same_out,
                           "rounds_equal_replay": same_rounds, "spec_rounds": len(trace), "replay_rounds": len(mine)})
            log(f"check {v.name:14s} {r['name']:24s} output==plain {same_out}  rounds==replay {same_rounds} "
                f"({len(trace)} vs {len(mine)})")

    real = None
    if args.real_vocab:
        texts = [tok.decode(r["gen"][:M]) for r in per_prompt]
        real = real_vocab_proxy(texts, [8192, 16384, 32768, 65536, 98304, 131072], log)

    # ---- report
    base = results["full"]
    gen_total = sum(min(len(r["gen"]), M) for r in per_prompt)
    print()
    print(f"model {args.model.name}: {len(per_prompt)} prompts x up to {M} greedy tokens "
          f"({gen_total} generated), MTP depth {D}, {base['positions']} positions; backend {args.backend}; "
          f"stop ids {sorted(stops) or 'none'}")
    print("| variant | lm_head rows | draft1 = full | chain = full | acc@1 | mean accepted/pos (d=3) | "
          "tok/round fixed d=3 | vs full | tok/round engine default | vs full | greedy outside subset | accept hist 0/1/2/3 |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|")
    for name in names:
        x = results[name]
        rel = x["engine_tokens_per_round"] / base["engine_tokens_per_round"] - 1
        relf = x["fixed_depth_tokens_per_round"] / base["fixed_depth_tokens_per_round"] - 1
        print(f"| {name} | {x['rows']} | {x['draft1_equals_full']:.4f} | {x['chain_equals_full']:.4f} | "
              f"{x['acc_at_1']:.4f} | {x['accepted_per_position_mean']:.3f} | {x['fixed_depth_tokens_per_round']:.3f} | "
              f"{100 * relf:+.2f}% | {x['engine_tokens_per_round']:.3f} | {100 * rel:+.2f}% | {100 * x['greedy_outside_subset']:.2f}% | "
              + "/".join(f"{h:.3f}" for h in x["accepted_hist"]) + " |")
    if checks:
        ok = all(c["output_equals_plain"] and c["rounds_equal_replay"] for c in checks)
        print(f"SpecDecoder cross-check: {len(checks)} runs, all outputs == plain and all round traces == replay: {ok}")
    if real:
        print("\nreal 248K vocabulary, text proxy (share of tokens outside the subset):")
        for k, row in real.items():
            print(f"  {k} ({row['tokens']} tokens): " + "  ".join(
                f"{c} {100 * row[c]:.2f}%" for c in row if c != "tokens"))
    seconds = time.perf_counter() - t_start
    print(f"run time {seconds:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({
            "model": str(args.model), "backend": args.backend, "max_tokens": M, "depth": D,
            "eval_prompts": [r["name"] for r in per_prompt], "build_prompts": [n for n, _ in bd],
            "results": results, "checks": checks, "real_vocab_proxy": real, "seconds": seconds,
            "ranking_head": ranking[:64].tolist(),
            "per_prompt": [{"name": r["name"], "prompt_tokens": len(r["ids"]), "generated": min(len(r["gen"]), M),
                            "engine_tokens_per_round": {k: sum(x["accepted"] for x in tr) / len(tr)
                                                        for k, tr in r["engine_traces"].items()}}
                           for r in per_prompt],
        }, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
