"""`q27py bench replay`: a synthetic Claude-Code-shaped agent session, replayed turn by turn.

A long system prompt + tool definitions (the block every turn and every new
conversation re-sends), then turns that each append an assistant tool call and
its result, as an agent's history grows. Every turn is rendered with the real
renderer, split-encoded at the stable boundary as the server does, and run with
max_tokens=1, so the time to the first token is the prefill the engine could not
avoid (measured when the first token's chunk comes out, as a streaming client gets
it; `complete_s` beside it is the whole request). Reported: token-weighted reuse
(restored prompt tokens / prompt tokens over all turns) and warm vs cold time to
first token (cold = a fresh engine with no prefix state, same model).
"""

from __future__ import annotations

import json
import random
import time

from q27py.chat.render import encode_rendered, render_messages
from q27py.engine.api import GenerationRequest

TOOL_NAMES = ["Bash", "Read", "Write", "Edit", "Glob", "Grep", "LS", "TodoWrite", "WebFetch", "Task", "NotebookEdit",
              "MultiEdit", "ExitPlanMode", "BashOutput", "KillShell"]


def _tools(rng: random.Random, budget: int) -> list[dict]:
    """Tool definitions taking about a third of the system block's token budget."""
    tools = []
    n_tools = max(3, min(len(TOOL_NAMES), budget // 1500))
    for name in TOOL_NAMES[:n_tools]:
        props = {f"{name.lower()}_{k}": {"type": rng.choice(["string", "integer", "boolean"]),
                                         "description": f"The {k} argument of {name}; " + "see the usage notes. " * 6}
                 for k in ("path", "pattern", "limit", "offset", "mode")}
        tools.append({"type": "function", "function": {
            "name": name, "description": f"{name}: " + ("Use this tool to work with the repository. " * 25),
            "parameters": {"type": "object", "properties": props, "required": list(props)[:2]}}})
    return tools


def _code_block(rng: random.Random, lines: int) -> str:
    out = []
    for i in range(lines):
        name = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz_") for _ in range(rng.randint(4, 12)))
        out.append(rng.choice([
            f"def {name}(x, y={i}):", f"    return {name}(x) + {rng.randint(0, 999)}", f"    # {name} handles case {i}",
            f"class {name.title()}(Base):", f"    {name} = self.{name}.get({i!r})", f"import {name}",
            f"    if {name} is None:", f"        raise ValueError('{name} missing at line {i}')"]))
    return "\n".join(out)


def session(system_tokens: int, turns: int, tokenizer, seed: int = 0):
    """Yield (messages, tools) for each turn of one growing conversation."""
    rng = random.Random(seed)
    tools = _tools(rng, system_tokens)
    base = ("You are an interactive CLI agent that helps users with software engineering tasks. "
            "Follow the repository conventions, run the tests, and keep changes minimal. ")
    system, n = [], 0
    tools_tokens = len(tokenizer.encode(json.dumps(tools)))
    while n + tools_tokens < system_tokens:
        para = base + _code_block(rng, 6) + "\n\n"
        system.append(para)
        n += len(tokenizer.encode(para))
    msgs = [{"role": "system", "content": "".join(system)},
            {"role": "user", "content": "The test suite fails in parser.py; find the cause and fix it."}]
    yield list(msgs), tools
    for t in range(turns - 1):
        tool = rng.choice(["Bash", "Read", "Grep"])
        msgs.append({"role": "assistant", "content": "", "reasoning_content": f"Look at step {t} next.",
                     "tool_calls": [{"type": "function", "function": {
                         "name": tool, "arguments": {f"{tool.lower()}_path": f"src/mod_{t}.py"}}}]})
        msgs.append({"role": "tool", "content": _code_block(rng, rng.randint(20, 60))})
        yield list(msgs), tools


def encode_turn(tokenizer, messages, tools) -> tuple[list[int], int, int]:
    """(ids, stable tokens, system tokens), encoded as the server encodes a prompt."""
    ids, system, stable = encode_rendered(tokenizer, render_messages(messages, tools, enable_thinking=True,
                                                                     preserve_thinking=True))
    return ids, stable, system


def first_token(engine, ids: list[int], stable: int, system: int | None = None) -> dict:
    """Run one turn with max_tokens=1. ttft_s is measured as a streaming client sees it: from the
    request to the engine's chunk carrying the first token (its id is on the host then: the pick read
    the logits row). complete_s is the whole request, which also holds what the engine does after
    that token (the prompt's MTP warm-up held back for it, engine/spec.py; putting the state at
    rest for prefix reuse); the next turn starts after it, as a client's next request would."""
    req = GenerationRequest(prompt_ids=ids, max_tokens=1, stop_ids=frozenset(), stable_len=stable,
                            system_len=system or None)
    t0 = time.perf_counter()
    stats = {}
    first_at = None
    for chunk in engine.generate(req):
        if chunk.token_ids and first_at is None:
            first_at = time.perf_counter()
        if chunk.stats is not None:
            stats = chunk.stats
    done = time.perf_counter()
    return {"prompt_tokens": len(ids), "cached_tokens": stats.get("cached_tokens", 0),
            "ttft_s": (first_at if first_at is not None else done) - t0, "complete_s": done - t0}


def cold_first_token(make_engine, ids: list[int], stable: int, system: int | None = None) -> dict:
    """first_token through a fresh engine, which is then collected. Why: an engine's device snapshots (~150 MB
    each on the 27B) count against the model's device snapshot budget (FastModel.device_snapshot_bytes, shared by
    every engine of the process); a LocalEngine held a reference cycle until 2026-12-06, so a dropped cold engine
    kept them counted until the cycle collector ran and the next cold engine's checkpoints spilled to host copies
    (a server has one engine: a bench artifact). The cycle is gone (tests/engine/test_engine_lifetime.py); the
    collection keeps the bench honest against any new one."""
    import gc

    engine = make_engine()
    try:
        return first_token(engine, ids, stable, system)
    finally:
        del engine
        gc.collect()


def run_replay(make_engine, tokenizer, system_tokens: int = 20000, turns: int = 30, cold_at_tokens: int = 25000,
               seed: int = 0, log=print) -> dict:
    """Replay one session through a warm engine. A fresh (cold) engine also runs turn 1 and the
    first turn whose prompt reaches cold_at_tokens (else the last turn): the warm/cold pair there
    is the headline figure ("turn_at_target")."""
    warm = make_engine()
    rows = []
    sessions = list(session(system_tokens, turns, tokenizer, seed))
    encoded = [encode_turn(tokenizer, m, t) for m, t in sessions]
    target = next((i for i, (ids, _, _) in enumerate(encoded) if len(ids) >= cold_at_tokens), len(encoded) - 1)
    for i, (ids, stable, system) in enumerate(encoded):
        row = {"turn": i + 1, **first_token(warm, ids, stable, system)}
        if i in (0, target):
            cold = cold_first_token(make_engine, ids, stable, system)
            row["cold_ttft_s"], row["cold_complete_s"] = cold["ttft_s"], cold["complete_s"]
        rows.append(row)
        log(f"turn {i + 1:2d}: prompt {row['prompt_tokens']:6d}  reused {row['cached_tokens']:6d}  "
            f"ttft {row['ttft_s'] * 1000:8.1f} ms" + (f"  cold {row['cold_ttft_s'] * 1000:8.1f} ms" if "cold_ttft_s" in row else ""))
    total = sum(r["prompt_tokens"] for r in rows)
    reused = sum(r["cached_tokens"] for r in rows)
    warm_rows = rows[1:] or rows
    return {
        "turns": rows,
        "token_weighted_reuse": reused / total if total else 0.0,
        "prompt_tokens_total": total,
        "reused_tokens_total": reused,
        "warm_ttft_mean_s": sum(r["ttft_s"] for r in warm_rows) / len(warm_rows),
        "turn_at_target": rows[target],
        "prefix": warm.prefix_stats(),
        "graphs": graph_stats(warm),
    }


def graph_stats(engine) -> dict | None:
    """The warm engine's CUDA graphs after the session (GraphCache; None on the CPU path): captured, model-level
    bytes, the largest state's bytes and graph count, and the steps run eagerly because a budget was full."""
    graphs = getattr(getattr(engine, "model", None), "graphs", None)
    if graphs is None:
        return None
    most_bytes, most_graphs = graphs.largest_state()
    return {"captures": graphs.captures, "model_graph_bytes": int(graphs.model_bytes),
            "state_graph_bytes_max": most_bytes or 0, "graphs_per_state_max": most_graphs or 0,
            "state_budget": graphs.state_budget, "model_budget": graphs.model_budget,
            "steps_over_budget": graphs.over_budget}
