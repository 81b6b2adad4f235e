"""The Triton GEMV kernels (strata.kernels.gemv) against "dequantize, then x @ W^T in float64", on the CPU.

The kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported), on tiny shapes:
random blocks with sane fp16 scales, 12 rows (a partial row tile), 2-3 tokens, K of 5-10 blocks. The reference
dequantizer is strata.weights.quants (bit-exact vs gguf-py); Q2_0 (ggml type 42), which neither it nor gguf-py
decodes, has its 6-line reference here.

Tolerance: |y - ref| <= RTOL * sum_k |w_k x_k| per output. Both sides round to fp32 only (the reference decodes in
fp32; the kernel forms d*sc first, then q * that, and accumulates per element over chunks before one tree sum);
for K <= 512 that rounding is bounded by about 25 units of fp32 roundoff (1.5e-6). A single mis-decoded weight,
scale or sign moves an output by ~1e-3 of that sum or more, so 1e-5 separates the two by two orders of magnitude
either way.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton: the kernels run on the CPU

import importlib
import zlib

import numpy as np
import pytest
import torch
import triton  # noqa: F401  (a missing triton fails this module; it never skips)
from triton.runtime.interpreter import InterpretedFunction

import strata.kernels.gemv as _gemv
import strata.kernels.gemv_blocks as _blocks
import strata.kernels.experts_gemm as _egemm
import strata.kernels.gemv_rr as _rr
import strata.kernels.ops as _kops
import strata.kernels.pdl as _pdl
from strata.kernels import gemv_tables
from strata.model.experts import experts_ref
from strata.model.ops import Ops, linear_ref, linears_ref, mlp_ref
from strata.runtime import placement
from strata.weights import quants
from strata.weights.quant_tensor import QuantTensor
from strata.weights.tensor import DenseTensor, RowConcatTensor

# A module that imported the kernels before this one did (with the interpreter off) holds compiled-mode functions
# that cannot run here: rebuild them in interpreter mode.
if not isinstance(_blocks.decode_q8_0, InterpretedFunction):
    for _m in (_pdl, _blocks, _rr, _gemv, _egemm, _kops):
        importlib.reload(_m)
G = _gemv
K_OPS = _kops

RTOL = 1e-5


def zlib_seed(name: str) -> int:
    """A per-type seed that does not depend on Python's hash randomisation."""
    return zlib.crc32(name.encode())

QUANT_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q8_0_R8", "IQ4_NL", "Q2_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
               "Q6_K_P", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_XS", "IQ1_S", "IQ1_M", "Q8_0_R",
               "Q4_K_R", "Q5_1_R", "Q6_K_R"]
DENSE_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}

def k_for(name: str) -> int:
    """A small K: 10 blocks of 32 (chunks of 2 blocks), 5 of 64, 5 groups of 128 or 2 super-blocks of 256."""
    return {32: 320, 64: 320, 128: 640, 256: 512}[G.gemv_type(name).block_elems]


