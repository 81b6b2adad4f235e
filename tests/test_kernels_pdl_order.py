"""Where the kernels signal and wait for programmatic dependent launch (PDL), read off their PTX for sm_90.

The CPU and the interpreter never run PDL (`pdl.active` is False there), so the order of `griddepcontrol.wait`
and `griddepcontrol.launch_dependents` in a kernel compiled for Hopper is what these tests check, offline (Triton
compiles for a `GPUTarget` without a GPU). One ordering is needed for correctness: a launch by expert ids that
the routing may still be writing must wait before it lets the next kernel in, because that kernel (the routed
down projections) reads the ids before its own wait (`gemv.gemv_experts_sum`'s `ids_settled`). The others are
the measured release points of `gemv_rr.RELEASE` and `pdl.LATE_RELEASE`. The same compilation shows whether the
row-register GEMVs widen bf16 x by inline PTX (`gemv_rr.WIDEN_X_ASM`), which the interpreter cannot run either.

The kernels are compiled in a subprocess without TRITON_INTERPRET: the interpreter tests of the same session set it
before Triton is first imported, and a kernel module imported under it holds interpreted functions that cannot
be compiled. In the test process this module sets it as they do, so that it may run first.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

if __name__ != "__main__":  # the test process (the compiling subprocess runs this file without it)
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

from strata.kernels import gemv_rr as RR  # noqa: E402
from strata.kernels import gdn, gemv_q8x, hyper, qsa_store  # noqa: E402
from strata.kernels.offline import compile_experts_gemm, compile_for, compile_rr  # noqa: E402

WAIT = "griddepcontrol.wait"
LAUNCH = "griddepcontrol.launch_dependents"


def _ptx(fn, ptrs: dict[str, str], ints: dict, consts: dict, warps: int) -> str:
    return compile_for(fn, ptrs, ints, consts, warps).asm["ptx"]


def _rr_ptx(kind: str, has_ids: bool, ids_early: bool, release: int, x: str = "bf16", widen: bool = False,
            q8x: bool = False, probe: bool = False) -> str:
    k = 2560 if kind != "Q5_1_R" else 640
    return compile_rr(kind, 2560, k, x=x, has_ids=has_ids, ids_early=ids_early, release=release, widen=widen,
                      gdc=True, q8x=q8x, probe=probe)[0].asm["ptx"]


def _hc_two_launch_ptx(half: str, late: bool) -> str:
    """The two-launch HC read's down or up kernel at the real geometry's knobs, bf16."""
    bf = "*bf16"
    if half == "down":
        ptrs = dict(x_ptr=bf, norm_ptr="*fp32", down_ptr=bf, inj_ptr=bf, part_ptr="*fp32", rstd_ptr="*fp32", wi_ptr=bf,
                    y_ptr=bf, xo_ptr=bf, cnt_ptr="*i32", m_ptr="*fp32", iota_ptr=bf)
        ints = dict(H=2560, R=320, NI=4, RT=336, NRBD=40, eps=1e-6)
        consts = dict(S=4, KPS=3, BR=8, BK=1024, HB=2048, NHB=2, DT=hyper.TL_DTYPES[torch.bfloat16], WRITE=True,
                      TICKETS=True, GDC=True, LATE=late)
        return _ptx(hyper._hc_down_kernel, ptrs, ints, consts, 4)
    ptrs = dict(x_ptr=bf, norm_ptr="*fp32", rstd_ptr="*fp32", up_ptr=bf, part_ptr="*fp32", m_ptr="*fp32", a_ptr=bf,
                iota_ptr=bf, xq_ptr="*i8", qcnt_ptr="*i32")
    ints = dict(H=2560, R=320, NI=4, RT=336)
    consts = dict(S=4, SP=4, NKC=12, BH=2, RC=512, NRC=1, NIP=4, DT=hyper.TL_DTYPES[torch.bfloat16], TICKETS=True,
                  Q8=0, GDC=True, LATE=late)
    return _ptx(hyper._hc_up_kernel, ptrs, ints, consts, 4)


def _qsa_store_ptx(late: bool) -> str:
    ptrs = dict(pos_ptr="*i64", ki_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", raw_ptr="*bf16", blk_ptr="*bf16",
                kc_ptr="*bf16", vc_ptr="*bf16", inorm_ptr="*fp32", knorm_ptr="*fp32", cos_ptr="*fp32",
                sin_ptr="*fp32", bcos_ptr="*fp32", bsin_ptr="*fp32")
    ints = dict(eps=1e-6, s_raw=128, s_blk=128, s_kr=512, s_kh=128, s_vr=512, s_vh=128)
    consts = dict(DI=128, HKV=4, HD=128, R=64, C=64, BDI=128, HP=4, BHD=128, CP=64, DT=triton.language.bfloat16,
                  GDC=True, LATE=late)
    return _ptx(qsa_store._qsa_store_kernel, ptrs, ints, consts, 4)


def _gdn_step_ptx(prefetch: bool = False) -> str:
    """The one-launch GDN step at the real geometry (48 value heads, 16 key heads, dk = dv = 128), bf16."""
    bf = "*bf16"
    ptrs = dict(x_ptr=bf, b_ptr=bf, alpha_ptr=bf, convw_ptr=bf, win_ptr=bf, A_ptr="*fp32", dtb_ptr="*fp32",
                S_ptr="*fp32", o_ptr=bf, z_ptr=bf, nw_ptr="*fp32", out_ptr=bf, cnt_ptr="*i32", xq_ptr=bf)
    ints = dict(NK=16, NV=48, DK=128, DV=128, KEY_DIM=2048, REP=3, NVB=4, q_scale=0.088, eps=1e-6)
    consts = dict(K=4, KP=4, BK=128, BV=32, BD=128, TILED=False, SILU=True, SILU_GATE=True,
                  DT=triton.language.bfloat16, FUSED=True, Q8=0, GDC=True, LATE=False, EARLY=True, PFS=prefetch)
    return _ptx(gdn._gdn_step_kernel, ptrs, ints, consts, 4)


def _cases() -> dict:
    """Name -> a function that compiles one case and returns its PTX."""
    cases = {}
    for release in (RR.AFTER_LOOP, RR.AT_WAIT, RR.FIRST):
        for kind in ("Q4_K_R", "Q4_K_RT"):  # the routed GLU's stacks as stored on a GPU: tile-major
            cases[f"unsettled-{kind}-{release}"] = lambda r=release, k=kind: _rr_ptx(k, True, False, r)
        for kind in ("Q8_0_R", "Q4_K_R"):
            cases[f"plain-{kind}-{release}"] = lambda r=release, k=kind: _rr_ptx(k, False, False, r)
    for settled in (True, False):
        cases[f"ids-Q5_1_R-settled-{settled}"] = lambda s=settled: _rr_ptx("Q5_1_R", True, s, RR.RELEASE["settled-ids"])
    for kind in ("Q4_K_R", "Q8_0_R", "Q5_1_R"):
        cases[f"q8x-{kind}"] = lambda k=kind: _rr_ptx(k, k == "Q5_1_R", k == "Q5_1_R",
                                                      RR.RELEASE["settled-ids" if k == "Q5_1_R" else "plain"],
                                                      widen=True, q8x=True)
    for late in (True, False):
        cases[f"quantize-late-{late}"] = lambda lt=late: _ptx(
            gemv_q8x._quantize_kernel, dict(x_ptr="*bf16", q_ptr="*i8"), dict(RUNS=80, x_slot_stride=2560,
                                                                             q_slot_stride=3200),
            dict(SPAN=8, RB=16, GDC=True, LATE=lt), 4)
    for late in (True, False):
        cases[f"qsa_store-late-{late}"] = lambda lt=late: _qsa_store_ptx(lt)
    cases["gdn-step"] = _gdn_step_ptx
    cases["gdn-step-prefetch"] = lambda: _gdn_step_ptx(True)
    cases["probe-Q4_K_R-glu"] = lambda: _rr_ptx("Q4_K_R", True, False, RR.RELEASE["ids"], probe=True)
    cases["noprobe-Q4_K_R-glu"] = lambda: _rr_ptx("Q4_K_R", True, False, RR.RELEASE["ids"])
    for half in ("down", "up"):
        for late in (True, False):
            cases[f"hc-{half}-late-{late}"] = lambda h=half, lt=late: _hc_two_launch_ptx(h, lt)
    for x, widen in (("bf16", True), ("bf16", False), ("fp32", True)):
        cases[f"widen-Q8_0_R-{x}-{widen}"] = lambda x=x, w=widen: _rr_ptx("Q8_0_R", False, False, RR.AT_WAIT, x, w)
    for kind, glu, x in (("Q4_K_R", True, "bf16"), ("Q5_1_R", False, "bf16"), ("Q4_K_R", True, "fp32"),
                         ("Q4_K_RT", True, "bf16")):
        n, k = (640, 2560) if glu else (2560, 640)
        cases[f"experts-gemm-{kind}-{x}"] = lambda kd=kind, g=glu, x=x, n=n, k=k: compile_experts_gemm(
            kd, n, k, glu=g, x=x).asm["ptx"]
    return cases


@pytest.fixture(scope="module")
def ptx(tmp_path_factory) -> dict[str, str]:
    """Every case's PTX, compiled by this file run as a script in a subprocess without TRITON_INTERPRET."""
    out = tmp_path_factory.mktemp("ptx")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    found = {p.stem: p.read_text() for p in out.glob("*.ptx")}
    assert set(found) == set(_cases()), sorted(set(_cases()) - set(found))
    return found


