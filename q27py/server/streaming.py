"""Drive an API's SSE emitter over one turn: the loop all streaming endpoints share.

An emitter has start() -> bytes, on(event) -> bytes, finish(Finish) -> bytes and
failure(message) -> bytes. Closing the generator (the client went away) closes
the turn, which cancels the generation.
"""

from __future__ import annotations

import logging
from contextlib import aclosing

from q27py.server.bridge import EngineFailure
from q27py.server.turn import Finish, TurnPlan, Usage

log = logging.getLogger("q27py.server")


async def stream_turn(svc, plan: TurnPlan, emitter):
    finish = None
    yield emitter.start()
    try:
        async with aclosing(svc.events(plan)) as events:
            async for ev in events:
                if isinstance(ev, Finish):
                    finish = ev
                    yield emitter.finish(ev)
                else:
                    chunk = emitter.on(ev)
                    if chunk:
                        yield chunk
    except EngineFailure as exc:
        log.error("generation failed mid-stream: %s", exc)
        finish = Finish("error", Usage(len(plan.prompt_ids)), error=str(exc))
        yield emitter.failure("the engine failed while generating; see the server log")
    except Exception:  # a bug past the first byte: end the stream in the API's error form
        log.exception("streaming failed")
        finish = Finish("error", Usage(len(plan.prompt_ids)))
        yield emitter.failure("internal error while streaming; see the server log")
    finally:
        svc.record(finish if finish is not None else Finish("cancelled", Usage(len(plan.prompt_ids))))
