"""GET /dashboard: a live page served by the server itself (static HTML + one script, no build step).

The page and its script hold no data, so they are served without a key; the
script polls GET /dashboard.json (Metrics.snapshot: totals, gauges and a
timeline of 2-second buckets over the last five minutes), which is behind the
API key like /metrics. The script takes the key from the URL fragment
(`/dashboard#key=...`, never sent to the server or written to its log) or asks
for it, and keeps it in the tab's sessionStorage.

The assets are read once from q27py/server/static/ (package data) and kept in memory.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from q27py.server.http import Response

STATIC_DIR = Path(__file__).resolve().parent / "static"
DATA_PATH = "/dashboard.json"
# path -> (file under static/, content type)
ASSETS = {
    "/dashboard": ("dashboard.html", "text/html; charset=utf-8"),
    "/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
}
PUBLIC_PATHS = tuple(ASSETS)
PATHS = PUBLIC_PATHS + (DATA_PATH,)


@lru_cache(maxsize=None)
def _asset(name: str) -> bytes:
    return (STATIC_DIR / name).read_bytes()


def page(path: str) -> Response:
    name, content_type = ASSETS[path]
    # The page must be self-contained: forbid every external origin, and framing by others.
    headers = [("cache-control", "no-cache"),
               ("content-security-policy", "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; "
                "frame-ancestors 'none'"),
               ("x-content-type-options", "nosniff")]
    return Response(200, _asset(name), content_type, headers)