def random_blocks(name: str, rows: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """(rows, row_bytes) uint8: random bytes, fp16 fields set to +-[0.005, 0.02] (sane scales, no inf/nan)."""
    t = G.gemv_type(name)
    n = rows * (k // t.block_elems)
    raw = rng.integers(0, 256, size=(n, t.block_bytes), dtype=np.uint8)
    for off in t.f16_fields:
        v = (rng.uniform(0.005, 0.02, size=n) * rng.choice([-1.0, 1.0], size=n)).astype(np.float16)
        raw[:, off:off + 2] = v.view(np.uint8).reshape(n, 2)
    if name == "IQ1_M":  # fp16 d in the top nibbles of the four scale words (bytes 49, 51, 53, 55)
        d = (rng.uniform(0.005, 0.02, size=n) * rng.choice([-1.0, 1.0], size=n)).astype(np.float16).view(np.uint16)
        for j in range(4):
            raw[:, 49 + 2 * j] = (raw[:, 49 + 2 * j] & 0x0F) | (((d >> (4 * j)) & 0xF) << 4).astype(np.uint8)
    return torch.from_numpy(raw.reshape(rows, -1))


def dequant_ref(name: str, raw: torch.Tensor, k: int) -> torch.Tensor:
    """The reference weights (rows, k), float64."""
    if name == "Q2_0":  # 64 weights: fp16 d, then weight j in bits 2(j%4) of byte j/4; w = d (code - 1)
        b = raw.reshape(-1, 18)
        d = b[:, :2].contiguous().view(torch.float16).float()
        codes = (b[:, 2:, None].int() >> torch.tensor([0, 2, 4, 6])) & 3
        return (d * (codes.reshape(-1, 64).float() - 1)).reshape(raw.shape[0], k).double()
    return quants.dequantize(raw, G.gemv_type(name).type_id, k).double()


def check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y (T, N) against x (T, K) @ w (N, K)^T in float64, relative to sum |w x| per output."""
    xd = x.double()
    ref = xd @ w.T
    bound = xd.abs() @ w.abs().T
    assert y.dtype == torch.float32 and y.shape == ref.shape
    err = ((y.double() - ref).abs() / bound).max().item()
    assert err <= RTOL, f"max relative error {err:.3e} > {RTOL}"


@pytest.mark.parametrize("name", QUANT_TYPES)
def test_gemv_quantized(name: str) -> None:
    rng = np.random.default_rng(zlib_seed(name))
    k = k_for(name)
    raw = random_blocks(name, 12, k, rng)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
    y = G.gemv(x, raw, G.gemv_type(name).type_id, k, block_n=8)  # 2 row tiles, the second partial
    check(y, x, dequant_ref(name, raw, k))


@pytest.mark.parametrize("name", QUANT_TYPES)
def test_gemv_experts(name: str) -> None:
    """Per-slot inputs (down projection) and one shared input (gate/up), ids int32 and int64, read on device."""
    rng = np.random.default_rng(zlib_seed(name) + 1)
    k = k_for(name)
    stack = torch.stack([random_blocks(name, 12, k, rng) for _ in range(3)])
    ws = [dequant_ref(name, stack[e], k) for e in range(3)]
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, k, generator=gen)
    y = G.gemv_experts(x, stack, torch.tensor([2, 0], dtype=torch.int32), name, k)
    for s, e in enumerate([2, 0]):
        check(y[s:s + 1], x[s:s + 1], ws[e])
    x1 = torch.randn(1, k, generator=gen)
    out = torch.full((3, 12), float("nan"))
    y1 = G.gemv_experts(x1, stack, torch.tensor([1, 1, 2]), name, k, out=out)
    assert y1 is out
    for s, e in enumerate([1, 1, 2]):
        check(y1[s:s + 1], x1, ws[e])


@pytest.mark.parametrize("name", list(DENSE_TYPES))
def test_gemv_dense(name: str) -> None:
    """F32/F16/BF16 rows, given typed and as their uint8 view."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(12, 320, generator=gen).to(DENSE_TYPES[name])
    x = torch.randn(2, 320, generator=gen)
    check(G.gemv(x, w, name, 320, block_n=8), x, w.double())
    check(G.gemv(x, w.view(torch.uint8), G.gemv_type(name).type_id, 320), x, w.double())
    stack = torch.stack([w, -w])
    y = G.gemv_experts(x, stack, torch.tensor([1, 0]), name, 320)
    check(y[:1], x[:1], -w.double())
    check(y[1:], x[1:], w.double())


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16])
def test_gemv_half_precision_x(x_dtype: torch.dtype) -> None:
    rng = np.random.default_rng(4)
    raw = random_blocks("Q4_K", 12, 512, rng)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(4)).to(x_dtype)
    check(G.gemv(x, raw, "Q4_K", 512), x, dequant_ref("Q4_K", raw, 512))


def test_gemv_more_tokens_than_one_launch() -> None:
    """9 tokens: two launches (8 + 1) writing disjoint rows of one output."""
    rng = np.random.default_rng(5)
    raw = random_blocks("Q8_0", 12, 320, rng)
    x = torch.randn(G.MAX_TOKENS + 1, 320, generator=torch.Generator().manual_seed(5))
    check(G.gemv(x, raw, "Q8_0", 320), x, dequant_ref("Q8_0", raw, 320))


def test_gemv_rejects_bad_input() -> None:
    raw = random_blocks("Q4_0", 4, 64, np.random.default_rng(6))
    x = torch.randn(1, 64)
    with pytest.raises(ValueError, match="no Triton GEMV"):
        G.gemv(x, raw, 34, 64)  # TQ1_0: no kernel
    with pytest.raises(ValueError, match="rows of"):
        G.gemv(torch.randn(1, 96), raw, "Q4_0", 96)
    with pytest.raises(ValueError, match="x: expected"):
        G.gemv(torch.randn(1, 32), raw, "Q4_0", 64)
    with pytest.raises(ValueError, match="uint8"):
        G.gemv(x, raw.float(), "Q4_0", 64)
    with pytest.raises(ValueError, match="expert_ids"):
        G.gemv_experts(x, raw[None], torch.tensor([0.0]), "Q4_0", 64)


