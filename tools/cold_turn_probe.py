"""Where a cold turn's time to first token goes through the engine (device run m5b, 2026-12-05, H100): the
27B random-weights model as `bench replay` builds it, a warm engine holding a 24,471-token sequence, then fresh
engines over the same model running a 25,278-token prompt with bench replay's marks (system 20,234, stable at the
end - 5). Prints each engine-level model call's start / host time / the gap before it, then a cProfile of a
third cold turn. Committed after the run as it ran (this docstring added).

    PYTHONPATH=. python3 tools/cold_turn_probe.py
"""
import os, sys, time, cProfile, pstats, io
os.environ["Q27_PREFILL_WEIGHT_CACHE_GB"] = "60"
sys.path.insert(0, ".")
import numpy as np
from q27py.bench.random_weights import Bench
from q27py.config import Q27Config, apply_env, apply_overrides
from q27py.engine.engine import LocalEngine
from q27py.model.tiny import FULL_TOKENIZER
from q27py.tokenizer import Tokenizer
from q27py.bench.replay import first_token
from q27py.gpu.runtime import Runtime
Runtime.get().warm_all()
N, SYS = 25278, 20234
b = Bench(tier="q4s", max_context=20000 + 2048 * 10 + 4096, chunk=4096, log=lambda *a: None)
m = b.model
ecfg = apply_env(Q27Config())
apply_overrides(ecfg.engine, {"device": "cuda", "tier": "q4s", "max_context": m.max_pos})
tokz = Tokenizer.from_file(FULL_TOKENIZER)
rng = np.random.default_rng(1)
turn = lambda: [int(v) for v in rng.integers(0, m.cfg.vocab_size, N)]
log = []
inner = m.forward
def fwd(state, ids, *a, **k):
    t0 = time.perf_counter(); out = inner(state, ids, *a, **k); log.append(("fwd", len(ids), t0, time.perf_counter())); return out
m.forward = fwd
for name in ("mtp_forward", "save_recurrent", "new_state"):
    f = getattr(m, name)
    def w(*a, _f=f, _n=name, **k):
        t0 = time.perf_counter(); r = _f(*a, **k); log.append((_n, 0, t0, time.perf_counter())); return r
    setattr(m, name, w)
warm = LocalEngine(ecfg, m, tokz)
p0 = turn()
print("warm engine turn", first_token(warm, p0[:24471], 24466, SYS))
cp = Runtime.get().cp
print("pool used GB", cp.get_default_memory_pool().used_bytes() / 1e9, "total", cp.get_default_memory_pool().total_bytes() / 1e9)
for i in range(3):
    e = LocalEngine(ecfg, m, tokz); log.clear(); t = turn()
    r = first_token(e, t, N - 5, SYS); print("cold", i, {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()})
    if i == 1:
        t0 = log[0][2]; prev = None
        for kind, n, a, z in log:
            print(f"{kind:15s} {n:6d} start {1e3*(a-t0):8.1f} ms  host {1e3*(z-a):7.1f} ms" + (f"  gap {1e3*(a-prev):6.1f}" if prev else ""))
            prev = z
    if i == 2:
        pass
    del e
e = LocalEngine(ecfg, m, tokz); t = turn()
pr = cProfile.Profile(); pr.enable(); r = first_token(e, t, N - 5, SYS); pr.disable(); print("profiled cold", r)
buf = io.StringIO(); st = pstats.Stats(pr, stream=buf); st.sort_stats("tottime").print_stats(14); st.sort_stats("cumulative").print_stats(30)
print("\n".join(l for l in buf.getvalue().splitlines() if l.strip())[:9000])
