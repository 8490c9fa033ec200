"""Short-bench: 5 fixed genre-diverse short prompts x 128 tokens through the engine (with
speculation when the engine has it), per-prompt and mean tokens/s and tokens per round.

Not a bitwise gate and not a single-prompt number: the spread across prompts is acceptance
variance, which is why the mean of the five is what gets compared.
"""

from __future__ import annotations

from q27py.engine.api import GenerationRequest, SamplingParams

PROMPTS = (
    ("code", "Write a Python function `merge_intervals(items)` that merges overlapping intervals."),
    ("prose", "Describe a rainy evening in a small harbour town in three sentences."),
    ("explain", "Explain how a hash map handles collisions, briefly."),
    ("math", "What is 17 * 23? Show the steps."),
    ("list", "List five common HTTP status codes and what they mean."),
)
TOKENS = 128


def chat_prompt(text: str) -> str:
    """A user turn in the model's chat format, thinking closed (as the golden fixtures render it)."""
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def run_shortbench(engine, tokens: int = TOKENS, log=print) -> dict:
    rows = []
    for name, text in PROMPTS:
        ids = engine.tokenizer.encode(chat_prompt(text))
        req = GenerationRequest(prompt_ids=ids, max_tokens=tokens, sampling=SamplingParams(), stop_ids=frozenset())
        stats = {}
        for chunk in engine.generate(req):
            if chunk.stats is not None:
                stats = chunk.stats
        gen = stats.get("generated_tokens", 0)
        decode_s = stats.get("seconds", 0.0) - (stats.get("ttft_seconds") or 0.0)
        tps = (gen - 1) / decode_s if decode_s > 0 and gen > 1 else 0.0
        row = {"prompt": name, "prompt_tokens": len(ids), "generated": gen, "decode_tokens_per_s": tps,
               "tokens_per_round": stats.get("tokens_per_round", 0.0), "ttft_s": stats.get("ttft_seconds")}
        rows.append(row)
        log(f"{name:8s} {gen:4d} tokens  {tps:8.1f} t/s  {row['tokens_per_round']:.2f} tokens/round")
    mean = sum(r["decode_tokens_per_s"] for r in rows) / len(rows)
    tpr = sum(r["tokens_per_round"] for r in rows) / len(rows)
    log(f"mean     {mean:8.1f} t/s  {tpr:.2f} tokens/round")
    return {"prompts": rows, "mean_tokens_per_s": mean, "mean_tokens_per_round": tpr}