def test_tables_match_gguf() -> None:
    """The embedded i-quant grids and the IQ4 code equal gguf-py's (llama.cpp's) tables."""
    from gguf import quants as gq

    for name in ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"):
        cls = getattr(gq, name)
        cls.init_grid()
        assert np.array_equal(gemv_tables.grid_values(name).astype(np.float32), cls.grid.reshape(cls.grid_shape))
        words = gemv_tables.grid_words(name).view(np.uint8).reshape(cls.grid_shape)
        assert np.array_equal(words, gemv_tables.grid_values(name))
    gq.IQ1_S.init_grid()
    words = gemv_tables.iq1_grid_words().view(np.uint8).reshape(gq.IQ1_S.grid_shape)
    assert np.array_equal(words.astype(np.float32) - 1, gq.IQ1_S.grid.reshape(gq.IQ1_S.grid_shape))
    assert gemv_tables.IQ4_KVALUES == gq.IQ4_NL.kvalues


def test_type_geometry_matches_quants() -> None:
    """Every kernel's block geometry is strata.weights.quants' (Q2_0, type 42, is not in it: 64 weights, 18 B)."""
    for t in G.GEMV_TYPES.values():
        if t.name == "Q2_0":
            assert (t.type_id, t.block_elems, t.block_bytes) == (42, 64, 18)
            continue
        q = quants.ggml_type(t.type_id)
        assert (q.name, q.block_size, q.type_size) == (t.name, t.block_elems, t.block_bytes)


def test_linear_blocks_matches_linear_ref() -> None:
    rng = np.random.default_rng(7)
    w = QuantTensor("w", random_blocks("Q4_K", 12, 512, rng), 12, (12, 512))
    bias = DenseTensor("b", torch.randn(12))
    x = torch.randn(2, 3, 512, generator=torch.Generator().manual_seed(7))
    raw = K_OPS.stored_rows(w)
    assert raw is not None and raw[1] == "Q4_K"
    y = K_OPS.linear_blocks(x, raw[0], raw[1], bias)
    ref = linear_ref(x, w, bias)
    assert y.shape == ref.shape == (2, 3, 12)
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5)
    # off CUDA the op is the reference itself
    assert torch.equal(K_OPS.linear_triton(x, w, bias), ref)


def test_experts_blocks_matches_reference() -> None:
    """Two tokens x two slots; gate/up Q4_K over H = 256, down Q8_0 over I = 64 (as the model's 640)."""
    rng = np.random.default_rng(8)
    n_exp, h_dim, i_dim = 4, 256, 64
    gate = QuantTensor("g", torch.stack([random_blocks("Q4_K", i_dim, h_dim, rng) for _ in range(n_exp)]), 12,
                       (n_exp, i_dim, h_dim))
    up = QuantTensor("u", torch.stack([random_blocks("Q4_K", i_dim, h_dim, rng) for _ in range(n_exp)]), 12,
                     (n_exp, i_dim, h_dim))
    down = QuantTensor("d", torch.stack([random_blocks("Q8_0", h_dim, i_dim, rng) for _ in range(n_exp)]), 8,
                       (n_exp, h_dim, i_dim))
    gen = torch.Generator().manual_seed(8)
    a = torch.randn(2, h_dim, generator=gen)
    top_i = torch.tensor([[3, 1], [1, 0]])
    top_w = torch.softmax(torch.randn(2, 2, generator=gen), dim=-1)
    ref = experts_ref(a, top_i, top_w, gate, up, down, linear_ref)
    raws = [K_OPS.stored_rows(t) for t in (gate, up, down)]
    y = K_OPS.experts_blocks(a, top_i, top_w, *raws)
    assert torch.allclose(y, ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item())
    y1 = K_OPS.experts_blocks(a[:1], top_i[:1], top_w[:1], *raws)  # decode: one token, x shared by its slots
    assert torch.allclose(y1, ref[:1], rtol=1e-4, atol=1e-5 * ref.abs().max().item())
    assert torch.equal(K_OPS.experts_triton(a, top_i, top_w, gate, up, down, linear_ref), ref)


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0", "Q5_1", "F32"])
def test_split_k_matches_the_reference(name: str) -> None:
    """K split over 2 and 4 programs per row tile (the last to finish sums the partials in program order): plain,
    expert and GLU launches agree with the reference, and every ticket counter is back to 0 afterwards."""
    rng = np.random.default_rng(zlib_seed(name) + 3)
    k = 1024 if name == "Q4_K" else 512
    if name == "F32":
        raws = [torch.randn(12, k, generator=torch.Generator().manual_seed(i)) for i in range(3)]
        refs = [r.double() for r in raws]
    else:
        raws = [random_blocks(name, 12, k, rng) for _ in range(3)]
        refs = [dequant_ref(name, r, k) for r in raws]
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(4))
    for sk in (2, 4):
        check(G.gemv(x, raws[0], name, k, block_n=8, split_k=sk), x, refs[0])
        y = G.gemv_experts(x, torch.stack(raws[:2]), torch.tensor([1, 0]), name, k, split_k=sk)
        check(y[:1], x[:1], refs[1])
        check(y[1:], x[1:], refs[0])
        glu = G.gemv_glu(x[:1], raws[0], raws[1], name, k, split_k=sk)
        g, u = x[:1].double() @ refs[0].T, x[:1].double() @ refs[1].T
        want = torch.nn.functional.silu(g) * u
        assert (glu.double() - want).abs().max() <= 1e-4 * want.abs().max()
    assert all(int(c.abs().sum()) == 0 for c in G._counters.values())


