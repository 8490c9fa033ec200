"""LocalEngine: one model on this machine behind the narrow Engine API (engine/api.py).

It owns the model (numpy reference on the CPU, the CUDA fast path on a GPU), the
tokenizer (its callers read it; the engine itself works in token ids only), the
live sequence states and the prefix cache, and turns a GenerationRequest into a
stream of GenerationChunks of token ids. Text (detokenizing, stop strings, the
think / tool-call split) is the caller's text stage: q27py/chat/textstage.py.

Several requests may be in flight at once (up to max_slots, the scheduler's slots:
engine/scheduler.py): each `steps()` generator holds its own live sequence (acquired
from the prefix cache, which never hands a busy one out twice) and advances by one
bounded unit per resume, so the scheduler interleaves them on the one model. With
EngineConfig.batch_rounds on (and a model with decode_batch) the scheduler also shares
decode rounds: each decoding slot hands out one lane group (a chunk carrying it: its pending
token, and its drafts where the sweep carries them, `sweep_lanes`), `run_lanes` runs them all
in one weight sweep (model.decode_batch, or verify_batch + commit_batch for groups with drafts),
and each slot finishes its round from its group.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

from q27py.config import Q27Config, fixed_max_context
from q27py.engine.api import (ContextLengthError, GenerationChunk, GenerationRequest, OutputConstraint, check_prompt,
                              clamp_max_tokens)
from q27py.engine.constraint import ConstraintCache, ConstraintRun, VocabIndex
from q27py.engine.decoder import DecodeStats, Lane, Pace, PrefillCancelled
from q27py.engine.prefix_cache import BOUNDARY_KINDS, DiskCache, PrefixCache, compat_hash
from q27py.engine.sampling import TokenPicker
from q27py.engine.spec import DraftCall, SpecDecoder, build_decoder
from q27py.errors import ConfigError, Q27Error

__all__ = ["ContextLengthError", "LocalEngine", "load_model", "sweep_parts"]


def _per_part(parts: list[list], name: str, call, deliver) -> None:
    """The shared forward's batches (run_lanes, run_drafts): call(part) -> one output per item, then
    deliver(part, outputs); a failure (or a wrong output count) fails the items of its part only
    (item.fail(exc): their slots' steppers raise it), and the other parts go on."""
    for part in parts:
        try:
            outs = call(part)
            if len(outs) != len(part):
                raise RuntimeError(f"{name} returned {len(outs)} outputs for {len(part)}")
        except Exception as exc:
            for item in part:
                item.fail(exc)
            continue
        deliver(part, outs)


def sweep_parts(widths: list[int], max_groups: int, max_lanes: int) -> list[list[int]]:
    """Indices of lane groups (their widths, in order) cut into consecutive verify_batch calls of at
    most max_groups groups and max_lanes lanes each. A group wider than max_lanes is refused (the
    scheduler never hands one out: Pace.lanes <= sweep_lanes)."""
    if max_groups < 1 or max_lanes < 1:
        raise RuntimeError("the model has no verify_batch (verify_lanes 0): a shared round cannot carry drafts")
    parts: list[list[int]] = []
    lanes = 0
    for i, w in enumerate(widths):
        if not 1 <= w <= max_lanes:
            raise ValueError(f"a lane group of {w} tokens does not fit a sweep of {max_lanes} lanes")
        if not parts or len(parts[-1]) >= max_groups or lanes + w > max_lanes:
            parts.append([])
            lanes = 0
        parts[-1].append(i)
        lanes += w
    return parts


def load_model(cfg: Q27Config):
    """The forward-pass object for cfg.engine.device: same interface on both paths."""
    e = cfg.engine
    if e.backend not in ("auto", "fast", "reference"):
        raise Q27Error(f"unknown backend {e.backend!r} (auto | fast | reference)")
    # The fast CPU path keeps KV rows in float32; a quantized KV format (a quality study) runs on the
    # reference, which implements every format (model/kvformat.py).
    if e.device == "cpu" and (e.backend == "fast" or (e.backend == "auto" and e.dtype == "float32" and e.kv == "auto")):
        from q27py.model.fastcpu import FastCPUModel  # the reference's math, arranged for speed

        return FastCPUModel.load(e.model_dir, dtype=e.dtype)
    if e.device == "cpu" or e.backend == "reference":
        from q27py.model.reference import ReferenceModel

        return ReferenceModel.load(e.model_dir, dtype=e.dtype, kv=e.kv)
    if e.device == "cuda":
        from q27py.gpu.forward import load_fast_model  # imports cupy

        return load_fast_model(cfg)
    raise Q27Error(f"unknown device {e.device!r} (cpu | cuda)")


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
        # The fast path sized its KV cache (possibly from free memory, max_context "auto"): that is the window.
        window = model.max_pos or fixed_max_context(cfg.engine)
        self.max_context = min(int(window), self.model_config.max_position_embeddings)
        self.has_mtp = bool(model.has_mtp)
        cfg.engine.check_batching()
        cfg.engine.check_prefix_reuse()
        self.decoder = build_decoder(model, cfg)  # speculative unless cfg.spec.enabled is False
        # Batched decode rounds (scheduler.py): asked for, and the model has the batched step (max_batch 0:
        # none, e.g. test doubles; the slots' rounds stay solo).
        self.shares_rounds = cfg.engine.shared_rounds() and model.max_batch > 0
        # which decoding slots share a round (engine/share_policy.py): adaptive only where solo rounds
        # can yield more than one token
        self.batch_spec = cfg.engine.batch_spec if isinstance(self.decoder, SpecDecoder) else "solo-only"
        # the most tokens one of a slot's own rounds can commit (the verify width: every draft accepted); the
        # share policy skips probes that could not pay even at this yield
        self.solo_yield_max = int(self.decoder.width) if isinstance(self.decoder, SpecDecoder) else 1
        # lanes a shared round's sweep takes in all, drafts included (the scheduler shares them out:
        # Pace.lanes): the model's verify_batch width where drafts ride in the sweep, else 0 (plain
        # lanes through decode_batch, one per sharing slot)
        self.sweep_lanes = (int(model.verify_lanes)
                            if self.shares_rounds and self.batch_spec in ("adaptive", "drafts") else 0)
        if self.batch_spec == "drafts" and self.shares_rounds and not self.sweep_lanes:
            # asked for drafts in the sweep of a model that cannot verify groups: say so rather than run plain lanes
            raise ConfigError("batch_spec 'drafts' needs a model with verify_batch (on cuda: EngineConfig.verify_groups, "
                              "Q27_VERIFY_GROUPS=1)")
        # ... and the MTP ladders of a shared round draft in one batch (run_drafts) where the model chains
        # its ladder on the device (drafts_on_device: one call per chain instead of a host round trip
        # per step, so one batch per round instead of one chain per slot)
        self.batch_drafts = bool(self.sweep_lanes and model.drafts_on_device)
        # prefill tokens per round beside decoding slots (0: off, full chunks always)
        self.interleave_chunk = cfg.engine.interleave()
        self.interleave_halving = int(cfg.engine.interleave_halving)  # the piece shrinks with the context
        self.interleave_budget_ms = cfg.engine.interleave_budget()  # the piece adapts to a round budget
        # requests the scheduler may interleave (engine/scheduler.py); "auto" on cuda: the count the
        # model sized from free memory at load (gpu/forward.py size_context_to_memory)
        sized = model.sized_slots
        self.max_slots = cfg.engine.slots(sized)
        # every slot holds its own live sequence, so the cache keeps at least that many
        self.prefix = PrefixCache(model, max_sequences=cfg.engine.live_sequences(sized),
                                  checkpoint_every=cfg.engine.checkpoint_every,
                                  checkpoint_min_piece=cfg.engine.checkpoint_min_piece, disk=self._disk_cache(cfg))
        self.prefix.reserve(1)  # the first request's state, allocated now rather than inside its TTFT
        # Output constraints: the vocabulary index (about 1.5 s for the 248K vocabulary) is built
        # when the server starts (serve calls constraints.prepare(), then gc.freeze), else on the first constrained
        # request; compiled grammars and their masks are kept.
        # (the factory closes over the vocabulary size, not self: an engine in a reference cycle outlives its last
        # reference until the cycle collector runs, and with it its sequences' device snapshots)
        vocab_size = self.model_config.vocab_size
        self.constraints = ConstraintCache(lambda: VocabIndex.from_tokenizer(tokenizer, vocab_size))

    def compile_constraint(self, spec: OutputConstraint, stop_ids=frozenset()) -> ConstraintRun:
        """The request's constraint, compiled (GrammarError names what cannot be compiled)."""
        from q27py.engine.grammar import GrammarError, json_grammar, tool_call_grammar

        if spec.kind == "json_object":
            grammar = json_grammar(None)
        elif spec.kind == "json_schema":
            grammar = json_grammar(spec.schema)
        elif spec.kind == "tool_calls":
            grammar = tool_call_grammar(spec.tools or {}, list(spec.names) or None, spec.max_calls, spec.dialect)
        else:
            raise GrammarError(f"unknown output constraint {spec.kind!r}")
        return ConstraintRun(self.constraints.get(grammar), self.tokenizer.token_bytes, stop_ids,
                             after_think=spec.after_think)

    def _disk_cache(self, cfg: Q27Config):
        e = cfg.engine
        if e.prefix_cache_dir is None:
            return None
        compat = compat_hash(Path(e.model_dir), self.model_config, e.tier, self.model.state_format)
        return DiskCache(Path(e.prefix_cache_dir), compat, max_bytes=e.prefix_cache_max_bytes)

    @classmethod
    def load(cls, cfg: Q27Config) -> "LocalEngine":
        from q27py.tokenizer import Tokenizer

        model = load_model(cfg)
        source = Path(cfg.engine.model_dir)
        return cls(cfg, model, Tokenizer.from_model_dir(source.parent if source.is_file() else source))

    def check_context(self, prompt_tokens: int) -> None:
        check_prompt(prompt_tokens, self.max_context)

    def generate(self, request: GenerationRequest) -> Iterator[GenerationChunk]:
        """Run one request to its end: steps() without the empty progress chunks."""
        for chunk in self.steps(request):
            if chunk.token_ids or chunk.finish_reason is not None:
                yield chunk

    def steps(self, request: GenerationRequest, pace: Pace | None = None) -> Iterator[GenerationChunk]:
        """generate(), resumable one bounded unit at a time: each resume runs one prefill chunk
        (an empty progress chunk comes back) or one decode round (its tokens come back).

        Between two chunks the request holds its live sequence and nothing else: no model
        scratch, no pending forward. So the scheduler may run other requests' steps on the
        same model in between; their states are separate and each forward is whole, so a
        sequence's bits do not depend on what ran beside it (tests/engine/test_scheduler.py).
        Closing the generator early releases the sequence (not kept for reuse).

        pace (the scheduler's, read before every resume: engine/decoder.py Pace): prefill pieces
        capped at pace.prefill_chunk; with pace.shared a decode round comes back as a chunk
        carrying a Lane (no tokens) -- the caller runs it (run_lanes) and resumes, and the round's
        tokens come back then. Without a pace every round runs alone.
        """
        t0 = time.perf_counter()
        prompt = list(request.prompt_ids)
        self.check_context(len(prompt))
        max_tokens = clamp_max_tokens(request.max_tokens, len(prompt), self.max_context)
        seq, reused = self.prefix.acquire(prompt)
        stats = DecodeStats()
        generated: list[int] = []
        finish = "length"
        first_token_at = None
        breaks = self._prefill_breaks(seq, prompt, request.stable_len, request.system_len)
        constraint = self.compile_constraint(request.constraint, request.stop_ids) if request.constraint else None
        picker = TokenPicker(request.sampling, prompt, constraint, request.logprobs, max_tokens=max_tokens,
                             device_masks=self.cfg.engine.device_masks and self.cfg.engine.device == "cuda")
        rounds = self.decoder.run(seq.state, prompt, max_tokens, request.sampling, request.stop_ids, request.cancel,
                                  stats, prefill_breaks=breaks, picker=picker,
                                  pause_prefill=True, pace=pace) if max_tokens else iter(())
        healthy = False
        try:
            for tokens in rounds:
                if isinstance(tokens, Lane):  # a shared round: the scheduler runs its forward
                    yield GenerationChunk([], lane=tokens)
                    continue
                if isinstance(tokens, DraftCall):  # ... and, before it, its MTP chain with the others'
                    yield GenerationChunk([], draft=tokens)
                    continue
                if not tokens:  # a prefill chunk ran: a point where other slots may run
                    yield GenerationChunk([])
                    continue
                if first_token_at is None:
                    first_token_at = time.perf_counter()
                generated.extend(tokens)
                lps = None
                if request.logprobs is not None:  # one record per token, from the row that chose it
                    lps = picker.logprobs[len(generated) - len(tokens):len(generated)]
                yield GenerationChunk(tokens, logprobs=lps)
                # picker.finished: a constrained output is complete and no end id can be emitted
                # (stop_ids empty: TokenPicker.finished); it ends as an end id would.
                if any(t in request.stop_ids for t in tokens) or picker.finished:
                    finish = "stop"
                    break
            else:
                if request.cancel.is_set():
                    finish = "cancelled"
                elif picker.finished:  # (before any token: a constraint that admits nothing)
                    finish = "stop"
            healthy = True
        except PrefillCancelled:
            finish = "cancelled"  # the partly prefilled state is not kept (healthy stays False)
        finally:
            try:
                if hasattr(rounds, "close"):
                    # the decoder puts the state at rest: closed at its first token (a stop id), the
                    # speculative decoder writes the prompt's MTP rows it held back for that token
                    rounds.close()
            except Exception:
                healthy = False  # model work failed while closing: the state is not trusted
                raise
            finally:
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
        yield GenerationChunk([], finish_reason=finish, stats=final_stats)

    def run_lanes(self, lanes: list[Lane]) -> None:
        """The shared forward of a batched round: every lane group (one per sharing slot, distinct
        sequences) through one weight sweep. Plain lanes go through model.decode_batch, max_batch at
        a time; when any group carries drafts, every group goes through model.verify_batch (max_batch
        groups and verify_lanes tokens at a time: a one-token group verified and committed is the
        plain step, bitwise) and commit_batch keeps each group's accepted tokens. Each group reads its
        output (take: picks, hidden rows) straight after its batch and before the next model call, as
        the fast path's scratch rules require. A failure stays with the groups it hit: their slots'
        steppers raise it when resumed (their sequences are dropped); the other groups go on."""
        if any(lane.drafts for lane in lanes):
            self._run_groups(lanes)
            return

        def took(part, outs):
            for lane, out in zip(part, outs):
                try:
                    lane.take(out)
                except Exception as exc:
                    lane.fail(exc)

        step = max(1, int(self.model.max_batch))
        _per_part([lanes[i : i + step] for i in range(0, len(lanes), step)], "decode_batch",
                  lambda part: self.model.decode_batch([lane.state for lane in part], [lane.token for lane in part]),
                  took)

    def run_drafts(self, calls: list[DraftCall]) -> None:
        """The MTP chains of a shared round's ladders (engine/spec.py DraftCall) in model.mtp_draft_batch,
        max_batch at a time, every chain as deep as the deepest (each ladder cuts its own: the extra steps
        only cost device time). A failure stays with the chains it hit: their slots' steppers raise it."""
        def done(part, outs):
            for c, (ids, margins) in zip(part, outs):
                c.done(ids, margins)

        step = max(1, int(self.model.max_batch))
        _per_part([calls[i : i + step] for i in range(0, len(calls), step)], "mtp_draft_batch",
                  lambda part: self.model.mtp_draft_batch(
                      [c.chain.kv for c in part], [c.chain.rows for c in part], [c.chain.next_ids for c in part],
                      [c.chain.start for c in part], max(c.chain.depth for c in part)),
                  done)

    def _run_groups(self, lanes: list[Lane]) -> None:
        """run_lanes with drafts: verify_batch, every group's take, then one commit_batch."""
        def took(part, outs):
            kept = []
            for lane, out in zip(part, outs):
                try:
                    lane.take(out, verified=True)
                    kept.append(lane)
                except Exception as exc:
                    lane.fail(exc)
            if kept:
                try:
                    self.model.commit_batch([lane.state for lane in kept], [lane.trace for lane in kept],
                                            [len(lane.picked) for lane in kept])
                except Exception as exc:
                    for lane in kept:
                        lane.fail(exc)

        parts = sweep_parts([len(lane.tokens) for lane in lanes], int(self.model.max_batch),
                            int(self.model.verify_lanes))
        _per_part([[lanes[i] for i in part] for part in parts], "verify_batch",
                  lambda part: self.model.verify_batch([lane.state for lane in part], [lane.tokens for lane in part]),
                  took)

    def _prefill_breaks(self, seq, prompt: list[int], stable_len: int | None, system_len: int | None) -> dict:
        """Callbacks at the positions where prefill must stop and save GDN state. The caller
        says where the shared blocks end (token offsets); the engine knows no chat layout.
        A checkpoint snapped to the resume point (seq.state.position) saves the restored state
        before the first piece; one snapped to the prompt's end, the state after the last."""
        # the prefill's own chunk cuts (prefill_steps: every chunk tokens from the resume point, starting
        # over at the system / stable marks, decoder.chunk_cuts) are boundaries a checkpoint may snap to as well
        chunk = min(self.decoder.prefill_chunk, self.model.chunk or self.decoder.prefill_chunk)
        marks = self.prefix.snapshot_positions(seq.state.position, prompt, stable_len, system_len,
                                               taken=seq.snapshots, chunk=chunk)

        def saver(kind):
            def save(state):
                seq.tokens = prompt[: state.position]
                self.prefix.save(seq, kind)
            # a disk entry exports the MTP rows: the decoder writes any it held back first (decoder.reads_mtp)
            save.reads_mtp = self.prefix.exports_mtp(kind)
            save.restarts_grid = kind in BOUNDARY_KINDS  # the chunk grid starts over there (decoder.chunk_cuts)
            return save

        return {pos: saver(kind) for pos, kind in marks.items()}

    def prefix_stats(self) -> dict:
        return self.prefix.usage()

    def kv_cache_usage(self) -> float | None:
        """Positions held by the sequences in use over what the slots can hold (vLLM's
        kv_cache_usage_perc: idle sequences kept for prefix reuse count as free, as vLLM's
        cached blocks do). Read from the metrics thread: a snapshot, not locked."""
        held = sum(int(seq.state.position) for seq in list(self.prefix.slots) if seq.busy)
        return min(1.0, held / max(1, self.max_slots * self.max_context))
