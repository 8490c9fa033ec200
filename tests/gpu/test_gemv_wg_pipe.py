"""The software-pipelined gemv_wg entries (cuda/gemv_wg.cu wg_body<NL, 1>: gemv8w_q4_n8p / _n16p / _n32p, behind
kernels.GEMV_WG_PIPE / EngineConfig.gemv_wg_pipe / constants GWG_PIPE): bitwise the plain entries.

Schedule (per stage k of a pass, CPS chunks, one chunk's two wgmmas per commit group):
    B1: cp.async wait (stage k landed), fence.proxy.async, barrier; [first stage of a pass: refill + commit]
    issue group 0 of stage k
    [not the first stage: wait_group 1 -> stage k - 1's last group done; its epilogue;
     B2: barrier -> only now is stage k - 1's slot refilled (stage k + S - 1) + commit]
    for e = 1 .. NG - 1: issue group e; wait_group 1 (group e - 1 done); epilogue of group e - 1
and at a pass's end wait_group 0 and the last group's epilogue (n32: before the fold between its passes).

CPU: the kernel's schedule code is pinned by its source text (a change shows here and must come with the
emulation below), and the emulation of that schedule -- copies, commit groups, barriers, wgmma groups and waits,
epilogues -- checks, for 1..40 chunks and the 27B's per-unit chunk counts at all three widths: each accumulator
receives the same terms in the same order as the plain walk (the whole epilogue sequence is the plain one, and
the fp32 result bit for bit gemv.cu's); an epilogue reads its results only after a wait that covers their group
and no in-flight group's registers are rewritten; a ring slot is refilled only after every wgmma reading it is
covered by a wait and every epilogue reading it is done, with a barrier between; every wgmma reads a stage that
landed before a barrier. The sm_90a build: no spills, wgmma asynchronous (no serialization), wait_group 1 only
in the pipelined entries. A recorded plan picks the *p entries with the switch on and the plain ones with it off.
GPU (next device session): the *p entries bit for bit the plain ones (and gemv8_q4_*) on the 27B launches at
1 / 8 / 9 / 16 / 17 / 32 lanes and under forced splits.
"""

from __future__ import annotations

import re
import subprocess

import numpy as np
import pytest

from q27py.gpu import constants as C
from q27py.gpu import layout as L

try:
    import nvcc_build
    from test_gemv_wg import _PlanRt, _plan, _specs_27b, gemv8_order_sum, plan_inputs, run_plan, stage_walk
except ImportError:  # run from the repository root
    from tests.gpu import nvcc_build
    from tests.gpu.test_gemv_wg import (_PlanRt, _plan, _specs_27b, gemv8_order_sum, plan_inputs, run_plan,
                                        stage_walk)

NVCC = nvcc_build.NVCC
ENTRIES = ("gemv8w_q4_n8", "gemv8w_q4_n16", "gemv8w_q4_n32")


def _src() -> str:
    from q27py.gpu.runtime import CUDA_DIR

    return (CUDA_DIR / "gemv_wg.cu").read_text(encoding="utf-8")


def _block(src: str, head: str) -> list[str]:
    """The statements of the brace block opened by the line `head` (comments and blank lines dropped, each line
    stripped): what the schedule tests pin."""
    i = src.index(head)
    j = src.index("{", i + len(head) - 1)
    depth, k = 0, j
    while True:
        depth += {"{": 1, "}": -1}.get(src[k], 0)
        if depth == 0:
            break
        k += 1
    lines = [re.sub(r"//.*", "", ln).strip() for ln in src[j + 1: k].splitlines()]
    return [ln for ln in lines if ln]