def test_split_k_is_lowered_to_a_divisor_of_the_chunks() -> None:
    assert G._split(4, 10, 100) == 2 and G._split(5, 10, 100) == 5 and G._split(3, 7, 100) == 1
    assert G._split(None, 10, 100) == 1 and G._split(2, 10, G.SPLIT_COUNTERS + 1) == 1


@pytest.mark.parametrize("name", ["IQ4_NL", "Q8_0", "Q5_1", "Q4_K", "Q6_K", "IQ4_XS", "Q8_0_R8", "Q6_K_P", "Q8_0_R",
                                  "Q4_K_R", "Q5_1_R", "Q6_K_R", "IQ1_S", "IQ1_M"])
def test_dequantize_rows_matches_the_reference_decoder(name: str) -> None:
    """5 stored rows (three programs of 2, the last partial) decoded to fp32 equal quants.dequantize to fp32
    rounding (the decoders form d*sc first), and to bf16 they round to the same value but where the two fp32
    values straddle a bf16 rounding boundary."""
    rng = np.random.default_rng(zlib_seed(name) + 7)
    k = k_for(name)
    raw = random_blocks(name, 5, k, rng)
    ref = dequant_ref(name, raw, k).float()
    got = G.dequantize_rows(raw, name, k)
    assert got.dtype == torch.float32 and got.shape == (5, k)
    assert torch.allclose(got, ref, rtol=2e-7, atol=0), (got - ref).abs().max()
    got16 = G.dequantize_rows(raw, name, k, torch.bfloat16)
    assert got16.dtype == torch.bfloat16
    assert (got16 != ref.to(torch.bfloat16)).float().mean() < 1e-3
    if name.startswith("IQ1"):  # one rounding, dl (grid + delta), as the reference: the same bits
        assert torch.equal(got, ref)


