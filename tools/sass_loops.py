"""Count the SASS instructions in each kernel's hot loop, from `cuobjdump -sass` text.

    cuobjdump -sass gemv2.cubin > gemv2.sass && python3 tools/sass_loops.py gemv2.sass [more.sass]

The hot loop of a kernel is the backward branch whose body holds the most tensor-core
instructions (HMMA); printed per kernel: its instruction count, the 16-byte weight loads in it
(LDG.E.128 register-direct, or LDGSTS.128 for cp.async rings), instructions per 16 B of weights
per thread, and the opcode histogram. (Reads text only: runs anywhere, no GPU.)
"""

from __future__ import annotations

import collections
import re
import sys

_FUNC = re.compile(r"^\s*Function\s*:\s*(\S+)")
_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_HEX = re.compile(r"0x[0-9a-f]+")


def parse(text: str) -> dict[str, list[tuple[int, str]]]:
    funcs: dict[str, list[tuple[int, str]]] = {}
    cur = None
    for line in text.splitlines():
        m = _FUNC.match(line)
        if m:
            cur = m.group(1)
            funcs[cur] = []
            continue
        m = _INSN.search(line)
        if m and cur:
            funcs[cur].append((int(m.group(1), 16), m.group(2).strip()))
    return funcs


def opcode(insn: str) -> str:
    parts = insn.split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    return parts[0] if parts else ""


def hot_loop(insns: list[tuple[int, str]]):
    """(start, end, instructions) of the backward-branch loop with the most HMMA, or None."""
    best = None
    for addr, text in insns:
        if not opcode(text).startswith("BRA"):  # BRA, BRA.U (uniform predicate forms too)
            continue
        targets = _HEX.findall(text)
        if not targets:
            continue
        target = int(targets[-1], 16)
        if target >= addr:
            continue
        body = [t for a, t in insns if target <= a <= addr]
        hmma = sum(opcode(t).startswith("HMMA") for t in body)
        if hmma and (best is None or hmma > best[3] or (hmma == best[3] and len(body) < len(best[2]))):
            best = (target, addr, body, hmma)
    return best


def weight_loads(body: list[str]) -> int:
    return sum(1 for t in body if (opcode(t).startswith("LDG") or opcode(t).startswith("LDGSTS")) and ".128" in opcode(t))


def report(text: str) -> list[str]:
    lines = []
    for name, insns in parse(text).items():
        loop = hot_loop(insns)
        if loop is None:
            lines.append(f"{name:20s} {len(insns):6d} instructions, no HMMA loop")
            continue
        start, end, body, hmma = loop
        nw = weight_loads(body)
        hist = collections.Counter(opcode(t).split(".")[0] for t in body)
        per = f"{len(body) / nw:6.1f}" if nw else "     -"
        lines.append(f"{name:20s} {len(insns):6d} total; hot loop {start:#x}-{end:#x}: {len(body):5d} instr, "
                     f"{hmma:3d} HMMA, {nw:3d} x 16-B weight loads -> {per} per 16 B")
        lines.append("    " + " ".join(f"{k}:{v}" for k, v in hist.most_common(18)))
    return lines


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    for path in argv:
        with open(path, encoding="utf-8", errors="replace") as f:
            print("\n".join(report(f.read())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
