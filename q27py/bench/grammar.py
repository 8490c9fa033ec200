"""`q27py bench grammar`: what an output constraint costs per decode step on a real vocabulary.

For typical tool schemas (Claude Code's Bash / Edit / Read / Write / Agent and Codex's
exec_command as Qwen XML calls, plus a JSON-schema answer), a realistic output is tokenized and
replayed through the constraint step by step: each step fetches the allowed-token mask for the
current state and advances the state by the chosen token, as the TokenPicker does. Reported:

- compile: building the constraint when the request arrives, before decoding starts
  (CompiledConstraint.precompute: the grammar's own leaves' frame masks, the start state's mask);
- cold: the first replay of a grammar after that (every new state composes its mask from shared
  frame masks, or walks the trie for container frames), mean / p99 / max per step;
- warm: the same grammar again (masks cached per state; what an agent session sees, since its
  tools are the same every turn and compiled constraints are kept across requests);
- apply: choosing the greedy token from a random 248K logits row through the mask (host).
- the vocabulary index (with its warm tables) is built once per tokenizer at server start
  (ConstraintCache.prepare): reported as index_build_s, not in the per-step figures.

The vocabulary defaults to the bundled full Qwen3.6 tokenizer (248,044 tokens + specials).
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

import numpy as np

from q27py import DEFAULT_MODEL_DIR

FULL_TOKENIZER = Path(__file__).resolve().parents[1] / "data" / "tokenizers" / "qwen36-full.tokenizer.json.gz"

S, N, I, B = {"type": "string"}, {"type": "number"}, {"type": "integer"}, {"type": "boolean"}


def _obj(props, required):
    return {"type": "object", "properties": props, "required": required}


TOOLS = {
    "Bash": _obj({"command": S, "timeout": N, "description": S, "run_in_background": B}, ["command"]),
    "Edit": _obj({"file_path": S, "old_string": S, "new_string": S, "replace_all": B},
                 ["file_path", "old_string", "new_string"]),
    "Read": _obj({"file_path": S, "offset": I, "limit": I}, ["file_path"]),
    "Write": _obj({"file_path": S, "content": S}, ["file_path", "content"]),
    "Agent": _obj({"description": S, "prompt": S, "subagent_type": S}, ["description", "prompt"]),
    "exec_command": _obj({"cmd": S, "workdir": S, "yield_time_ms": I,
                          "sandbox_permissions": {"enum": ["use_default", "require_escalated"]}}, ["cmd"]),
}

CALLS = [
    ("Bash", {"command": "cd /work/repo && git status --short && grep -rn \"TODO\" src/ | head -20",
              "description": "Show changed files and open TODOs", "timeout": 120000}),
    ("Edit", {"file_path": "/work/repo/src/server/http.py",
              "old_string": "    if len(body) > limit:\n        raise TooLarge(limit)\n",
              "new_string": "    if len(body) > limit:\n        # Count the bytes, not the characters.\n"
                            "        raise TooLarge(limit, len(body))\n", "replace_all": False}),
    ("Read", {"file_path": "/work/repo/tests/test_http.py", "offset": 120, "limit": 80}),
    ("Write", {"file_path": "/work/repo/notes.md",
               "content": "# Notes\n\n- The parser keeps `</div>` inside values.\n- Timeouts: 30 s header, 120 s body.\n"}),
    ("exec_command", {"cmd": "python3 -m pytest -q tests/server -x", "workdir": "/work/repo", "yield_time_ms": 10000,
                      "sandbox_permissions": "use_default"}),
]

# Codex's tools as the server maps them (../shared/reference/clients.md): the freeform apply_patch
# as one string parameter, the shell tool's argv array, exec_command / write_stdin.
CODEX_TOOLS = {
    "apply_patch": _obj({"input": S}, ["input"]),
    "shell": _obj({"command": {"type": "array", "items": S}, "workdir": S, "timeout_ms": I}, ["command"]),
    "exec_command": TOOLS["exec_command"],
    "write_stdin": _obj({"session_id": I, "chars": S, "yield_time_ms": I}, ["session_id"]),
}

CODEX_CALLS = [
    ("shell", {"command": ["bash", "-lc", "rg -n \"def handle_body\" src/ && sed -n 1,40p src/server/http.py"],
               "workdir": "/work/repo", "timeout_ms": 10000}),
    ("apply_patch", {"input": "*** Begin Patch\n*** Update File: src/server/http.py\n@@ def handle_body(body, limit):\n"
                              "-    if len(body) > limit:\n+    if len(body.encode()) > limit:\n"
                              "         raise TooLarge(limit)\n*** End Patch\n"}),
    ("exec_command", {"cmd": "python3 -m pytest -q tests/server -x", "workdir": "/work/repo", "yield_time_ms": 10000}),
]

TITLE_SCHEMA = _obj({"title": S}, ["title"])
TITLE = {"title": "Fix the HTTP body limit and add a regression test"}


def render_call(name: str, args: dict) -> str:
    parts = ["<tool_call>\n<function=" + name + ">\n"]
    for k, v in args.items():
        parts.append("<parameter=" + k + ">\n" + (v if isinstance(v, str) else json.dumps(v)) + "\n</parameter>\n")
    return "".join(parts) + "</function>\n</tool_call>"


def _stats(times) -> tuple[float, float, float]:
    return float(times.mean()), float(np.percentile(times, 99)), float(times.max())


def _replay(constraint, tok, ids, stops, cpu=None):
    """Per-step wall ms; `cpu` (a list) gets per-step process CPU ms (less sensitive to a loaded
    machine: other jobs' time slices are not counted)."""
    times = []
    sid = constraint.start
    for t in ids:
        c0 = time.process_time()
        t0 = time.perf_counter()
        allowed = constraint.allowed(sid, stops)
        assert t in allowed, "the replayed output must be inside the grammar"
        sid = constraint.advance(sid, t, tok.token_bytes)
        times.append(time.perf_counter() - t0)
        if cpu is not None:
            cpu.append((time.process_time() - c0) * 1e3)
    return np.asarray(times) * 1e3


def run_grammar_bench(tokenizer_path: Path | None = None, log=print) -> dict:
    from q27py.engine.constraint import CompiledConstraint, VocabIndex
    from q27py.engine.grammar import json_grammar, tool_call_grammar
    from q27py.tokenizer import Tokenizer

    path = Path(tokenizer_path) if tokenizer_path else FULL_TOKENIZER
    tok = Tokenizer.from_file(path)
    # Built at server start (ConstraintCache.prepare), warm tables included: a one-time cost per
    # tokenizer, reported apart from the per-step figures.
    t0 = time.perf_counter()
    vocab = VocabIndex.from_tokenizer(tok, max(tok.vocab_size, 248320 if tok.vocab_size > 200000 else 0), warm=False)
    t1 = time.perf_counter()
    vocab.warm()  # loop tables, whitespace subtrees, the common leaves' frame masks
    index_s = time.perf_counter() - t0
    warm_s = time.perf_counter() - t1
    stops = [tok.special_ids.get("<|im_end|>", 0)]
    # The tokenizer and the index are ~2M long-lived objects: a full cyclic collection during a
    # replay rescans them all (~80 ms on this machine) whatever the step does -- a process-wide
    # pause, not mask cost. They are frozen out of the collector for the measurement (as a server
    # would after start-up: gc.freeze), and unfrozen at the end.
    gc.collect()
    gc.freeze()
    log(f"vocabulary {len(vocab.toks)} tokens (+{len(vocab.specials)} specials), index built in {index_s:.2f} s "
        f"(of which warm tables and {len(vocab.frames)} frame masks {warm_s:.2f} s)")
    cases = {
        "xml_tool_calls": (tool_call_grammar(TOOLS), "\n".join(render_call(n, a) for n, a in CALLS)),
        "json_schema_title": (json_grammar(TITLE_SCHEMA), json.dumps(TITLE)),
        "json_schema_bash": (json_grammar(TOOLS["Bash"]), json.dumps(CALLS[0][1])),
        "codex_tool_calls": (tool_call_grammar(CODEX_TOOLS), "\n".join(render_call(n, a) for n, a in CODEX_CALLS)),
    }
    result = {"tokenizer": str(path.name), "vocab_tokens": len(vocab.toks), "index_build_s": round(index_s, 3),
              "index_warm_s": round(warm_s, 3), "frame_masks_warm": len(vocab.frames), "gc_frozen": True,
              "cases": {}}
    for name, (grammar, text) in cases.items():
        ids = tok.encode(text)
        t0 = time.perf_counter()
        constraint = CompiledConstraint(grammar, vocab)
        constraint.precompute()  # as ConstraintCache.get does when a request brings a new grammar
        compile_s = time.perf_counter() - t0
        cold_cpu: list = []
        cold = _replay(constraint, tok, ids, stops, cold_cpu)
        cold_cpu = np.asarray(cold_cpu)
        masks = constraint.stats["mask_misses"]
        warm = _replay(constraint, tok, ids, stops)
        cm, cp99, cmax = _stats(cold)
        wm, wp99, wmax = _stats(warm)
        row = {"tokens": len(ids), "states": len(constraint._sets), "masks": masks,
               "compile_ms": round(compile_s * 1e3, 2),
               "cold_ms_per_step_mean": round(cm, 3), "cold_ms_per_step_p99": round(cp99, 3),
               "cold_ms_per_step_max": round(cmax, 3), "cold_total_s": round(float(cold.sum()) / 1e3, 3),
               "cold_cpu_ms_per_step_mean": round(float(cold_cpu.mean()), 3),
               "cold_cpu_ms_per_step_p99": round(float(np.percentile(cold_cpu, 99)), 3),
               "warm_ms_per_step_mean": round(wm, 4), "warm_ms_per_step_p99": round(wp99, 4),
               "warm_ms_per_step_max": round(wmax, 4)}
        result["cases"][name] = row
        log(f"{name}: {len(ids)} tokens, {row['states']} states, {masks} masks; compile {row['compile_ms']} ms; "
            f"cold {row['cold_ms_per_step_mean']} "
            f"ms/step (p99 {row['cold_ms_per_step_p99']}, max {row['cold_ms_per_step_max']}; "
            f"{row['cold_total_s']} s first pass; CPU {row['cold_cpu_ms_per_step_mean']} ms/step); warm {row['warm_ms_per_step_mean']} ms/step "
            f"(p99 {row['warm_ms_per_step_p99']}, max {row['warm_ms_per_step_max']})")
    # Applying a mask on the host: greedy choice through the allowed ids of a dense and a sparse state.
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(vocab.vocab_size).astype(np.float32)
    grammar = tool_call_grammar(TOOLS)
    c = CompiledConstraint(grammar, vocab)
    sid = c.start
    for t in tok.encode("<tool_call>\n<function=Bash>\n<parameter=command>\nls "):
        sid = c.advance(sid, t, tok.token_bytes)
    apply = {}
    for label, state in (("dense (string value)", sid), ("sparse (call opener)", c.start)):
        mask = c.allowed(state, stops)
        reps = 200
        t0 = time.perf_counter()
        for _ in range(reps):
            mask.greedy(logits)
        apply[label] = {"allowed": len(mask), "ms": round((time.perf_counter() - t0) / reps * 1e3, 4)}
        t0 = time.perf_counter()
        for _ in range(reps):
            int(np.argmax(logits))
        apply[label]["unmasked_argmax_ms"] = round((time.perf_counter() - t0) / reps * 1e3, 4)
        log(f"apply {label}: {len(mask)} allowed ids, {apply[label]['ms']} ms per greedy choice "
            f"(plain argmax {apply[label]['unmasked_argmax_ms']} ms)")
    result["apply_greedy_host"] = apply
    gc.unfreeze()
    return result


__all__ = ["run_grammar_bench", "DEFAULT_MODEL_DIR"]