def test_dequantize_rows_of_dense_types() -> None:
    w = torch.randn(3, 320, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    assert torch.equal(G.dequantize_rows(w, "BF16", 320), w.float())
    assert torch.equal(G.dequantize_rows(w.view(torch.uint8), "BF16", 320, torch.bfloat16), w)


def test_decode_rows_of_stored_rows_equals_rows(monkeypatch) -> None:
    """The PLE lookup split in two (`stored_rows` on the host, `decode_rows` on the device: the Triton entry) gives
    what `rows` gives, for a quantized table, a sharded one and a dense one."""
    rng = np.random.default_rng(13)
    table = QuantTensor("t", random_blocks("IQ4_NL", 40, 64, rng), 20, (40, 64))
    shards = RowConcatTensor("s", [QuantTensor(f"s{i}", random_blocks("IQ4_NL", 20, 64, rng), 20, (20, 64))
                                   for i in range(2)])
    dense = DenseTensor("d", torch.randn(40, 64, generator=torch.Generator().manual_seed(5)))
    index = torch.tensor([[3, 39, 3], [20, 0, 19]])
    monkeypatch.setattr(K_OPS, "_on_gpu", lambda x: True)
    for t in (table, shards, dense):
        stored = t.stored_rows(index)
        assert stored.shape[:2] == (2, 3)
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(K_OPS.decode_rows_triton(stored, t, dtype), t.rows(index, dtype)), (t, dtype)
    with pytest.raises(ValueError, match="out of range"):
        table.stored_rows(torch.tensor([40]))


@pytest.mark.parametrize("name", ["Q8_0_R", "Q4_K", "Q6_K"])
def test_linear_triton_of_many_rows_dequantizes_in_one_launch(name: str, monkeypatch) -> None:
    """Past GEMV_MAX_ROWS rows (prefill) a quantized W is decoded by one `dequantize_rows` launch into the
    reference's dense weights, then one matmul: the output equals `linear_ref`'s bit for bit under the
    interpreter, in fp32 and bf16, with a bias; a dense W goes to the reference without a decode."""
    rng = np.random.default_rng(zlib_seed(name) + 16)
    k = k_for(name)
    w = QuantTensor("w", random_blocks(name, 12, k, rng), G.gemv_type(name).type_id, (12, k))
    bias = DenseTensor("b", torch.randn(12, generator=torch.Generator().manual_seed(16)))
    dense = DenseTensor("d", torch.randn(12, k, generator=torch.Generator().manual_seed(17)))
    monkeypatch.setattr(K_OPS, "_on_gpu", lambda x: True)
    launches: list[str] = []
    real = K_OPS.dequantize_rows
    monkeypatch.setattr(K_OPS, "dequantize_rows", lambda *a, **kw: (launches.append(a[1]), real(*a, **kw))[1])
    x = torch.randn(K_OPS.GEMV_MAX_ROWS + 8, k, generator=torch.Generator().manual_seed(18))
    for dtype in (torch.float32, torch.bfloat16):
        launches.clear()
        got = K_OPS.linear_triton(x.to(dtype), w, bias)
        assert launches == [name]
        assert got.dtype == dtype and torch.equal(got, linear_ref(x.to(dtype), w, bias)), dtype
        launches.clear()
        assert torch.equal(K_OPS.linear_triton(x.to(dtype), dense), linear_ref(x.to(dtype), dense))
        assert launches == []


@pytest.mark.parametrize("name", ["Q6_K_R", "Q4_K", "IQ4_NL"])
def test_embed_triton_equals_rows(name: str, monkeypatch) -> None:
    """The Triton embedding (gather the stored rows, decode them in one launch) gives what the table's `rows`
    gives, in fp32 and bf16, for repeated ids; a dense table goes to the reference."""
    rng = np.random.default_rng(zlib_seed(name) + 15)
    k = k_for(name)
    table = QuantTensor("embed", random_blocks(name, 12, k, rng), G.gemv_type(name).type_id, (12, k))
    dense = DenseTensor("d", torch.randn(12, k, generator=torch.Generator().manual_seed(15)))
    ids = torch.tensor([[11, 0, 11, 5]])
    monkeypatch.setattr(K_OPS, "_on_gpu", lambda x: True)
    launches: list[str] = []
    real = K_OPS.dequantize_rows
    monkeypatch.setattr(K_OPS, "dequantize_rows", lambda *a, **kw: (launches.append(a[1]), real(*a, **kw))[1])
    for dtype in (torch.float32, torch.bfloat16):
        got = K_OPS.embed_triton(ids, table, dtype)
        assert got.shape == (1, 4, k) and got.dtype == dtype
        assert torch.equal(got, table.rows(ids, dtype)), dtype
        assert torch.equal(K_OPS.embed_triton(ids, dense, dtype), dense.rows(ids, dtype))
    assert launches == [name, name]


@pytest.mark.parametrize("kind", ["quant", "sharded", "dense", "bf16", "one-shard bf16", "sharded bf16"])
def test_stored_rows_into_equals_stored_rows(kind: str, monkeypatch) -> None:
    """The decode step's gather into its host buffer (`stored_rows_into`: numpy over the rows' bytes for host
    tables, quantized or dense) writes exactly what `stored_rows` returns, without going through it, and refuses
    rows outside the table."""
    rng = np.random.default_rng(14)
    gen = torch.Generator().manual_seed(5)

    def bf16(name: str, n: int) -> DenseTensor:
        return DenseTensor(name, torch.randn(n, 64, generator=gen).to(torch.bfloat16))

    table = {"quant": lambda: QuantTensor("t", random_blocks("IQ4_NL", 40, 64, rng), 20, (40, 64)),
             "sharded": lambda: RowConcatTensor("s", [QuantTensor(f"s{i}", random_blocks("IQ4_NL", n, 64, rng), 20,
                                                                  (n, 64)) for i, n in enumerate((7, 20, 13))]),
             "dense": lambda: DenseTensor("d", torch.randn(40, 64, generator=gen)),
             "bf16": lambda: bf16("b", 40),
             "one-shard bf16": lambda: RowConcatTensor("o", [bf16("o0", 40)]),
             "sharded bf16": lambda: RowConcatTensor("s", [bf16(f"s{i}", n) for i, n in enumerate((7, 20, 13))]),
             }[kind]()
    rows = [3, 39, 3, 20, 0, 19, 6, 7, 26, 27]
    want = table.stored_rows(torch.tensor(rows))
    out = torch.full_like(want, 7)
    for t in (table, *getattr(table, "parts", ())):
        monkeypatch.setattr(t, "stored_rows", lambda index: pytest.fail("took the tensor path"))
    table.stored_rows_into(rows, out)
    assert torch.equal(out, want)
    raw = np.full((len(rows), want[0].numel() * want.element_size()), 7, dtype=np.uint8)  # the step's byte view
    table.stored_rows_into(rows, raw)
    assert raw.tobytes() == want.contiguous().view(torch.uint8).numpy().tobytes()
    for bad in ([40], [-1]):
        with pytest.raises(ValueError, match="out of range"):
            table.stored_rows_into(bad, out[:1])


def test_stored_rows_into_bytes_through_the_tensor_path(monkeypatch) -> None:
    """A table with no host array (device-resident, or shards of several types) still fills a byte buffer with
    `stored_rows`' bytes, and a buffer of the wrong size is refused, not half written."""
    table = QuantTensor("t", random_blocks("IQ4_NL", 40, 64, np.random.default_rng(3)), 20, (40, 64))
    monkeypatch.setattr(table, "host_rows", lambda: None)
    rows = [5, 0, 39]
    want = table.stored_rows(torch.tensor(rows)).numpy().tobytes()
    raw = np.zeros((3, len(want) // 3), dtype=np.uint8)
    table.stored_rows_into(rows, raw)
    assert raw.tobytes() == want
    with pytest.raises(ValueError, match="do not fit"):
        table.stored_rows_into(rows, np.zeros((3, len(want) // 3 - 1), dtype=np.uint8))


def test_triton_ops_replaces_only_its_entries() -> None:
    def marker(*args: object) -> None:
        return None

    ops = K_OPS.triton_ops(Ops(route=marker))
    assert ops.linear is K_OPS.linear_triton and ops.experts is K_OPS.experts_triton and ops.route is marker
    assert ops.embed is K_OPS.embed_triton
    assert K_OPS.triton_ops().gdn_core is Ops().gdn_core
    assert K_OPS.stored_rows(DenseTensor("d", torch.zeros(2, 3, dtype=torch.int32))) is None



def test_fuse_rows_stores_groups_back_to_back() -> None:
    rng = np.random.default_rng(9)
    parts = [QuantTensor(n, random_blocks("Q8_0", r, 256, rng), 8, (r, 256)) for n, r in (("q", 12), ("z", 6),
                                                                                          ("b", 3))]
    fused = placement.fuse_rows(parts)
    assert [t.name for t in fused] == ["q", "z", "b"]
    assert all(torch.equal(a.data, b.data) for a, b in zip(parts, fused, strict=True))
    span = K_OPS.adjacent_span([t.data for t in fused])
    assert span is not None and torch.equal(span, torch.cat([t.data for t in parts]))
    assert K_OPS.adjacent_span([t.data for t in parts]) is None  # three separate buffers
    assert K_OPS.adjacent_span([fused[1].data, fused[0].data]) is None  # out of order
    mixed = [parts[0], DenseTensor("d", torch.randn(4, 256))]
    assert placement.fuse_rows(mixed) is mixed  # different storage types stay apart


def test_fuse_rows_repacks_tall_q8_0_groups(monkeypatch) -> None:
    """With `repack` (the GPU placement), a Q8_0 group of at least REPACK_MIN_ROWS_PER_K rows per column is stored
    as Q8_0_R: same values (dequantized and through the GEMV as one launch), other groups as they were."""
    rng = np.random.default_rng(12)
    parts = [QuantTensor(n, random_blocks("Q8_0", r, 256, rng), 8, (r, 256)) for n, r in (("q", 700), ("z", 324))]
    assert sum(p.shape[0] for p in parts) == placement.REPACK_MIN_ROWS_PER_K * 256
    fused = placement.fuse_rows(parts, repack=True)
    assert [t.kind for t in fused] == ["Q8_0_R", "Q8_0_R"]
    assert all(torch.equal(a.dense(), b.dense()) for a, b in zip(parts, fused, strict=True))
    assert [t.kind for t in placement.fuse_rows(parts)] == ["Q8_0", "Q8_0"]  # not asked
    short = [QuantTensor("s", random_blocks("Q8_0", 16, 256, rng), 8, (16, 256))] * 2
    assert [t.kind for t in placement.fuse_rows(short, repack=True)] == ["Q8_0", "Q8_0"]  # too short
    monkeypatch.setattr(K_OPS, "_on_gpu", lambda x: True)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(12))
    outs = K_OPS.linears_triton(x, fused, [None, None], K_OPS.linear_triton)
    for got, want in zip(outs, linears_ref(x, parts, [None, None], linear_ref), strict=True):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


def test_gpu_layout_stores_q6_k_matrices_as_q6_k_r(monkeypatch) -> None:
    """The GPU placement stores a 2-D Q6_K matrix as Q6_K_R (`word_ordered`; 224 bytes per block): the same
    values, dequantized, row-gathered and through the GEMV; expert stacks and other types stay as they were."""
    rng = np.random.default_rng(14)
    head = QuantTensor("head", random_blocks("Q6_K", 6, 512, rng), 14, (6, 512))
    placed = placement.word_ordered("head", head)
    assert placed.kind == "Q6_K_R" and placed.data.shape == (6, 2 * 224)
    assert torch.equal(placed.dense(), head.dense())
    index = torch.tensor([5, 0, 3])
    assert torch.equal(placed.rows(index, torch.float32), head.rows(index, torch.float32))
    stack = QuantTensor("experts", random_blocks("Q6_K", 6, 512, rng).reshape(2, 3, -1), 14, (2, 3, 512))
    q4 = QuantTensor("q4", random_blocks("Q4_K", 4, 256, rng), 12, (4, 256))
    assert placement.word_ordered("experts", stack) is stack and placement.word_ordered("q4", q4) is q4
    monkeypatch.setattr(K_OPS, "_on_gpu", lambda x: True)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(14))
    assert torch.allclose(K_OPS.linear_triton(x, placed, None), linear_ref(x, head, None), rtol=1e-5, atol=1e-6)


def test_in_model_dtype_stores_the_router_as_the_reference_rounds_it(tmp_path, monkeypatch) -> None:
    """For a 16-bit model the GPU placement (`gpu_layout`) stores the float32 router and shared-expert gate in the
    model dtype, back to back (one GEMV): the values `linear_ref` rounds them to at every call, so the group's
    outputs equal the reference's products with the stored float32 weights; a float32 model, and other float32
    tensors, keep what is stored."""
    from strata.weights.hf import load_hf
    from tests import reference

    weights = load_hf(reference.save(reference.build("tiny"), tmp_path))
    names = ("L0.moe.router", "L0.moe.sh_gate_inp")
    assert all(weights[n].tensor.dtype == torch.float32 for n in names)
    assert placement.in_model_dtype(weights, torch.float32) is weights
    placed = placement.gpu_layout(weights, dtype=torch.bfloat16)
    for n in names:
        assert placed[n].tensor.dtype == torch.bfloat16
        assert torch.equal(placed[n].tensor, weights[n].dense(torch.bfloat16))
    assert K_OPS.adjacent_span([placed[n].tensor for n in names]) is not None
    other = next(n for n, t in weights.tensors.items() if isinstance(t, DenseTensor) and not n.endswith(
        placement.MODEL_DTYPE_MATRICES) and t.tensor.dtype == torch.float32)
    assert placement.in_model_dtype(weights, torch.bfloat16)[other] is weights[other]
    monkeypatch.setattr(K_OPS, "_on_gpu", lambda x: True)
    x = torch.randn(1, weights.cfg.hidden_size, generator=torch.Generator().manual_seed(15)).to(torch.bfloat16)
    ws = [weights[n] for n in names]
    outs = K_OPS.linears_triton(x, [placed[n] for n in names], [None, None], K_OPS.linear_triton)
    for got, want in zip(outs, linears_ref(x, ws, [None, None], linear_ref), strict=True):
        assert got.dtype == torch.bfloat16
        assert (got.float() - want.float()).abs().max() <= 2 ** -8 * want.float().abs().max()


def test_bf16_small_launch_shape_is_the_routers_only() -> None:
    """A one-token BF16 / F16 launch of a few hundred rows (the router group in a 16-bit model) takes the F32
    router's small shape and K split; launches by expert id (an HF checkpoint's stacks) keep the plain shape."""
    for name in ("BF16", "F16"):
        t = G.gemv_type(name)
        assert G._rows(t, 1, None, 513) == 2 and G._warps(t, 1, None, 513) == 4 and t.small_split == (5, 1)
        assert G._rows(t, 1, None, 513, True) == t.block_n and G._warps(t, 1, None, 513, True) == t.num_warps
    f32 = G.gemv_type("F32")
    assert G._rows(f32, 1, None, 513, True) == f32.small[0]  # F32 as before: by id too


def test_linears_triton_runs_a_fused_group_as_one_gemv(monkeypatch) -> None:
    rng = np.random.default_rng(10)
    parts = [QuantTensor(n, random_blocks("Q4_K", r, 512, rng), 12, (r, 512)) for n, r in (("q", 10), ("k", 4),
                                                                                           ("v", 4))]
    fused = placement.fuse_rows(parts)
    biases = [None, DenseTensor("kb", torch.randn(4)), None]
    launches = []
    real = K_OPS.gemv
    monkeypatch.setattr(K_OPS, "gemv", lambda *a, **k: (launches.append(1), real(*a, **k))[1])
    monkeypatch.setattr(K_OPS, "_on_gpu", lambda x: True)  # run the CUDA entries under the interpreter
    gen = torch.Generator().manual_seed(10)
    for rows in (1, 3):
        x = torch.randn(rows, 512, generator=gen)
        launches.clear()
        outs = K_OPS.linears_triton(x, fused, biases, K_OPS.linear_triton)
        assert len(launches) == 1
        for got, want in zip(outs, linears_ref(x, parts, biases, linear_ref), strict=True):
            assert got.shape == want.shape and got.is_contiguous()
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    launches.clear()
    K_OPS.linears_triton(x, parts, biases, K_OPS.linear_triton)  # not adjacent: one GEMV per weight
    assert len(launches) == 3


def test_mlp_triton_fuses_gate_and_up(monkeypatch) -> None:
    rng = np.random.default_rng(11)
    gate = QuantTensor("g", random_blocks("Q8_0", 32, 256, rng), 8, (32, 256))
    up = QuantTensor("u", random_blocks("Q8_0", 32, 256, rng), 8, (32, 256))
    down = QuantTensor("d", random_blocks("Q8_0", 256, 32, rng), 8, (256, 32))
    monkeypatch.setattr(K_OPS, "_on_gpu", lambda x: True)
    glu_calls = []
    real = K_OPS.gemv_glu
    monkeypatch.setattr(K_OPS, "gemv_glu", lambda *a, **k: (glu_calls.append(1), real(*a, **k))[1])
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(11))
    got = K_OPS.mlp_triton(x, gate, up, down, K_OPS.linear_triton)
    want = mlp_ref(x, gate, up, down, linear_ref)
    assert glu_calls and torch.allclose(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("name", ["tiny", "nople"])
def test_model_decode_with_fused_groups(name, tmp_path, monkeypatch) -> None:
    """The whole model with every GEMV entry (grouped projections, GLU shared expert) and the fused kernels,
    over weights placed as `place` leaves them on a GPU (groups back to back), equals the reference."""
    from strata.kernels.fused import fused_ops
    from strata.runtime.engine import Engine
    from strata.weights.hf import load_hf
    from tests import reference

    weights = load_hf(reference.save(reference.build(name), tmp_path))
    fused = placement.fuse_groups(weights)
    assert K_OPS.adjacent_span([fused["L0.gdn." + n].tensor for n in ("qkv", "z", "b", "a")]) is not None
    launches = []
    real = K_OPS.gemv
    monkeypatch.setattr(K_OPS, "gemv", lambda *a, **k: (launches.append(1), real(*a, **k))[1])
    monkeypatch.setattr(K_OPS, "_on_gpu", lambda x: True)
    ref = Engine(weights)
    fast = Engine(fused, ops=fused_ops(K_OPS.triton_ops(), force=True))
    ids = torch.randint(2, ref.cfg.vocab_size, (8,), generator=torch.Generator().manual_seed(6)).tolist()
    reference.assert_decodes_match(ref, fast, ids, prompt=4, capacity=16)
    assert launches
