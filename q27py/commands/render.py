"""`q27py render`: an API request body on stdin -> the exact prompt the server would prefill.

    q27py render [--model DIR] [--api anthropic|openai|responses] [--json] < request.json

Prints the prompt text byte for byte (no newline added). With --json prints
{"prompt", "token_ids", "stable_len", "stable_chars"}: stable_len counts the
tokens of the prompt up to the renderer's stable boundary (the end of the last
complete turn), stable_chars the characters. Thinking follows the request,
else the server default (ServerConfig.default_thinking); so does
preserve_thinking (ServerConfig.preserve_thinking).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from q27py import DEFAULT_MODEL_DIR
from q27py.chat.render import TEMPLATES, detect_template, encode_rendered, render
from q27py.chat.requests import APIS, RequestError
from q27py.config import ServerConfig


def add_arguments(parser) -> None:
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR,
                        help="model directory: picks the chat template variant and the tokenizer "
                             "(default: the bundled tiny model)")
    parser.add_argument("--api", choices=APIS, default="openai",
                        help="request body format: anthropic (Messages), openai (Chat Completions), "
                             "responses (Responses); default openai")
    parser.add_argument("--template", choices=TEMPLATES, default=None,
                        help="chat template variant (default: detected from the model directory)")
    parser.add_argument("--json", action="store_true",
                        help='print {"prompt", "token_ids", "stable_len", "stable_chars"}')


def read_request(api: str, body):
    """The body read exactly as the server reads it (its API module's `read`); the model
    name is optional here, and Anthropic's max_tokens is not needed to render."""
    from q27py.server import anthropic, openai_chat, responses
    from q27py.server.errors import ApiError

    readers = {"anthropic": lambda b: anthropic.read(b, counting=True), "openai": openai_chat.read,
               "responses": responses.read}
    if isinstance(body, dict) and body.get("model") is None:
        body = {**body, "model": "render"}
    try:
        return readers[api](body)
    except ApiError as exc:
        raise RequestError(exc.message) from None


def run(args) -> int:
    try:
        body = json.loads(sys.stdin.read())
    except ValueError as exc:
        raise RequestError(f"the request body is not valid JSON ({exc})") from None
    req = read_request(args.api, body)
    server = ServerConfig()
    template = args.template or detect_template(args.model)
    rendered = render(req.conv, template=template,
                      enable_thinking=server.default_thinking if req.enable_thinking is None else req.enable_thinking,
                      preserve_thinking=server.preserve_thinking if req.preserve_thinking is None
                      else req.preserve_thinking)
    if not args.json:
        sys.stdout.write(rendered.text)
        return 0

    from q27py.tokenizer import Tokenizer  # only --json needs the vocabulary

    tokenizer = Tokenizer.from_model_dir(args.model)
    ids, _, stable = encode_rendered(tokenizer, rendered)  # split-encoded as the server does
    out = {"prompt": rendered.text, "token_ids": ids, "stable_len": stable, "stable_chars": rendered.stable_len}
    sys.stdout.write(json.dumps(out, ensure_ascii=False) + "\n")
    return 0