def _order(ptx: str) -> tuple[int, int]:
    """(position of the wait, position of the launch of dependents); each must occur exactly once."""
    assert ptx.count(WAIT) == 1 and ptx.count(LAUNCH) == 1, (ptx.count(WAIT), ptx.count(LAUNCH))
    return ptx.index(WAIT), ptx.index(LAUNCH)


@pytest.mark.parametrize("release", [RR.AFTER_LOOP, RR.AT_WAIT, RR.FIRST])
@pytest.mark.parametrize("kind", ["Q4_K_R", "Q4_K_RT"])
def test_rr_by_unsettled_ids_waits_before_letting_the_next_kernel_in(ptx, release, kind):
    wait, launch = _order(ptx[f"unsettled-{kind}-{release}"])
    assert wait < launch


@pytest.mark.parametrize("kind", ["Q8_0_R", "Q4_K_R"])
def test_rr_plain_release_points(ptx, kind):
    fma = "fma.rn.f32"
    wait, launch = _order(ptx[f"plain-{kind}-{RR.FIRST}"])
    assert launch < wait
    at_wait = ptx[f"plain-{kind}-{RR.AT_WAIT}"]
    wait, launch = _order(at_wait)
    assert wait < launch and fma not in at_wait[wait:launch]  # no K-loop arithmetic in between
    after = ptx[f"plain-{kind}-{RR.AFTER_LOOP}"]
    wait, launch = _order(after)
    assert wait < launch and after[wait:launch].count(fma) > 8  # the K loop in between


