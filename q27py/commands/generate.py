"""`q27py generate`: run one prompt through the engine and print the result.

`--json` prints one object: {"tokens": [...], "text": "...", "stats": {prompt_tokens,
generated_tokens, seconds, tokens_per_s, rounds, tokens_per_round, ...}}; with --trace,
stats.trace is a per-round list of {"source": "mtp"|"suffix"|"none", "drafts": [...],
"accepted": n} (n = tokens the round committed; the prefill is round one). These key
names are a contract (external checks read them).
"""

from __future__ import annotations

import json
import sys

from q27py.chat.textstage import TextStage, text_of
from q27py.commands.engine_flags import add_engine_arguments, apply_engine_arguments
from q27py.config import Q27Config, apply_env, apply_overrides
from q27py.engine.api import GenerationRequest, SamplingParams
from q27py.errors import Q27Error


def add_arguments(p) -> None:
    add_engine_arguments(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (used as is: no chat template)")
    src.add_argument("--prompt-ids", help="comma-separated token ids")
    p.add_argument("-n", "--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS ids")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--trace", action="store_true",
                   help="with --json: stats.trace lists every round's drafter, drafts and accepted count")
    samp = p.add_argument_group("sampling (default greedy)")
    samp.add_argument("--temperature", type=float, default=None, help="0 = greedy (default)")
    samp.add_argument("--top-p", type=float, default=None, help="nucleus mass kept, (0, 1]")
    samp.add_argument("--top-k", type=int, default=None, help="most probable tokens kept (0 = off)")
    samp.add_argument("--min-p", type=float, default=None, help="drop tokens below min_p x the top probability")
    samp.add_argument("--seed", type=int, default=None, help="same seed => same output, whatever --spec settings")


def build_config(args) -> Q27Config:
    cfg = apply_env(Q27Config())
    apply_engine_arguments(cfg, args)
    apply_overrides(cfg.spec, {"trace": True if args.trace else None})
    return cfg


def build_sampling(args) -> SamplingParams:
    s = SamplingParams()
    for name in ("temperature", "top_p", "top_k", "min_p", "seed"):
        value = getattr(args, name)
        if value is not None:
            setattr(s, name, value)
    return s


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise Q27Error(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise Q27Error("--prompt-ids is empty")
    return ids


def run(args) -> int:
    from q27py.engine.engine import LocalEngine

    cfg = build_config(args)
    engine = LocalEngine.load(cfg)
    ids = parse_ids(args.prompt_ids) if args.prompt_ids is not None else engine.tokenizer.encode(args.prompt)
    if not ids:
        raise Q27Error("the prompt is empty")
    bad = [i for i in ids if not 0 <= i < engine.model_config.vocab_size]
    if bad:
        raise Q27Error(f"token id {bad[0]} is outside the vocabulary (0..{engine.model_config.vocab_size - 1})")
    stop_ids = frozenset() if args.ignore_eos else frozenset(engine.tokenizer.eos_ids)
    request = GenerationRequest(prompt_ids=ids, max_tokens=args.max_tokens, sampling=build_sampling(args), stop_ids=stop_ids)
    # The prompt is used as is, so the output is raw text: the same text stage as the server's
    # /v1/completions (detokenizer, no splitter markup).
    stage = TextStage(engine.tokenizer, stop_ids=stop_ids)
    tokens, text, stats = [], [], {}

    def show(events) -> None:
        piece = text_of(events)
        text.append(piece)
        if not args.json and piece:
            sys.stdout.write(piece)
            sys.stdout.flush()

    for chunk in engine.generate(request):
        tokens.extend(chunk.token_ids)
        show(stage.feed(chunk.token_ids))
        if chunk.stats is not None:
            stats = dict(chunk.stats, finish_reason=chunk.finish_reason)
    show(stage.finish())
    if args.json:
        print(json.dumps({"tokens": tokens, "text": "".join(text), "stats": stats}, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        print(
            f"[{stats.get('generated_tokens', 0)} tokens, {stats.get('tokens_per_s', 0):.1f} tok/s, "
            f"{stats.get('tokens_per_round', 0):.2f} tokens/round]",
            file=sys.stderr,
        )
    return 0