# ---------------------------------------------------------------- the schedule's source, pinned
PSTAGE = [
    "constexpr int PAR = decltype(par)::value;",
    "constexpr bool PREV = decltype(prev)::value;",
    "cp_async_wait<S - 2>();",
    "wg_fence_proxy();",
    "__syncthreads();",
    "if constexpr (!PREV) {",
    "if (k + S - 1 < nst) issue(wr, k + S - 1, true, true);",
    "cp_async_commit();",
    "}",
    "issue_grp(0);",
    "if constexpr (PREV) {",
    "wg_wait1();",
    "epi_grp(prd, k - 1, NG - 1, WgPar<PASSES == 1 ? 1 - PAR : 0>(), WgPar<1>());",
    "__syncthreads();",
    "if (k + S - 1 < nst) issue(wr, k + S - 1, true, true);",
    "cp_async_commit();",
    "}",
    "#pragma unroll",
    "for (int e = 1; e < NG; e++) {",
    "issue_grp(e);",
    "wg_wait1();",
    "epi_grp(rd, k, e - 1, par, full);",
    "}",
    "prd = rd;",
    "rd = rd + 1 == S ? 0 : rd + 1;",
    "wr = wr + 1 == S ? 0 : wr + 1;",
]
DRAIN = ["wg_wait0();", "epi_grp(prd, k, NG - 1, par, full);"]
PPASS = [
    "if (kb >= ke) return;",
    "int k = kb;",
    "if (k < kf) {",
    "pstage(k, WgPar<0>(), WgPar<1>(), WgPar<0>());",
    "#pragma unroll 1",
    "for (k++; k < kf; k++) pstage(k, WgPar<0>(), WgPar<1>(), WgPar<1>());",
    "}",
    "if (k < ke) {",
    "if (k == kb)",
    "pstage(k, WgPar<0>(), WgPar<0>(), WgPar<0>());",
    "else",
    "pstage(k, WgPar<0>(), WgPar<0>(), WgPar<1>());",
    "drain(k, WgPar<0>(), WgPar<0>());",
    "} else {",
    "drain(k - 1, WgPar<0>(), WgPar<1>());",
    "}",
]
WALK1 = [  # PASSES = 1 (8 / 16 lanes), inside `if constexpr (PIPE)`
    "if (nfull > 0) {",
    "pstage(0, WgPar<0>(), WgPar<1>(), WgPar<0>());",
    "#pragma unroll 1",
    "for (k = 1; k + 1 < nfull; k += 2) {",
    "pstage(k, WgPar<1>(), WgPar<1>(), WgPar<1>());",
    "pstage(k + 1, WgPar<0>(), WgPar<1>(), WgPar<1>());",
    "}",
    "if (k < nfull) {",
    "pstage(k, WgPar<1>(), WgPar<1>(), WgPar<1>());",
    "k++;",
    "}",
    "}",
    "if (k < nst) {",
    "if (k == 0) {",
    "pstage(k, WgPar<0>(), WgPar<0>(), WgPar<0>());",
    "drain(k, WgPar<0>(), WgPar<0>());",
    "} else if (k & 1) {",
    "pstage(k, WgPar<1>(), WgPar<0>(), WgPar<1>());",
    "drain(k, WgPar<1>(), WgPar<0>());",
    "} else {",
    "pstage(k, WgPar<0>(), WgPar<0>(), WgPar<1>());",
    "drain(k, WgPar<0>(), WgPar<0>());",
    "}",
    "} else if (k & 1) {",
    "drain(k - 1, WgPar<0>(), WgPar<1>());",
    "} else {",
    "drain(k - 1, WgPar<1>(), WgPar<1>());",
    "}",
]


