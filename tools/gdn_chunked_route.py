"""pytest plugin for tools/device_gdn.sh (stage "engine"): runs the model-level GPU tests with the
chunked GDN prefill route on, without changing the shipped default (EngineConfig.gdn_prefill)."""

from __future__ import annotations

import functools


def pytest_configure(config):
    from q27py.config import EngineConfig
    from q27py.gpu import kernels

    kernels.GDN_PREFILL = "chunked"  # FastModel built directly (tests/gpu/test_forward.py)
    init = EngineConfig.__init__

    @functools.wraps(init)
    def chunked_init(self, *args, **kwargs):  # load_fast_model copies EngineConfig.gdn_prefill into kernels
        kwargs.setdefault("gdn_prefill", "chunked")
        init(self, *args, **kwargs)

    EngineConfig.__init__ = chunked_init
