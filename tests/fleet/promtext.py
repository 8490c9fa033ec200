"""A strict reader of the Prometheus text exposition (0.0.4), for tests: families, samples, histograms."""

from __future__ import annotations

import math
import re

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(,|$)')


def _value(text: str) -> float:
    if text == "+Inf":
        return math.inf
    if text == "-Inf":
        return -math.inf
    return float(text)


def parse(text: str) -> dict:
    """{family: {"type": kind, "samples": [(name, labels, value)]}}; raises on anything malformed."""
    families: dict[str, dict] = {}
    current = None
    assert text.endswith("\n"), "exposition must end with a newline"
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram"), line
            assert name not in families, f"family {name} typed twice"
            families[name] = current = {"type": kind, "samples": []}
            continue
        m = SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        name, _, body, value = m.groups()
        labels = {}
        if body:
            pos = 0
            while pos < len(body):
                lm = LABEL.match(body, pos)
                assert lm, f"bad labels in {line!r}"
                labels[lm.group(1)] = lm.group(2)
                pos = lm.end()
        family = name if name in families else re.sub(r"_(bucket|sum|count)$", "", name)
        assert family in families and families[family] is current, f"sample {name} outside its family"
        current["samples"].append((name, labels, _value(value)))
    return families


def value(families: dict, name: str, **labels) -> float:
    """The one sample `name` whose labels include `labels`."""
    family = families[name if name in families else re.sub(r"_(bucket|sum|count)$", "", name)]
    found = [v for n, lab, v in family["samples"] if n == name and all(lab.get(k) == str(x) for k, x in labels.items())]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def histogram(families: dict, name: str) -> dict:
    """{"buckets": [(le, cumulative count)], "sum": s, "count": n}, checked for consistency."""
    fam = families[name]
    assert fam["type"] == "histogram", name
    buckets = [(float(lab["le"]) if lab["le"] != "+Inf" else math.inf, v)
               for n, lab, v in fam["samples"] if n == name + "_bucket"]
    total = value(families, name + "_sum")
    count = value(families, name + "_count")
    bounds = [b for b, _ in buckets]
    assert bounds == sorted(bounds) and bounds[-1] == math.inf, bounds
    counts = [c for _, c in buckets]
    assert counts == sorted(counts), f"{name}: buckets not cumulative {counts}"
    assert counts[-1] == count, f"{name}: +Inf bucket {counts[-1]} != count {count}"
    return {"buckets": buckets, "sum": total, "count": count}