def test_rr_settled_ids_are_read_before_the_wait(ptx):
    settled = ptx["ids-Q5_1_R-settled-True"]
    wait, _ = _order(settled)
    assert "ld.global.cg" in settled[:wait]  # the expert ids, loaded from L2 before the wait
    unsettled = ptx["ids-Q5_1_R-settled-False"]
    wait, _ = _order(unsettled)
    assert "ld.global.cg" not in unsettled[:wait]


def test_release_classes_are_the_measured_defaults():
    assert RR.RELEASE == {"plain": RR.AT_WAIT, "ids": RR.AT_WAIT, "settled-ids": RR.AFTER_LOOP}


@pytest.mark.parametrize("late", [False, True])
def test_qsa_store_release_point(ptx, late):
    wait, launch = _order(ptx[f"qsa_store-late-{late}"])
    assert (wait < launch) == late


@pytest.mark.parametrize("x, widen", [("bf16", True), ("bf16", False), ("fp32", True)])
def test_rr_widens_bf16_x_by_inline_ptx_only_when_asked(ptx, x, widen):
    mask = "0xFFFF0000;"  # the high element's widening in `gemv_rr._xf`
    code = ptx[f"widen-Q8_0_R-{x}-{widen}"]
    if x == "bf16" and widen:
        assert code.count(mask) >= 16  # every x load of a K step (8 loads of 4 elements: 16 words)
    else:
        assert mask not in code


