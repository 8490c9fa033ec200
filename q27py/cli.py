"""The `q27py` command: one subcommand per job.

Each subcommand lives in its own module under q27py/commands/ and exposes
`add_arguments(parser)` and `run(args) -> int`. Modules are imported only when
their subcommand runs, so `q27py render` never pays for cupy or the server.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
SUBCOMMANDS = {
    "serve": ("q27py.commands.serve", "serve Anthropic / OpenAI / Responses APIs on one port"),
    "generate": ("q27py.commands.generate", "generate from a prompt (greedy or sampled)"),
    "render": ("q27py.commands.render", "render an API request body to the exact prompt text"),
    "repack": ("q27py.commands.repack", "quantize a Hugging Face checkpoint into one .q27 file"),
    "bench": ("q27py.commands.bench", "benchmarks: shortbench, random-weight 27B shapes"),
    "make-tiny": ("q27py.commands.make_tiny", "write a tiny random checkpoint in the exact HF layout"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="q27py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        # Parsers are built lazily only for the command being run (see main);
        # here we only register the name so `q27py --help` lists everything.
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] not in SUBCOMMANDS:
        args = parser.parse_args(argv)  # prints help / errors for unknown commands
        parser.print_help()
        return 2
    name = argv[0]
    module_name, help_text = SUBCOMMANDS[name]
    module = importlib.import_module(module_name)
    sub = argparse.ArgumentParser(prog=f"q27py {name}", description=help_text)
    module.add_arguments(sub)
    args = sub.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a clean one-line error for anticipated failures
        from q27py.errors import Q27Error

        if isinstance(exc, Q27Error):
            print(f"q27py {name}: error: {exc}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    raise SystemExit(main())