def test_schedule_source_is_the_emulated_one():
    """pstage / drain / ppass and the 8 / 16-lane walk are exactly what the emulation below runs (a change to the
    kernel's schedule fails here first: change the emulation with it)."""
    s = _src()
    assert _block(s, "auto pstage = [&](int k, auto par, auto full, auto prev) {") == PSTAGE
    assert _block(s, "auto drain = [&](int k, auto par, auto full) {") == DRAIN
    assert _block(s, "auto ppass = [&](int kb, int ke, int kf) {") == PPASS
    walk = s[s.index("    if constexpr (PASSES == 1) {\n        int k = 0;\n        if constexpr (PIPE) {"):]
    assert _block(walk, "if constexpr (PIPE) {") == WALK1
    two = s[s.index("        // the first pass (residues 0 .. CPS - 1)"):]
    assert two.index("ppass(0, nst0, nfull0);") < two.index("v[i][q] = acc[0][i][q];") \
        < two.index("ppass(nst0, nst, nst0 + nfull1);") < two.index("cp_async_wait<0>();")
    # one chunk a commit group, the groups' results in two alternating register sets, the epilogue's arithmetic
    # stage()'s (its accumulator index and the chunks it drops)
    for expr in ("constexpr int GC = 1, NG = CPS / GC;", "int dh[2][GC][ND];",
                 "wg_mma<NL, 0>(dh[e & 1][jj], a[jj][0], xd + (j * SG::XC >> 4));",
                 "wg_mma<NL, 1>(dh[e & 1][jj], a[jj][1], xd + ((j * SG::XC + NL * 32) >> 4));",
                 "for (int jj = 0; jj < GC; jj++) wg_reg_fence(dh[e & 1][jj]);",
                 "const int j = e * GC + jj;"):
        assert expr in s, expr
    epi = _block(s, "auto epi_grp = [&](int slot, int k, int e, auto par, auto full) {")
    plain = _block(s, "auto stage = [&](int k, auto par, auto full) {")
    # the per-chunk arithmetic: stage()'s lines with dd[j] as dh[e & 1][jj]
    core = plain[plain.index("constexpr int R0 = PASSES == 1 ? PAR * CPS : 0;"):]
    mine = epi[epi.index("constexpr int R0 = PASSES == 1 ? PAR * CPS : 0;"):]
    assert [ln.replace("dh[e & 1][jj]", "dd[j]") for ln in mine] == core
    # issue_grp: the group's A fragments exactly as stage() unpacks them, then the fence, then its wgmmas
    grp = _block(s, "auto issue_grp = [&](int e) {")
    assert grp.index("wg_fence();") < grp.index("wg_commit();")
    # (both walks unpack through the one helper wg_load_a, at the same chunk's bytes)
    assert "wg_load_a(rbase + rd * SG::BYTES + (e * GC + jj) * SG::WC, g, sgn, a[jj]);" in "\n".join(grp)
    assert "wg_load_a(rbase + rd * SG::BYTES + j * SG::WC, g, sgn, a[j]);" in "\n".join(plain)
    assert "wg_wait1() { asm volatile(\"wgmma.wait_group.sync.aligned 1;\" ::: \"memory\"); }" in s
    assert "GWG_KERNEL(gemv8w_q4_n8p, 8, GWG_CTAS_N8, 1)" in s and "GWG_KERNEL(gemv8w_q4_n32, 32, GWG_CTAS_N32, 0)" in s


def test_plain_walk_is_untouched():
    """PIPE = 0 keeps today's stage(): one commit group per stage, wait_group 0, the refill at the stage's top."""
    plain = _block(_src(), "auto stage = [&](int k, auto par, auto full) {")
    order = ["cp_async_wait<S - 2>();", "__syncthreads();", "if (k + S - 1 < nst) issue(wr, k + S - 1, true, true);",
             "cp_async_commit();", "wg_fence();", "wg_commit();", "wg_wait0();"]
    idx = [plain.index(x) for x in order]
    assert idx == sorted(idx) and plain.count("wg_commit();") == 1 and "wg_wait1();" not in plain


