"""LocalEngine: one model on this machine behind the narrow Engine API (engine/api.py).

It owns the model (numpy reference on the CPU, the CUDA fast path on a GPU), the
tokenizer, the live sequence state, and turns a GenerationRequest into a stream
of GenerationChunks: tokens from the decoder, UTF-8-safe text from an
incremental detokenizer, text stop strings applied without ever emitting past a
match (even when a speculative round commits several tokens at once).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

from q27py.config import Q27Config
from q27py.engine.api import GenerationChunk, GenerationRequest
from q27py.engine.decoder import DecodeStats, build_decoder
from q27py.engine.prefix_cache import DiskCache, PrefixCache, compat_hash
from q27py.errors import Q27Error


class ContextLengthError(Q27Error):
    def __init__(self, prompt_tokens: int, max_context: int):
        super().__init__(f"prompt is too long: {prompt_tokens} tokens > {max_context} maximum")
        self.prompt_tokens = prompt_tokens
        self.max_context = max_context


def load_model(cfg: Q27Config):
    """The forward-pass object for cfg.engine.device: same interface on both paths."""
    e = cfg.engine
    if e.backend not in ("auto", "fast", "reference"):
        raise Q27Error(f"unknown backend {e.backend!r} (auto | fast | reference)")
    if e.device == "cpu" and (e.backend == "fast" or (e.backend == "auto" and e.dtype == "float32")):
        from q27py.model.fastcpu import FastCPUModel  # the reference's math, arranged for speed

        return FastCPUModel.load(e.model_dir, dtype=e.dtype)
    if e.device == "cpu" or e.backend == "reference":
        from q27py.model.reference import ReferenceModel

        return ReferenceModel.load(e.model_dir, dtype=e.dtype)
    if e.device == "cuda":
        from q27py.gpu.forward import load_fast_model  # imports cupy

        return load_fast_model(cfg)
    raise Q27Error(f"unknown device {e.device!r} (cpu | cuda)")


class StopStringFilter:
    """Holds back the text tail that could still become a stop string; cuts at the first match."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; returns (text safe to emit, stopped)."""
        self.pending += text
        if self.stops:
            hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
            if hits:
                out = self.pending[: min(hits)]
                self.pending = ""
                return out, True
        cut = len(self.pending) - self.hold if self.stops else len(self.pending)
        out, self.pending = self.pending[: max(cut, 0)], self.pending[max(cut, 0):]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class LocalEngine:
    def __init__(self, cfg: Q27Config, model, tokenizer):
        self.cfg = cfg
        self.model = model
        self.tokenizer = tokenizer
        self.model_config = model.cfg
        source = Path(cfg.engine.model_dir)
        # A repacked .q27 file keeps its tokenizer and template files in its own folder.
        self.model_dir = source if source.is_dir() or not source.exists() else source.parent
        self.model_name = source.stem if source.is_file() else source.name
        self.max_context = min(cfg.engine.max_context, self.model_config.max_position_embeddings)
        self.has_mtp = bool(getattr(model, "has_mtp", False))
        self.chat_template = _detect_template(self.model_dir)
        self.decoder = build_decoder(model, cfg)  # speculative unless cfg.spec.enabled is False
        self.prefix = PrefixCache(model, max_sequences=cfg.engine.max_sequences,
                                  checkpoint_every=cfg.engine.checkpoint_every, disk=self._disk_cache(cfg))
        special = getattr(tokenizer, "special_ids", {}) or {}
        self._im_start, self._im_end = special.get("<|im_start|>"), special.get("<|im_end|>")
        system, newline = tokenizer.encode("system", allow_special=False), tokenizer.encode("\n", allow_special=False)
        self._system_id = system[0] if len(system) == 1 else None
        self._newline = newline[0] if len(newline) == 1 else None

    def _disk_cache(self, cfg: Q27Config):
        e = cfg.engine
        if e.prefix_cache_dir is None:
            return None
        compat = compat_hash(Path(e.model_dir), self.model_config, e.tier, getattr(self.model, "state_format", "?"))
        return DiskCache(Path(e.prefix_cache_dir), compat, max_bytes=e.prefix_cache_max_bytes)

    @classmethod
    def load(cls, cfg: Q27Config) -> "LocalEngine":
        from q27py.tokenizer import Tokenizer

        model = load_model(cfg)
        source = Path(cfg.engine.model_dir)
        return cls(cfg, model, Tokenizer.from_model_dir(source.parent if source.is_file() else source))

    def check_context(self, prompt_tokens: int) -> None:
        if prompt_tokens >= self.max_context:
            raise ContextLengthError(prompt_tokens, self.max_context)

    def generate(self, request: GenerationRequest) -> Iterator[GenerationChunk]:
        t0 = time.perf_counter()
        prompt = list(request.prompt_ids)
        self.check_context(len(prompt))
        max_tokens = max(0, min(request.max_tokens, self.max_context - len(prompt)))
        seq, reused = self.prefix.acquire(prompt)
        stats = DecodeStats()
        detok = self.tokenizer.new_decoder()
        stops = StopStringFilter(tuple(request.stop_strings))
        generated: list[int] = []
        finish = "length"
        first_token_at = None
        breaks = self._prefill_breaks(seq, prompt, request.stable_len)
        rounds = self.decoder.run(seq.state, prompt, max_tokens, request.sampling, request.stop_ids, request.cancel,
                                  stats, prefill_breaks=breaks) if max_tokens else iter(())
        healthy = False
        try:
            for tokens in rounds:
                if first_token_at is None:
                    first_token_at = time.perf_counter()
                text_ids = [t for t in tokens if t not in request.stop_ids]
                hit_eos = len(text_ids) != len(tokens)
                generated.extend(tokens)
                text, stopped = stops.push(detok.feed(text_ids))
                if stopped:
                    finish = "stop_string"
                    yield GenerationChunk(tokens, text)
                    break
                if hit_eos:
                    finish = "stop"
                    yield GenerationChunk(tokens, text + stops.push(detok.flush())[0] + stops.flush())
                    break
                yield GenerationChunk(tokens, text)
            else:
                if request.cancel.is_set():
                    finish = "cancelled"
                tail, stopped = stops.push(detok.flush())
                if stopped:
                    finish = "stop_string"
                else:
                    tail += stops.flush()
                if tail:
                    yield GenerationChunk([], tail)
            healthy = True
        finally:
            if hasattr(rounds, "close"):
                rounds.close()  # the decoder puts the state at rest (MTP rows) in its finally
            # The state holds what was committed; anything else (an error mid-forward) is
            # not trusted again: the slot is dropped.
            self.prefix.release(seq, (prompt + generated)[: seq.state.position], healthy)
        elapsed = time.perf_counter() - t0
        final_stats = {
            "prompt_tokens": len(prompt),
            "cached_tokens": reused,
            "generated_tokens": len(generated),
            "seconds": elapsed,
            "ttft_seconds": (first_token_at - t0) if first_token_at else None,
            "tokens_per_s": len(generated) / elapsed if elapsed > 0 else 0.0,
            **stats.as_dict(),
        }
        yield GenerationChunk([], "", finish_reason=finish, stats=final_stats)

    def _prefill_breaks(self, seq, prompt: list[int], stable_len: int | None) -> dict:
        """Callbacks at the positions where prefill must stop and save GDN state."""
        marks = self.prefix.snapshot_positions(seq.state.position, prompt, stable_len, self._system_len(prompt))

        def saver(kind):
            def save(state):
                seq.tokens = prompt[: state.position]
                self.prefix.save(seq, kind)
            return save

        return {pos: saver(kind) for pos, kind in marks.items()}

    def _system_len(self, prompt: list[int]) -> int | None:
        """End of a leading system turn (`<|im_start|>system ... <|im_end|>\n`): the block that
        different conversations with the same system prompt and tools share."""
        if self._im_start is None or len(prompt) < 3 or prompt[0] != self._im_start or prompt[1] != self._system_id:
            return None
        try:
            end = prompt.index(self._im_end)
        except ValueError:
            return None
        return end + 2 if end + 1 < len(prompt) and prompt[end + 1] == self._newline else end + 1

    def prefix_stats(self) -> dict:
        return self.prefix.usage()


def _detect_template(model_dir: Path) -> str:
    try:
        from q27py.chat.render import detect_template
    except ImportError:
        return "qwen3.6"
    return detect_template(model_dir)
