"""The top-k selection kernel (`strata.kernels.select`) against torch.topk and the reference `select_tokens`,
run on the CPU by Triton's interpreter.

The kernel returns the chosen blocks in ascending block order, not by score, and breaks ties at the k-th place
by lowest block index; so chosen blocks are compared as sorted sets, on score rows drawn without a tie at the
k-th place (asserted, as tests/test_parity.py does), and ties are checked against the documented rule. The tail
and every validity flag must match exactly. Shapes are tiny: the interpreter executes every program in Python.
"""

from __future__ import annotations

import math
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: run the kernels on the CPU

import pytest
import torch
import triton  # noqa: F401  (fails the module when Triton is missing)

from strata.config import ModelConfig
from strata.kernels import attention
from strata.kernels.select import select_blocks
from strata.model.qsa import select_tokens
from tests import reference

NEG = -math.inf


def expand_ref(scores: torch.Tensor, positions: torch.Tensor, k: int, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's expansion (strata.model.qsa.select_tokens) from given scores."""
    nb_q = (positions + 1) // c
    tail = nb_q[:, None] * c + torch.arange(c - 1)
    tail_ok = tail <= positions[:, None]
    top_v, top_b = scores.topk(k, dim=-1)
    chosen = (top_b[:, :, None] * c + torch.arange(c)).flatten(1)
    chosen_ok = torch.isfinite(top_v).repeat_interleave(c, dim=1)
    return torch.cat([chosen, tail], 1), torch.cat([chosen_ok, tail_ok], 1)


def assert_no_tie(scores: torch.Tensor, k: int) -> None:
    """The k-th and (k+1)-th finite scores of every row differ (else the chosen set is not unique)."""
    srt = scores.sort(-1, descending=True).values
    if srt.shape[1] > k:
        a, b = srt[:, k - 1], srt[:, k]
        fin = torch.isfinite(b)
        assert (a[fin] > b[fin]).all()


def blocks_of(idx: torch.Tensor, ok: torch.Tensor, k: int, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block ids (L, k), their ok (L, k)) of the chosen part, after checking each block's c tokens are
    consecutive and share one ok flag."""
    tok = idx[:, :k * c].reshape(-1, k, c)
    okb = ok[:, :k * c].reshape(-1, k, c)
    assert torch.equal(tok - tok[:, :, :1], torch.arange(c).expand_as(tok))
    assert (tok[:, :, 0] % c == 0).all()
    assert torch.equal(okb, okb[:, :, :1].expand_as(okb))
    return tok[:, :, 0] // c, okb[:, :, 0]


def assert_matches_ref(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor], k: int,
                       c: int, nb: int) -> None:
    """Equal to the reference up to a permutation of the chosen blocks; the tail exactly. Blocks chosen with
    ok False (-inf fill when fewer than k are visible) are a tie torch.topk breaks its own way: only their
    number and range must agree (`attend` masks them)."""
    (gi, go), (wi, wo) = got, want
    assert gi.shape == wi.shape and go.shape == wo.shape and gi.dtype == torch.int64 and go.dtype == torch.bool
    gb, gok = blocks_of(gi, go, k, c)
    wb, wok = blocks_of(wi, wo, k, c)
    assert torch.equal(gok.sum(1), wok.sum(1))
    for row in range(gb.shape[0]):
        assert gb[row][gok[row]].sort().values.tolist() == wb[row][wok[row]].sort().values.tolist()
        assert len(set(gb[row].tolist())) == k
    assert (gb >= 0).all() and (gb < nb).all()  # in-range blocks, as torch.topk's
    assert torch.equal(gi[:, k * c:], wi[:, k * c:]) and torch.equal(go[:, k * c:], wo[:, k * c:])


def draw(L: int, nb: int, k: int, seed: int, visible: list[int] | None = None) -> torch.Tensor:
    """Distinct random scores (L, nb) (a permutation scaled, so no ties anywhere), -inf past `visible`."""
    g = torch.Generator().manual_seed(seed)
    s = torch.stack([torch.randperm(nb, generator=g).float() * 0.37 - 50.0 for _ in range(L)])
    if visible is not None:
        s = s.masked_fill(torch.arange(nb)[None, :] >= torch.tensor(visible)[:, None], NEG)
    assert_no_tie(s, k)
    return s


SHAPES = [(nb, k) for nb in (7, 64, 300, 1000) for k in (1, 4, 16, 64) if k <= nb]


@pytest.mark.parametrize("nb,k", SHAPES)
@pytest.mark.parametrize("c,L", [(2, 1), (4, 3)])
def test_topk_set_matches_torch(nb, k, c, L):
    s = draw(L, nb, k, seed=nb * 100 + k)
    positions = torch.randint(0, nb * c, (L,), generator=torch.Generator().manual_seed(k))
    got = select_blocks(s, positions, k, c)
    assert_matches_ref(got, expand_ref(s, positions, k, c), k, c, nb)
    gb, _ = blocks_of(*got, k, c)
    assert (gb.diff(dim=1) > 0).all()  # ascending block order


@pytest.mark.parametrize("nb,k", [(7, 4), (64, 16), (300, 64), (1000, 64)])
def test_fewer_visible_than_k(nb, k):
    """With fewer finite scores than k, the rest are -inf blocks with ok False, at in-range indices."""
    c, L = 4, 3
    visible = [0, k // 2, max(0, k - 1)]
    s = draw(L, nb, k, seed=nb + k, visible=visible)
    positions = torch.tensor(visible) * c + torch.tensor([0, 2, 3])
    got = select_blocks(s, positions, k, c)
    assert_matches_ref(got, expand_ref(s, positions, k, c), k, c, nb)
    gb, gok = blocks_of(*got, k, c)
    for row, v in enumerate(visible):
        assert int(gok[row].sum()) == v
        # tie rule: the -inf fill is the lowest-indexed invisible blocks
        assert gb[row].tolist() == list(range(k))


def test_ties_lowest_index_wins():
    """Equal scores across the k-th place: the lowest block indices among them are chosen."""
    c, k = 2, 5
    s = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0, 2.0, 2.0, 2.0, -1.0, 2.0],
                      [0.0, -0.0, 0.0, 5.0, -0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    got = select_blocks(s, torch.tensor([19, 19]), k, c)
    gb, gok = blocks_of(*got, k, c)
    assert gb.tolist() == [[1, 2, 3, 5, 6], [0, 1, 2, 3, 4]]  # -0.0 ties with +0.0, as in torch
    assert gok.all()


@pytest.mark.parametrize("values", [[NEG, 3.0, math.inf, -2.5, 1e-30, -1e30, 0.0, 7.0],
                                    [-1e-38, -3.0, -2.0, NEG, -1.0, -5.0, -0.5, -4.0]])
def test_key_order_extremes(values):
    """Signs, infinities and tiny magnitudes keep the float order through the integer key."""
    s = torch.tensor([values])
    for k in range(1, len(values) + 1):
        got = select_blocks(s, torch.tensor([31]), k, 4)
        gb, gok = blocks_of(*got, k, 4)
        want = s.topk(k).indices.sort(1).values
        assert torch.equal(gb, want)
        assert torch.equal(gok, torch.isfinite(s[0, gb]))


@pytest.mark.parametrize("block", [16, 64])
def test_chunked_rows_and_every_element_written(block):
    """Rows longer than one chunk (a row count not a multiple of it), strided scores, and poisoned outputs:
    every element is written."""
    L, nb, k, c = 3, 300, 64, 4
    s = draw(L, nb, k, seed=7, visible=[300, 100, 40])
    wide = torch.full((L, nb + 5), 9e9)
    wide[:, :nb] = s
    positions = torch.tensor([1199, 401, 163])
    idx = torch.full((L, k * c + c - 1), -7, dtype=torch.int64)
    ok = torch.full((L, k * c + c - 1), 7, dtype=torch.uint8).view(torch.bool)  # neither True nor False
    got = select_blocks(wide[:, :nb], positions, k, c, block=block, out=(idx, ok))
    assert got[0] is idx and got[1] is ok
    assert (idx >= 0).all() and (ok.view(torch.uint8) <= 1).all()
    assert_matches_ref(got, expand_ref(s, positions, k, c), k, c, nb)


@pytest.mark.parametrize("c", [1, 2, 4])
def test_edge_sizes(c):
    """k == nb (everything chosen), k == 0 (tail only), c == 1 (no tail)."""
    s = draw(2, 9, 9, seed=c)
    positions = torch.tensor([9 * c - 1, 3])
    assert_matches_ref(select_blocks(s, positions, 9, c), expand_ref(s, positions, 9, c), 9, c, 9)
    idx, ok = select_blocks(s, positions, 0, c)
    want = expand_ref(s, positions, 0, c)
    assert torch.equal(idx, want[0]) and torch.equal(ok, want[1])


def config(**overrides) -> ModelConfig:
    return ModelConfig.from_hf_dict(dict(reference.CONFIGS["tiny"], **overrides))


@pytest.mark.parametrize("nb,positions", [(16, [30, 63]), (64, [5, 200, 255])])
def test_select_tokens_end_to_end(nb, positions):
    """attention.select_tokens (block-score kernel + this kernel) against the reference select_tokens."""
    cfg = config(indexer_n_heads=4, indexer_budget=32)  # k = 8 blocks of 4
    g = torch.Generator().manual_seed(nb)
    positions = torch.tensor(positions)
    q = torch.randn(len(positions), cfg.indexer_n_heads, cfg.indexer_head_dim, generator=g)
    blocks = torch.randn(nb, cfg.indexer_head_dim, generator=g)
    c, k = cfg.indexer_compress_ratio, min(cfg.block_topk, nb)
    want = select_tokens(q, blocks, positions, cfg)
    scores = torch.relu(torch.einsum("lhd,md->lhm", q, blocks)).sum(1) / math.sqrt(cfg.indexer_head_dim)
    visible = torch.arange(nb)[None, :] < ((positions + 1) // c)[:, None]
    srt = scores.masked_fill(~visible, NEG).sort(-1, descending=True).values
    fin = torch.isfinite(srt[:, k])
    assert (srt[:, k - 1] - srt[:, k])[fin].min() > 1e-4  # no near-tie: fp32 order cannot flip the set
    assert_matches_ref(attention.select_tokens(q, blocks, positions, cfg), want, k, c, nb)


WIDE_CASES = [(300, 64, 4, 3, 16), (1000, 16, 2, 1, 64), (64, 64, 4, 2, 16), (77, 1, 1, 2, 16), (500, 0, 4, 2, 32)]


@pytest.mark.parametrize("nb,k,c,L,chunk", WIDE_CASES)
def test_wide_select_equals_the_one_program_kernel(nb, k, c, L, chunk):
    """`select_blocks_wide` (the row over many programs, atomics and tickets between eight radix passes) writes
    exactly what `select_blocks` writes: the same blocks in block order, validity and tail; with -inf fill, k == nb
    and k == 0; the per-query histograms and tickets (both in the stream's ticket counters) are back at zero
    afterwards."""
    from strata.kernels import gemv
    from strata.kernels.select import select_blocks_wide

    visible = [nb, nb // 3, max(0, k - 1)][:L]
    s = draw(L, nb, max(1, k), seed=nb + k + c, visible=visible) if k < nb else draw(L, nb, nb, seed=c)
    positions = torch.randint(0, nb * c, (L,), generator=torch.Generator().manual_seed(nb))
    got = select_blocks_wide(s, positions, k, c, chunk=chunk)
    want = select_blocks(s, positions, k, c)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert int(gemv.tickets(s.device).abs().sum()) == 0


@pytest.mark.parametrize("chunk", [16, 32])
def test_wide_select_ties_span_programs(chunk):
    """Equal scores at the k-th place spread over several programs: the lowest block indices win, across
    program boundaries, as in the one-program kernel (including -0.0 against +0.0 and a tie of all keys)."""
    from strata.kernels.select import select_blocks_wide

    g = torch.Generator().manual_seed(chunk)
    s = torch.randint(0, 4, (2, 100), generator=g).float()  # heavy ties at every level
    s[1] = torch.where(torch.rand(100, generator=g) < 0.5, 0.0, -0.0)
    s[0, 90:] = 3.0
    positions = torch.tensor([399, 250])
    for k in (1, 7, 33, 99):
        got = select_blocks_wide(s, positions, k, 4, chunk=chunk)
        want = select_blocks(s, positions, k, 4)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), k


RANKED_CASES = [(300, 64, 4, 3, 16), (1000, 16, 2, 1, 32), (64, 64, 4, 2, 16), (77, 1, 1, 2, 16), (500, 0, 4, 2, 32),
                (1, 1, 4, 1, 16), (40, 40, 1, 2, 16)]


def by_rank(got: tuple[torch.Tensor, torch.Tensor], scores: torch.Tensor, k: int, c: int,
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_blocks`' output (chosen blocks in block order) with the chosen blocks reordered by rank: score
    descending (-0.0 as +0.0), ties by block index."""
    idx, ok = got[0].clone(), got[1].clone()
    for row in range(idx.shape[0]):
        blocks = (idx[row, :k * c:c] // c).tolist()
        perm = sorted(range(k), key=lambda t: (-(float(scores[row, blocks[t]]) + 0.0), blocks[t]))
        idx[row, :k * c] = idx[row, :k * c].view(k, c)[perm].flatten()
        ok[row, :k * c] = ok[row, :k * c].view(k, c)[perm].flatten()
    return idx, ok


@pytest.mark.parametrize("nb,k,c,L,rows", RANKED_CASES)
def test_ranked_select_equals_the_one_program_kernel_by_rank(nb, k, c, L, rows):
    """`select_blocks_ranked` (every block's rank counted over the whole row, one program per `rows` blocks, each
    chosen block written at its rank) writes what `select_blocks` writes with the chosen blocks in rank order, on
    rows with -inf fill, k == nb, k == 0 and one block; every element is written."""
    from strata.kernels.select import select_blocks_ranked

    visible = [nb, nb // 3, max(0, k - 1)][:L]
    s = draw(L, nb, max(1, k), seed=nb + k + c + 1, visible=visible) if k < nb else draw(L, nb, nb, seed=c)
    positions = torch.randint(0, nb * c, (L,), generator=torch.Generator().manual_seed(nb + 1))
    got = select_blocks_ranked(s, positions, k, c, rows=rows)
    want = by_rank(select_blocks(s, positions, k, c), s, k, c)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("rows,chunk", [(16, 16), (32, 64)])
def test_ranked_select_ties_span_programs(rows, chunk):
    """Equal scores at the k-th place in several programs and comparison chunks: the lowest block indices win,
    as in the one-program kernel, and equal scores are listed by block index (including -0.0 against +0.0, and
    keys all equal)."""
    from strata.kernels.select import select_blocks_ranked

    g = torch.Generator().manual_seed(rows + chunk)
    s = torch.randint(0, 4, (3, 100), generator=g).float()  # heavy ties at every level
    s[1] = torch.where(torch.rand(100, generator=g) < 0.5, 0.0, -0.0)
    s[2] = 1.5
    s[0, 90:] = 3.0
    positions = torch.tensor([399, 250, 3])
    for k in (1, 7, 33, 99, 100):
        got = select_blocks_ranked(s, positions, k, 4, rows=rows, chunk=chunk)
        want = by_rank(select_blocks(s, positions, k, 4), s, k, 4)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), k
    assert got[0][2, :400:4].tolist() == [4 * b for b in range(100)]  # all equal: block order


def test_ranked_select_every_element_written():
    """Poisoned outputs given as `out` are all overwritten (each chosen block lands on a distinct rank < k)."""
    from strata.kernels.select import select_blocks_ranked

    s = draw(2, 300, 64, seed=11, visible=[300, 20])
    idx = torch.full((2, 64 * 4 + 3), -7, dtype=torch.int64)
    ok = torch.full((2, 64 * 4 + 3), 7, dtype=torch.uint8).view(torch.bool)  # neither True nor False
    got = select_blocks_ranked(s, torch.tensor([1199, 83]), 64, 4, out=(idx, ok))
    assert got[0] is idx and got[1] is ok
    assert (idx >= 0).all() and (ok.view(torch.uint8) <= 1).all()