@pytest.mark.parametrize("case", ["Q4_K_R-bf16", "Q5_1_R-bf16", "Q4_K_R-fp32", "Q4_K_RT-bf16"])
def test_experts_gemm_multiplies_16_bit_tiles_on_the_tensor_cores(ptx, case):
    """The prefill's grouped expert GEMM (`experts_gemm`, which the interpreter runs as fp32 products) compiles
    its bf16 products to tensor-core MMAs of bf16 operands with fp32 accumulators, and its fp32 ones (F32_DOT) to
    none; it lets the next kernel in before its PDL wait."""
    code = ptx[f"experts-gemm-{case}"]
    mma = [line for line in code.splitlines() if "mma." in line]
    if case.endswith("bf16"):
        assert mma and all(".f32.bf16.bf16.f32" in line for line in mma)
    else:
        assert not mma
    wait, launch = _order(code)
    assert launch < wait


@pytest.mark.parametrize("half", ["down", "up"])
@pytest.mark.parametrize("late", [False, True])
def test_hc_read_release_points(ptx, half, late):
    """The two-launch HC read's kernels (`hyper._hc_down_kernel`, `_hc_up_kernel`) let the next kernel in first,
    or after their wait with LATE (`pdl.LATE_RELEASE`), and poll nothing (no counter, no acquire read)."""
    code = ptx[f"hc-{half}-late-{late}"]
    wait, launch = _order(code)
    assert (wait < launch) == late
    assert not re.search(r"(atom|red|ld)\.global\.gpu\.\w+\.(add\.u64|b64)", code)  # no 64-bit counter


def test_gdn_step_draws_both_tickets_in_one_atomic(ptx):
    """The GDN step's two tickets (key head: window shift; value head: gated norm) are one acq_rel atomic
    instruction, one fence and one round trip to L2 on the layer's path, not two in a row."""
    code = ptx["gdn-step"]
    assert len(re.findall(r"atom\.global\.gpu\.acq_rel\.add", code)) == 1
    _order(code)


def test_probe_compiles_to_timer_reads_only_when_asked(ptx):
    """`gemv_rr.PROBE`: the probed launch reads the global timer (start, wait, loop, end) and the SM id; an
    unprobed one has none of it."""
    probed, plain = ptx["probe-Q4_K_R-glu"], ptx["noprobe-Q4_K_R-glu"]
    assert probed.count("%globaltimer") >= 4 and "%smid" in probed
    assert "%globaltimer" not in plain and "%smid" not in plain


if __name__ == "__main__":  # the fixture's subprocess: compile every case into the folder given
    for name, compile_case in _cases().items():
        (Path(sys.argv[1]) / f"{name}.ptx").write_text(compile_case())


@pytest.mark.parametrize("kind", ["Q4_K_R", "Q8_0_R", "Q5_1_R"])
def test_rr_q8_activations_multiply_in_dp4a(ptx, kind):
    """With Q8 activations (`gemv_q8x`) the K loop's products are `dp4a` (unsigned weight bytes for Q8_0_R's
    q + 128, signed for the nibble types), x is not widened, and the release points are the float loops'."""
    code = ptx[f"q8x-{kind}"]
    op = "dp4a.u32.s32" if kind == "Q8_0_R" else "dp4a.s32.s32"
    other = "dp4a.s32.s32" if kind == "Q8_0_R" else "dp4a.u32.s32"
    assert code.count(op) >= 8 and other not in code
    assert "0xFFFF0000;" not in code
    wait, launch = _order(code)
    assert wait < launch


@pytest.mark.parametrize("late", [False, True])
def test_quantize_release_point(ptx, late):
    """The Q8-activation quantize kernel lets its GEMV in first (to load weights while it waits), or after its wait
    (`pdl.LATE_RELEASE["quantize"]`)."""
    wait, launch = _order(ptx[f"quantize-late-{late}"])
    assert (wait < launch) == late


PREFETCH = "prefetch.global.L2"


def test_gdn_step_prefetches_its_slab_before_the_wait_only_when_asked(ptx):
    """`gdn.PREFETCH_STATE` asks L2 for the state slab's lines (one per row at 32 value columns) before the PDL wait,
    which is what it is for; without it the step has no prefetch at all."""
    with_pf, without = ptx["gdn-step-prefetch"], ptx["gdn-step"]
    assert PREFETCH not in without
    assert with_pf.count(PREFETCH) == 1 and with_pf.find(PREFETCH) < with_pf.find(WAIT)
