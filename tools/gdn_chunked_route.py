"""pytest plugin for tools/device_gdn.sh (stages "engine" / "engine2"): runs the model-level GPU tests
with a chunked GDN prefill route on (GDN_ROUTE: "chunked", the default, or "chunked2"), without
changing the shipped default (EngineConfig.gdn_prefill)."""

from __future__ import annotations

import functools
import os


def pytest_configure(config):
    from q27py.config import EngineConfig
    from q27py.gpu import kernels

    route = kernels.gdn_prefill_mode(os.environ.get("GDN_ROUTE", "chunked"))
    kernels.GDN_PREFILL = route  # FastModel built directly (tests/gpu/test_forward.py)
    init = EngineConfig.__init__

    @functools.wraps(init)
    def chunked_init(self, *args, **kwargs):  # load_fast_model copies EngineConfig.gdn_prefill into kernels
        kwargs.setdefault("gdn_prefill", route)
        init(self, *args, **kwargs)

    EngineConfig.__init__ = chunked_init