# ---------------------------------------------------------------- the emulation
class _Sim:
    """One CTA of wg_body<NL, PIPE> over a unit of nch chunks, as the kernel's statements run (every thread runs the
    same program; a barrier orders all of them). Tracks the ring slots' contents, the cp.async commit groups, the
    wgmma commit groups (register set, slot read, done, epilogue done) and the epilogues' (accumulator, chunk) terms;
    asserts the rules at each step."""

    def __init__(self, nch: int, nl: int):
        self.S, self.CPS, W = C.GWG_STAGES, C.GWG_CPS, C.GEMV_WARPS
        self.GC = 1
        self.NG = self.CPS // self.GC
        self.PASSES = 2 if nl > C.GEMV_MAX_LANES else 1
        self.nch = nch
        P1, cps = self.PASSES == 1, self.CPS
        self.nst0 = (nch + cps - 1) // cps if P1 else (nch + W - 1) // W
        self.nfull0 = nch // cps if P1 else (nch + cps) // W
        self.nst1 = 0 if P1 else (nch + W - 1 - cps) // W
        self.nfull1 = 0 if P1 else nch // W
        self.nst = self.nst0 + self.nst1
        self.nfull = nch // cps
        self.rd, self.wr, self.prd = 0, self.S - 1, 0
        self.slot = {}  # slot -> stage whose copies were issued into it last
        self.cp_groups = [[]]  # cp.async commit groups (the last one open): stages copied
        self.landed = set()  # stages whose commit group this thread has waited for
        self.visible = set()  # ... and that a barrier has published (after the proxy fence)
        self.proxy_fenced = False
        self.bars = 0
        self.groups = []  # wgmma commit groups: dict(k, e, slot, reg, done, done_bar, epi, epi_bar)
        self.terms = []  # the epilogues' (acc index, chunk), in order; "fold" between the passes
        self.loaded = []

    # -- the kernel's helpers
    def first(self, k):
        W, cps = C.GEMV_WARPS, self.CPS
        if self.PASSES == 1:
            return k * cps
        return W * k if k < self.nst0 else W * (k - self.nst0) + cps

    def issue(self, slot, k):  # issue(slot, k, true, true): stage k's copies into `slot`
        # the slot's previous stage: every wgmma group reading it done and its epilogue done, both before the
        # last barrier (every thread's), and nothing of it pending
        for g in self.groups:
            if g["slot"] == slot:
                assert g["done"] and g["epi"], ("slot refilled under a live group", slot, k, g)
                assert g["done_bar"] < self.bars and g["epi_bar"] < self.bars, ("no barrier after the release", g)
        self.slot[slot] = k
        self.cp_groups[-1].append(k)
        self.loaded.append(k)

    def cp_async_commit(self):
        self.cp_groups.append([])

    def cp_async_wait(self, n):  # all but the newest n committed groups complete
        committed = self.cp_groups[:-1]
        for grp in committed[: max(0, len(committed) - n)]:
            self.landed.update(grp)
        self.proxy_fenced = False

    def wg_fence_proxy(self):
        self.proxy_fenced = True

    def syncthreads(self):
        if self.proxy_fenced:
            self.visible |= self.landed
        self.bars += 1

    def issue_grp(self, k, e):
        rd = self.rd
        assert self.slot.get(rd) == k and k in self.visible, ("wgmma on a stage not landed / published", k)
        reg = e & 1
        # no group whose results are still to be read (in flight, or done but before its epilogue) in this set
        assert all(g["epi"] for g in self.groups if g["reg"] == reg), ("register set rewritten while live", k, e)
        self.groups.append(dict(k=k, e=e, slot=rd, reg=reg, done=False, done_bar=None, epi=False, epi_bar=None))
        assert sum(not g["done"] for g in self.groups) <= 2

    def wg_wait(self, n):
        pend = [g for g in self.groups if not g["done"]]
        for g in pend[: max(0, len(pend) - n)]:
            g["done"], g["done_bar"] = True, self.bars

    def epi_grp(self, slot, k, e, par, full):
        g = [g for g in self.groups if g["k"] == k and g["e"] == e]
        assert len(g) == 1 and g[0]["slot"] == slot and self.slot[slot] == k, (k, e)
        g = g[0]
        assert g["done"] and not g["epi"], ("epilogue before its wait", k, e)
        g["epi"], g["epi_bar"] = True, self.bars
        r0 = par * self.CPS if self.PASSES == 1 else 0
        for jj in range(self.GC):
            j = e * self.GC + jj
            if not full and self.first(k) + j >= self.nch:
                continue
            self.terms.append((r0 + j, self.first(k) + j))

    # -- the kernel's lambdas (PSTAGE, DRAIN, PPASS above, statement by statement)
    def pstage(self, k, par, full, prev):
        S = self.S
        self.cp_async_wait(S - 2)
        self.wg_fence_proxy()
        self.syncthreads()
        if not prev:
            if k + S - 1 < self.nst:
                self.issue(self.wr, k + S - 1)
            self.cp_async_commit()
        self.issue_grp(k, 0)
        if prev:
            self.wg_wait(1)
            self.epi_grp(self.prd, k - 1, self.NG - 1, 1 - par if self.PASSES == 1 else 0, True)
            self.syncthreads()
            assert self.wr == self.prd
            if k + S - 1 < self.nst:
                self.issue(self.wr, k + S - 1)
            self.cp_async_commit()
        for e in range(1, self.NG):
            self.issue_grp(k, e)
            self.wg_wait(1)
            self.epi_grp(self.rd, k, e - 1, par, full)
        self.prd = self.rd
        self.rd = 0 if self.rd + 1 == S else self.rd + 1
        self.wr = 0 if self.wr + 1 == S else self.wr + 1

    def drain(self, k, par, full):
        self.wg_wait(0)
        self.epi_grp(self.prd, k, self.NG - 1, par, full)

    def ppass(self, kb, ke, kf):
        if kb >= ke:
            return
        k = kb
        if k < kf:
            self.pstage(k, 0, True, False)
            k += 1
            while k < kf:
                self.pstage(k, 0, True, True)
                k += 1
        if k < ke:
            self.pstage(k, 0, False, k != kb)
            self.drain(k, 0, False)
        else:
            self.drain(k - 1, 0, True)

    def run(self):
        S = self.S
        for k in range(S - 1):  # the prologue: stage k's weights, then (after the PDL wait) its activations
            if k < self.nst:
                self.issue(k, k)
            self.cp_async_commit()
        if self.PASSES == 1:  # WALK1
            k, nfull, nst = 0, self.nfull, self.nst
            if nfull > 0:
                self.pstage(0, 0, True, False)
                k = 1
                while k + 1 < nfull:
                    self.pstage(k, 1, True, True)
                    self.pstage(k + 1, 0, True, True)
                    k += 2
                if k < nfull:
                    self.pstage(k, 1, True, True)
                    k += 1
            if k < nst:
                if k == 0:
                    self.pstage(k, 0, False, False)
                    self.drain(k, 0, False)
                elif k & 1:
                    self.pstage(k, 1, False, True)
                    self.drain(k, 1, False)
                else:
                    self.pstage(k, 0, False, True)
                    self.drain(k, 0, False)
            elif k & 1:
                self.drain(k - 1, 0, True)
            else:
                self.drain(k - 1, 1, True)
        else:
            self.ppass(0, self.nst0, self.nfull0)
            assert all(g["epi"] for g in self.groups)  # the fold reads every first-pass partial
            self.terms.append("fold")
            self.ppass(self.nst0, self.nst, self.nst0 + self.nfull1)
        self.cp_async_wait(0)
        self.syncthreads()  # the ring becomes the unit's tile: every group done and read before it
        assert all(g["done"] and g["epi"] and g["epi_bar"] < self.bars for g in self.groups)
        assert sorted(self.loaded) == list(range(self.nst)), "each stage copied once"
        assert len(self.groups) == self.nst * self.NG
        return self.terms


