"""Sequence states are allocated once (device run m5: on the 27B a new state -- ~3 GB of KV zero-filled
at a 44K window -- cost 54-107 ms of a cold 25K turn's time to first token):

- the engine allocates its first sequence's state at load, and the first request runs on it;
- a prompt with nothing to reuse, once every sequence is taken, resets the least recently used
  idle one in place (model.reset_state) instead of allocating a new state;
- either way the tokens are those of a fresh state (greedy and sampled, speculation on).
"""

import pytest

from q27py.config import Q27Config
from q27py.engine.api import GenerationRequest, SamplingParams
from q27py.engine.engine import LocalEngine


class Counting:
    """The model, counting new_state / reset_state calls."""

    def __init__(self, inner):
        self._m, self.new_states, self.resets = inner, 0, 0

    def __getattr__(self, name):
        return getattr(self._m, name)

    def new_state(self):
        self.new_states += 1
        return self._m.new_state()

    def reset_state(self, state):
        self.resets += 1
        return self._m.reset_state(state)


def engine(model, tok, sequences):
    cfg = Q27Config()
    cfg.engine.max_slots = 1
    cfg.engine.max_sequences = sequences
    cfg.engine.checkpoint_every = 0
    return LocalEngine(cfg, model, tok)


def run(e, ids, n=12, sampled=False):
    sampling = SamplingParams(temperature=0.8, seed=3) if sampled else SamplingParams()
    return [t for c in e.generate(GenerationRequest(prompt_ids=ids, max_tokens=n, sampling=sampling))
            for t in c.token_ids]


def test_the_first_request_runs_on_the_state_allocated_at_load(fast, tok):
    m = Counting(fast)
    e = engine(m, tok, 2)
    assert m.new_states == 1 and len(e.prefix.slots) == 1, "one state allocated at load"
    reserved = e.prefix.slots[0].state
    out = run(e, tok.encode("def parse(line):\n    "))
    assert m.new_states == 1 and e.prefix.slots[0].state is reserved
    assert out == run(engine(fast, tok, 2), tok.encode("def parse(line):\n    "))


@pytest.mark.parametrize("sampled", [False, True])
def test_an_evicted_sequence_is_reset_in_place_and_gives_a_fresh_states_tokens(fast, tok, sampled):
    prompts = [tok.encode(t) for t in ("The river runs through the old town, and ", "List three colours: ",
                                       "Once upon a time, in a kingdom by the sea, ")]
    m = Counting(fast)
    e = engine(m, tok, 2)
    first = [run(e, p, sampled=sampled) for p in prompts[:2]]
    states = {id(s.state) for s in e.prefix.slots}
    assert len(e.prefix.slots) == 2 and m.new_states == 2
    third = run(e, prompts[2], sampled=sampled)  # nothing to reuse, both sequences taken: evict the older
    assert m.new_states == 2 and m.resets >= 1, "the evicted sequence's state was reset, not replaced"
    assert {id(s.state) for s in e.prefix.slots} == states
    assert e.prefix.slots[0].tokens[: len(prompts[2])] == prompts[2], "the least recently used one went"
    # the same tokens as on states never used before
    assert third == run(engine(fast, tok, 2), prompts[2], sampled=sampled)
    assert first == [run(engine(fast, tok, 2), p, sampled=sampled) for p in prompts[:2]]
