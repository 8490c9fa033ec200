"""What the engine tests hand engine/scheduler.py: a Job records every delivery (and appends it to a shared
log, as (name, item), or (tag, name, item) when the test interleaves deliveries with other events), and drain
runs the scheduler's rounds until it is idle. Shared by test_scheduler, test_batched_rounds and
test_mtp_warm_deferred."""

from __future__ import annotations

import time

from q27py.engine.api import GenerationChunk


class Job:
    """What the bridge hands the scheduler, recording every delivery."""

    def __init__(self, name, request, log=None, tag=None):
        self.name, self.request, self.log, self.tag = name, request, log if log is not None else [], tag
        self.submitted = time.monotonic()
        self.items = []

    def deliver(self, item):
        self.items.append(item)
        self.log.append((self.name, item) if self.tag is None else (self.tag, self.name, item))

    @property
    def tokens(self):
        return [t for c in self.items if isinstance(c, GenerationChunk) for t in c.token_ids]

    @property
    def logprobs(self):
        return [(r.token, r.logprob, r.top) for c in self.items if isinstance(c, GenerationChunk)
                for r in (c.logprobs or [])]

    @property
    def finish(self):
        last = self.items[-1] if self.items else None
        return last.finish_reason if isinstance(last, GenerationChunk) else None

    @property
    def stats(self):
        return self.items[-1].stats


def drain(sched, limit=10000) -> int:
    """Scheduler rounds until nothing is left to do; the number of rounds (fails past `limit`)."""
    n = 0
    while sched.wait(timeout=0):
        sched.round()
        n += 1
        assert n < limit, "scheduler never went idle"
    return n