def plain_terms(nch: int, nl: int) -> list:
    """The plain walk's epilogue sequence (stage_walk: the order test_gemv_wg checks against gemv.cu's warps)."""
    cps, two = C.GWG_CPS, nl > C.GEMV_MAX_LANES
    npass0 = (nch + C.GEMV_WARPS - 1) // C.GEMV_WARPS
    out = []
    for k, (f, _whole, r0) in enumerate(stage_walk(nch, nl)):
        if two and k == npass0:
            out.append("fold")
        out += [(r0 + j, f + j) for j in range(cps) if f + j < nch]
    if two and "fold" not in out:
        out.append("fold")
    return out


def _unit_chunks_27b() -> list[int]:
    """Every per-unit chunk count the 27B's q4 launches run on an H100 (132 SMs; kernels.choose_splits and the
    kernel's c0 / c1), and the GPU tests' forced splits."""
    from q27py.gpu import kernels as K

    out = set()
    for name in ("gate_up", "down", "gdn_in", "attn_in", "gdn_out", "lm_head"):
        for rows, cols, fmt, _mode in _specs_27b(name):
            if fmt != L.FMT_Q4:
                continue
            kch = L.matrix_shape(rows, cols, fmt).kchunks
            rg = -(-(rows // 16) // C.GEMV_R)
            for s in {K.choose_splits(rg, kch, 132), 1, 2, 3, 5, 7, 9}:
                out.update((sp + 1) * kch // s - sp * kch // s for sp in range(s))
    for cols, s in ((640, 2), (5120, 7), (4096, 9), (320, 1), (17408, 5)):
        kch = cols // 64
        out.update((sp + 1) * kch // s - sp * kch // s for sp in range(s))
    return sorted(out)


@pytest.mark.parametrize("nl", [8, 16, 32])
def test_pipelined_walk_adds_the_same_terms_in_the_same_order(nl):
    """For every chunk count: the emulated pipelined schedule obeys the wgmma, register and ring rules (asserted as it
    runs), and its epilogues add exactly the plain walk's terms in exactly its order -- so each accumulator receives
    the same terms in the same order and the fp32 result is bit for bit gemv.cu's."""
    counts = sorted(set(range(1, 41)) | set(_unit_chunks_27b()))
    assert {80, 272, 96}.issubset(counts)
    rng = np.random.default_rng(nl)
    w = C.GEMV_WARPS
    for nch in counts:
        got = _Sim(nch, nl).run()
        want = plain_terms(nch, nl)
        assert got == want, (nl, nch)
        # each accumulator's chunks in increasing order (the residue walk), every chunk once
        chunks = [c for t in got if t != "fold" for c in [t[1]]]
        assert sorted(chunks) == list(range(nch))
        # the fp32 sums: the schedule's adds against gemv.cu's warps (terms of wildly different scales)
        terms = (rng.standard_normal(nch) * 2.0 ** rng.integers(-30, 30, nch)).astype(np.float32)
        ref = gemv8_order_sum(terms, w)
        acc = [np.float32(0)] * (w // 2 if nl > C.GEMV_MAX_LANES else w)
        v = None
        for t in got:
            if t == "fold":
                v = acc[0]
                for r in range(1, len(acc)):
                    v = np.float32(v + acc[r])
                acc = [np.float32(0)] * len(acc)
                continue
            a, c = t
            acc[a] = np.float32(acc[a] + terms[c])
        if v is None:
            v = acc[0]
            for r in range(1, len(acc)):
                v = np.float32(v + acc[r])
        else:
            for r in range(len(acc)):
                v = np.float32(v + acc[r])
        assert v.view(np.uint32) == ref.view(np.uint32), (nl, nch)


def test_emulation_catches_an_early_release():
    """The emulation's ring check has teeth: refilling stage k - 1's slot at stage k's top (the plain walk's place)
    while its last group is still in flight fails."""

    class Early(_Sim):
        def pstage(self, k, par, full, prev):
            if prev:  # the plain walk's refill point, with the pipelined groups
                S = self.S
                self.cp_async_wait(S - 2)
                self.wg_fence_proxy()
                self.syncthreads()
                if k + S - 1 < self.nst:
                    self.issue(self.wr, k + S - 1)
                self.cp_async_commit()
                raise AssertionError("unreachable: the refill above must fail")
            super().pstage(k, par, full, prev)

    with pytest.raises(AssertionError, match="slot refilled under a live group"):
        Early(80, 16).run()


# ---------------------------------------------------------------- the build
@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
def test_pipelined_entries_build_without_spills_and_wait_for_one_group(tmp_path):
    """sm_90a (the runtime's defines): every entry spill-free within its launch bound, wgmma kept asynchronous (no
    C7510 serialization); the PTX of the *p entries waits with wait_group 1 (and 0 only to drain), the plain
    entries' only with 0."""
    rep = nvcc_build.sm90a_report(tmp_path, "gemv_wg")
    ctas = {"gemv8w_q4_n8": C.GWG_CTAS_N8, "gemv8w_q4_n16": C.GWG_CTAS_N16, "gemv8w_q4_n32": C.GWG_CTAS_N32}
    for name in ENTRIES:
        for k in (name, name + "p"):
            regs, spill = rep[k]
            assert spill == 0 and regs <= min(255, 65536 // (128 * ctas[name])), (k, rep[k])
    from q27py.gpu.runtime import compile_options, source_text

    src = tmp_path / "gemv_wg_ptx.cu"
    src.write_text(source_text("gemv_wg"), encoding="utf-8")
    out = tmp_path / "gemv_wg.ptx"
    r = subprocess.run([NVCC, *compile_options(), *nvcc_build.SM90A, "-ptx", "-o", str(out), str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    ptx = out.read_text()
    bodies = dict(re.findall(r"\.visible \.entry (\w+)\((.*?)\n}\n", ptx, re.S))
    assert sorted(bodies) == sorted([*ENTRIES, *(e + "p" for e in ENTRIES)])
    for name in ENTRIES:
        plain, pipe = bodies[name], bodies[name + "p"]
        assert "wgmma.wait_group.sync.aligned 1;" not in plain and "wgmma.wait_group.sync.aligned 0;" in plain
        assert "wgmma.wait_group.sync.aligned 1;" in pipe
        # one commit group per chunk: as many commits as wgmma pairs
        assert pipe.count("wgmma.commit_group") * 2 == pipe.count("wgmma.mma_async"), name


# ---------------------------------------------------------------- the switch
def test_engine_config_maps_the_switch(monkeypatch):
    from q27py.config import Q27Config, apply_env
    from q27py.gpu import kernels as K

    assert Q27Config().engine.gemv_wg_pipe is False and C.GWG_PIPE == 0
    monkeypatch.setenv("Q27_GEMV_WG_PIPE", "1")
    assert apply_env(Q27Config()).engine.gemv_wg_pipe is True
    assert K._gemv_wg_pipe_default() is True
    monkeypatch.setenv("Q27_GEMV_WG_PIPE", "0")
    assert K._gemv_wg_pipe_default() is False
    monkeypatch.setenv("Q27_GEMV_WG_PIPE", "yes")
    with pytest.raises(ValueError):
        apply_env(Q27Config())


def test_kernel_names(monkeypatch):
    from q27py.gpu import kernels as K

    monkeypatch.setattr(K, "GEMV_WG_PIPE", False)
    assert [K.gemv_wg_kernel(n) for n in (8, 16, 32)] == list(ENTRIES)
    assert K.gemv_wg_kernel(16, pipe=True) == "gemv8w_q4_n16p"
    monkeypatch.setattr(K, "GEMV_WG_PIPE", True)
    assert [K.gemv_wg_kernel(n) for n in (8, 16, 32)] == [e + "p" for e in ENTRIES]
    assert K.gemv_wg_kernel(8, pipe=False) == "gemv8w_q4_n8"
    monkeypatch.setattr(K, "GEMV_WG_PIPE", False)
    monkeypatch.setattr(C, "GWG_PIPE", 1)
    assert K.gemv_wg_kernel(32) == "gemv8w_q4_n32p"


@pytest.fixture
def plan_rt(monkeypatch):
    from q27py.gpu import kernels as K

    rt = _PlanRt()
    monkeypatch.setattr(K.Runtime, "get", staticmethod(lambda: rt))
    return rt


# q4 1024 x 512 beside q8 256 x 512 and bf16 96 x 512: three launches, the q4 one last (largest)
MIXED = [(1024, 512, L.FMT_Q4), (256, 512, L.FMT_Q8), (96, 512, L.FMT_BF16)]


@pytest.mark.parametrize("n", [1, 8, 9, 16, 17, 32])
@pytest.mark.parametrize("pipe", ["off", "switch", "table"])
def test_the_switch_picks_the_entries(plan_rt, monkeypatch, n, pipe):
    """A recorded plan (wgmma "all"): with GEMV_WG_PIPE (or GWG_PIPE) on, each gemv_wg launch is the *p twin of what
    it launches with both off -- the same grid, block, arguments and shared memory; the other launches unchanged."""
    from q27py.gpu import kernels as K

    rt = plan_rt
    runs = {}
    for on in (False, True):
        monkeypatch.setattr(K, "GEMV_WG_PIPE", on and pipe == "switch")
        monkeypatch.setattr(C, "GWG_PIPE", int(on and pipe == "table"))
        rt.calls.clear()
        plan = _plan(rt, MIXED)
        x = rt.cp.zeros((48, plan.kpad), np.float32)
        plan.run(x, plan.kpad, n, allow_gemm=False)
        runs[on] = list(rt.calls)
    off, on = runs[False], runs[True]
    width = 8 if n <= 8 else 16 if n <= 16 else 32
    assert [c.kernel for c in off if c.module == "gemv_wg"] == [f"gemv8w_q4_n{width}"]
    want = [c.kernel + ("p" if c.module == "gemv_wg" and pipe != "off" else "") for c in off]
    assert [c.kernel for c in on] == want
    for a, b in zip(off, on):
        assert (a.module, a.grid, a.block, a.smem, a.cluster) == (b.module, b.grid, b.block, b.smem, b.cluster)
        assert len(a.args) == len(b.args)


def test_off_mode_never_launches_gemv_wg(plan_rt, monkeypatch):
    from q27py.gpu import kernels as K

    rt = plan_rt
    monkeypatch.setattr(K, "GEMV_WG_PIPE", True)
    plan = _plan(rt, MIXED, wgmma="off")
    x = rt.cp.zeros((48, plan.kpad), np.float32)
    plan.run(x, plan.kpad, 16, allow_gemm=False)
    assert [c.kernel for c in rt.calls] == ["quant_act8", "gemv_bf16_nt2", "gemv8_q8_nt2", "gemv8_q4_nt2"]


# ---------------------------------------------------------------- GPU
@pytest.fixture(scope="module")
def cp():
    import cupy

    from q27py.gpu import kernels as K
    from q27py.gpu.runtime import Runtime

    Runtime.get()
    if not K.gemv_wgmma_supported(lanes=K.GWG_MAX_LANES):
        pytest.skip("no sm_90a build of gemv_wg on this card")
    Runtime.get().module("gemv_wg")
    Runtime.get().module("gemv")
    return cupy


def _three(cp, specs, n, partition=None, seed=0, monkeypatch=None):
    """Outputs of one set of matrices (specs [(rows, cols, fmt, mode)]) under the pipelined entries, the plain
    gemv_wg entries and gemv.cu (wgmma "off"), and the gemv_wg kernels the pipelined run launched."""
    from q27py.gpu import kernels as K
    from q27py.gpu.runtime import Runtime

    rt = Runtime.get()
    mats, kpad, rows, x = plan_inputs(cp, K, specs, n, seed)
    outs, seen = {}, []
    for name, wg, pipe in (("pipe", "all", True), ("plain", "all", False), ("off", "off", False)):
        monkeypatch.setattr(K, "GEMV_WG_PIPE", pipe)
        ys = []
        for (r, _, _, mode), _m in zip(specs, mats):
            rows_out = r // 2 if mode == K.MODE_SWIGLU else r
            ys.append(cp.full((rows, rows_out), 0.25 if mode == K.MODE_ADD else np.nan, dtype=cp.float32))
        plan = K.GemvPlan(mats, [(y, y.shape[1]) for y in ys], K.Workspace(), impl="a8", partition=partition, wgmma=wg)
        run_plan(rt, plan, x, kpad, n, seen if pipe else None)
        outs[name] = [y[:n].get() for y in ys]
    return outs, [k for m, k in seen if m == "gemv_wg"]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gate_up", "down", "gdn_in", "attn_in", "gdn_out", "lm_head"])
@pytest.mark.parametrize("n", [1, 8, 9, 16, 17, 32])
def test_pipelined_is_bitwise_on_the_27b_launches(cp, monkeypatch, name, n):
    outs, launched = _three(cp, _specs_27b(name), n, seed=n, monkeypatch=monkeypatch)
    width = 8 if n <= 8 else 16 if n <= 16 else 32
    assert launched == [f"gemv8w_q4_n{width}p"], launched
    for p, q, o in zip(outs["pipe"], outs["plain"], outs["off"]):
        assert np.isfinite(o).all()
        np.testing.assert_array_equal(p.view(np.uint32), q.view(np.uint32))
        np.testing.assert_array_equal(p.view(np.uint32), o.view(np.uint32))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,cols,splits", [(300, 640, 1), (300, 640, 2), (1040, 5120, 7), (64, 4096, 9),
                                              (200, 320, 1), (5120, 17408, 5), (5120, 6144, 3)])
@pytest.mark.parametrize("n", [1, 8, 9, 16, 17, 32])
def test_pipelined_is_bitwise_under_forced_splits(cp, monkeypatch, rows, cols, splits, n):
    """Partial last stages (of either pass at 17 / 32 lanes), units of fewer than a stage or two (200 x 320: 5
    chunks; 640 / 2: 5 a unit), passes with no stage, the ticket path's ordered sums."""
    from q27py.gpu import kernels as K

    outs, launched = _three(cp, [(rows, cols, L.FMT_Q4, K.MODE_STORE)], n, partition=(1, splits), seed=rows + splits,
                            monkeypatch=monkeypatch)
    assert len(launched) == 1 and launched[0].endswith("p"), launched
    np.testing.assert_array_equal(outs["pipe"][0].view(np.uint32), outs["plain"][0].view(np.uint32))
    np.testing.assert_array_equal(outs["pipe"][0].view(np.uint32), outs["off"][0].view(np.uint32))
    assert np.isfinite(outs["off"][0]).all()
