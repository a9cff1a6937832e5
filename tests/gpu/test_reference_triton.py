"""The Triton kernels of the replay (gpu_backend/device/reference_triton.py, poolk.py) against the
torch path
they replace (the torch path, where Triton is missing) and, for the reference, against fp64.

Every kernel runs at least twice per shape: the first launch goes through Triton's own path and
compiles, later ones through `pool_triton.Launcher`'s cached direct launch."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from gpu_backend.device import pool, reference
from gpu_backend.device.pool import KVPool, content_kv_q, mod_m

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.fixture
def fused() -> Iterator[ModuleType]:
    mod = pytest.importorskip("gpu_backend.device.reference_triton")
    assert reference.triton_kernels() is mod
    yield mod


def _torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reference, "triton_kernels", lambda: None)  # as where Triton is missing


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int16 if x.element_size() == 2 else torch.int32)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit where a number, NaN at the same places (NaN payloads differ by path: a NaN set
    in bf16 on the host is 0x7FC0, one converted on the device 0x7FFF)."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(_bits(a.nan_to_num(0.0)),
                                                             _bits(b.nan_to_num(0.0)))


# --- content: K/V/Q bit for bit, truth writes included -------------------------------------

@pytest.mark.parametrize(("n", "q", "dtype", "heads"), [
    (1, True, torch.bfloat16, (2, 8, 64)), (256, True, torch.bfloat16, (8, 32, 128)),
    (300, False, torch.float16, (2, 8, 64)),
    (131_072, True, torch.bfloat16, (8, 32, 128)),  # a prompt step: past grid y's 65,535
    # CONTENT_TOKENS a program (n >= CONTENT_LONG), the last program's tokens partly past n,
    # truth writes too
    (20_003, True, torch.bfloat16, (8, 32, 128)),
])
def test_content_kernel_is_bitwise_the_torch_path(fused: ModuleType,
                                                  monkeypatch: pytest.MonkeyPatch, n: int,
                                                  q: bool, dtype: torch.dtype,
                                                  heads: tuple[int, int, int]) -> None:
    hkv, hq, d = heads
    rng = np.random.default_rng(n)
    tok = torch.as_tensor(mod_m(rng.integers(0, 200_000, n)), device=DEV)
    pos = torch.as_tensor(mod_m(rng.integers(0, 1 << 20, n)), device=DEV)
    slots, span = (7, 64) if n <= 448 else (40, 512)
    truth_args = None  # unique (slot, position) cells, as a step's truth writes are
    if n <= slots * span:
        cell = torch.as_tensor(rng.permutation(slots * span)[:n], device=DEV)
        truth_args = (cell // span, cell % span)
    outs = []
    for run in range(3):  # fused twice (compile, then the direct launch), then torch
        if run == 2:
            _torch_path(monkeypatch)
        store = torch.full((2, slots, hkv, span, d), float("nan"), dtype=dtype, device=DEV)
        tr = None if truth_args is None else (store, *truth_args)
        kv, qh = content_kv_q(tok, pos, hkv, hq, d, dtype, q, truth=tr)
        outs.append((kv, qh, store))
    for kv, qh, store in outs[:2]:
        assert torch.equal(_bits(kv), _bits(outs[2][0]))
        assert (qh is None) == (not q) and (qh is None or torch.equal(_bits(qh),
                                                                       _bits(outs[2][1])))
        assert torch.equal(_bits(store), _bits(outs[2][2]))
    assert not outs[0][0].isnan().any() and outs[0][0].abs().max() > 0.5
    if truth_args is not None:
        assert not torch.isnan(outs[0][2][:, truth_args[0], :, truth_args[1]]).any()


def test_content_blocks_on_the_gpu_is_bitwise_the_torch_path(
        fused: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(1)
    tok, pos = (torch.as_tensor(mod_m(rng.integers(0, 1 << 30, 77)), device=DEV) for _ in "tp")
    nan = torch.as_tensor(rng.random((6, 77, 1, 1)) < 0.1, device=DEV)
    a = pool.content_blocks(tok, pos, 4, 16, 128, torch.bfloat16, nan=nan)
    _torch_path(monkeypatch)
    b = pool.content_blocks(tok, pos, 4, 16, 128, torch.bfloat16, nan=nan)
    assert _same(a, b) and a.isnan().any()


# --- reference attention: tight to the torch fp32 path, ~1e-6 to fp64 ------------------------

def _fp64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """q [R, W, Hq, D], k/v [R, Hkv, L, D], key i visible to query j iff i <= limit[r, j]."""
    R, W, Hq, D = q.shape
    g = Hq // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("rwhd,rhld->rhwl", q.double(), kk) / D ** 0.5
    keys = torch.arange(k.shape[2], device=q.device)
    s = s.masked_fill((keys > limit[:, :, None])[:, None], float("-inf"))
    return torch.einsum("rhwl,rhld->rwhd", s.softmax(-1), vv)


@pytest.mark.parametrize(("R", "W", "Hq", "Hkv", "D", "span", "dtype"), [
    (64, 4, 32, 8, 128, 2100, torch.bfloat16),  # the benchmark's verify step (GQA 4)
    (1, 512, 32, 8, 128, 3000, torch.bfloat16),  # a long prefill chunk
    (48, 1, 32, 8, 128, 1500, torch.bfloat16),  # decode
    (5, 3, 8, 8, 64, 333, torch.float16),  # no GQA, fp16, L not a multiple of the tile
    (3, 7, 12, 2, 32, 100, torch.bfloat16),  # GQA 6: padded query tiles
])
def test_reference_kernel_matches_torch_fp32_and_fp64(fused: ModuleType, R: int, W: int, Hq: int,
                                                      Hkv: int, D: int, span: int,
                                                      dtype: torch.dtype) -> None:
    g = torch.Generator(device=DEV).manual_seed(R * 1000 + W)
    nslots = R + 3
    kv = (torch.rand(2, nslots, Hkv, span, D, device=DEV, generator=g) * 2 - 1).to(dtype)
    q = ((torch.rand(R, W, Hq, D, device=DEV, generator=g) * 2 - 1) * 4).to(dtype)
    slots = torch.randperm(nslots, device=DEV, generator=g)[:R]  # not consecutive
    committed = torch.randint(1, span - W, (R,), device=DEV, generator=g)
    limit = committed[:, None] + torch.arange(W, device=DEV)[None, :]
    L = int(limit.max()) + 1
    k, v = kv[0, slots, :, :L], kv[1, slots, :, :L]
    ref32 = reference.attend(q, k, v, limit, int(limit.min()) + 1)
    ref64 = _fp64(q, k, v, limit)
    for _ in range(2):
        out = fused.attend(q, kv, slots, limit, L)
        # H200, these seeds: max |out - fp64| 1.45e-6 .. 1.91e-6 (up to 2.8e-6 on a
        # 512-query chunk); a key off by one moves an output by ~1e-2
        assert (out.double() - ref64).abs().max().item() < 3e-6
        assert (out - ref32).abs().max().item() < 6e-6  # the torch path: 1e-6 / 3.4e-6 to fp64


def test_reference_kernel_on_causal_prompts(fused: ModuleType) -> None:
    # a prompt's rows start at 0: each tile of queries stops at its own last visible key. 1000
    # queries: tiles of 64 that span two heads (the tile's keys end at the first head's last)
    g = torch.Generator(device=DEV).manual_seed(11)
    R, W, Hq, Hkv, D = 2, 1000, 32, 8, 128
    kv = (torch.rand(2, R, Hkv, W, D, device=DEV, generator=g) * 2 - 1).bfloat16()
    q = ((torch.rand(R, W, Hq, D, device=DEV, generator=g) * 2 - 1) * 4).bfloat16()
    slots = torch.tensor([1, 0], device=DEV)
    limit = torch.arange(W, device=DEV)[None, :].repeat(R, 1)
    out = fused.attend(q, kv, slots, limit, W)
    ref = _fp64(q, kv[0, slots], kv[1, slots], limit)
    assert (out.double() - ref).abs().max().item() < 3e-6
    # query 0 sees key 0 alone: its output is V_0, exactly
    assert torch.equal(out[:, 0], kv[1, slots, :, 0].float().repeat_interleave(Hq // Hkv, 1))


@pytest.mark.parametrize("committed", [0, 63, 64, 65, 200])
def test_lean_reference_kernel_at_the_edges_of_its_unmasked_blocks(fused: ModuleType,
                                                                   committed: int) -> None:
    # a launch of more than ONE_TILE queries a kv head goes lean (`_attend_kernel`'s LEAN): the
    # blocks every query of a tile sees unmasked. 17 queries x 4 group heads: two tiles of 64,
    # the second 4 queries and 60 of padding; committed keys around the 64-key blocks' edges
    g = torch.Generator(device=DEV).manual_seed(17 + committed)
    R, W, Hq, Hkv, D = 3, 17, 32, 8, 128
    assert Hq // Hkv * W > fused.ONE_TILE
    span = committed + W + 5
    kv = (torch.rand(2, R + 1, Hkv, span, D, device=DEV, generator=g) * 2 - 1).bfloat16()
    q = ((torch.rand(R, W, Hq, D, device=DEV, generator=g) * 2 - 1) * 4).bfloat16()
    slots = torch.tensor([2, 0, 3], device=DEV)
    limit = (committed + torch.arange(W, device=DEV))[None, :].repeat(R, 1)
    L = committed + W
    out = fused.attend(q, kv, slots, limit, L)
    ref = _fp64(q, kv[0, slots, :, :L], kv[1, slots, :, :L], limit)
    assert (out.double() - ref).abs().max().item() < 3e-6
    if committed == 0:  # query 0 sees key 0 alone: its output is V_0, exactly
        assert torch.equal(out[:, 0], kv[1, slots, :, 0].float().repeat_interleave(4, 1))


@pytest.mark.parametrize("committed", [0, 37])
def test_context_rows_in_one_launch_are_each_rows_own(fused: ModuleType, committed: int) -> None:
    # `attend_rows`: rows of several lengths (each >= 16 queries a group head: the tiles of
    # their own launches), their tokens anywhere in the step's q, slots in any order, prompts
    # or chunks after `committed` keys. Each row bit for bit its own `attend`; the tokens of
    # no row (a gen row's, between them) left as they were
    g = torch.Generator(device=DEV).manual_seed(13)
    Hq, Hkv, D = 32, 8, 128
    lens, slots = [700, 64, 1003, 300], [3, 0, 4, 1]
    first = [5, 5 + 700 + 2, 5 + 700 + 2 + 64, 5 + 700 + 2 + 64 + 1003 + 9]
    n, span = first[-1] + lens[-1] + 4, committed + max(lens)
    kv = (torch.rand(2, 5, Hkv, span, D, device=DEV, generator=g) * 2 - 1).bfloat16()
    q = ((torch.rand(n, Hq, D, device=DEV, generator=g) * 2 - 1) * 4).bfloat16()
    rows = torch.tensor([first, lens, [committed] * 4], device=DEV)
    out = torch.full((n, Hq, D), float("nan"), device=DEV)
    got = fused.attend_rows(q, kv, torch.tensor(slots, device=DEV), rows, max(lens), span,
                            out=out)
    assert got.data_ptr() == out.data_ptr()
    mine = torch.zeros(n, dtype=torch.bool, device=DEV)
    for t0, w, s in zip(first, lens, slots, strict=True):
        lim = (committed + torch.arange(w, device=DEV))[None, :]
        alone = fused.attend(q[t0: t0 + w][None], kv, torch.tensor([s], device=DEV), lim,
                             committed + w)[0]
        assert _same(out[t0: t0 + w], alone)
        mine[t0: t0 + w] = True
    assert out[~mine].isnan().all()
    with pytest.raises(ValueError, match="rows"):
        fused.attend_rows(q, kv, torch.tensor(slots, device=DEV), rows.int(), max(lens), span,
                          out=out)


def test_reference_kernel_on_a_misaligned_query_view(fused: ModuleType) -> None:
    # Launcher keys on 16-byte alignment: a view 2 bytes in must not reuse the aligned kernel
    g = torch.Generator(device=DEV).manual_seed(7)
    kv = (torch.rand(2, 4, 2, 80, 64, device=DEV, generator=g) * 2 - 1).bfloat16()
    base = ((torch.rand(3 * 2 * 8 * 64 + 1, device=DEV, generator=g) * 2 - 1) * 4).bfloat16()
    slots = torch.tensor([2, 0, 3], device=DEV)
    limit = torch.tensor([[40, 41], [70, 71], [9, 10]], device=DEV)
    for off in (0, 1, 0, 1):
        q = base[off: off + 3 * 2 * 8 * 64].view(3, 2, 8, 64)
        out = fused.attend(q, kv, slots, limit, 72)
        ref = _fp64(q, kv[0, slots, :, :72], kv[1, slots, :, :72], limit)
        assert (out.double() - ref).abs().max().item() < 6e-6


def test_reference_kernel_writes_into_a_slice_of_the_steps_output(fused: ModuleType) -> None:
    # `reference.reference` hands a context row's group its slice of the step's output (out=):
    # the same bits as a fresh output, nothing written outside the slice; a wrong out refused
    g = torch.Generator(device=DEV).manual_seed(5)
    W, Hq, Hkv, D = 300, 32, 8, 128
    kv = (torch.rand(2, 2, Hkv, W, D, device=DEV, generator=g) * 2 - 1).bfloat16()
    q = ((torch.rand(1, W, Hq, D, device=DEV, generator=g) * 2 - 1) * 4).bfloat16()
    slots = torch.tensor([1], device=DEV)
    limit = torch.arange(W, device=DEV)[None, :]
    step = torch.full((W + 40, Hq, D), float("nan"), device=DEV)
    got = fused.attend(q, kv, slots, limit, W, out=step[17: 17 + W].view(1, W, Hq, D))
    assert got.data_ptr() == step[17].data_ptr()
    assert _same(step[17: 17 + W], fused.attend(q, kv, slots, limit, W)[0])
    assert step[:17].isnan().all() and step[17 + W:].isnan().all()
    with pytest.raises(ValueError, match="out"):
        fused.attend(q, kv, slots, limit, W, out=step[:W].view(1, W, Hq, D).bfloat16())


# --- per-token errors: the torch path's values, NaN and inf included -----------------------

def test_token_error_kernel_is_the_torch_path_with_nan_and_inf(fused: ModuleType,
                                                               monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    g = torch.Generator(device=DEV).manual_seed(3)
    n, H, D = 300, 32, 128
    ref = torch.rand(n, H, D, device=DEV, generator=g) * 2 - 1
    out = (ref + torch.randn(n, H, D, device=DEV, generator=g) * 1e-3).bfloat16()
    out[3, 5, 7] = float("nan")  # a poisoned read
    ref[10, 0, 0] = float("nan")  # the reference itself
    out[20, 31, 127] = float("inf")
    ref[30, 1, 2] = float("inf")
    out[40, 2, 2], ref[40, 2, 2] = float("inf"), float("inf")  # inf - inf: NaN
    ref[50] = float("-inf")
    out[60, :, :] = float("nan")
    got = [fused.token_errors(out, ref) for _ in range(2)]
    _torch_path(monkeypatch)
    want = reference.token_errors(out, ref)
    for x in got:
        torch.testing.assert_close(x, want, rtol=0, atol=0, equal_nan=True)
    assert want[0, [3, 10, 40, 60]].isnan().all() and want[0, 20].isinf()
    assert want[1, 10].isnan() and want[1, 30].isinf() and not want[0, 0].isnan()


def test_an_unwritten_buffers_tokens_judge_as_a_whole_nan_buffers(fused: ModuleType) -> None:
    """`reference.unwritten` on the device (a strided fill of each head vector's first element):
    the fused errors of its unwritten tokens and heads are those of a buffer all NaN."""
    from test_unwritten import with_garbage, written

    g = torch.Generator(device=DEV).manual_seed(4)
    n, H, D = 300, 32, 128
    q = torch.rand(n, H, D, device=DEV, generator=g).bfloat16()
    ref = torch.rand(n, H, D, device=DEV, generator=g) * 2 - 1
    bare = reference.unwritten(q)
    assert bare[..., 0].isnan().all() and bare.shape == q.shape and bare.dtype == q.dtype
    want = fused.token_errors(written(torch.full_like(q, float("nan")), ref), ref)
    got = fused.token_errors(written(with_garbage(q), ref), ref)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert got[0, [4, 5, 6, 9]].isnan().all() and not got[0, [0, 8, 10, 299]].isnan().any()


# --- pool: poison rows and page sums, bit for bit -------------------------------------------

@pytest.mark.parametrize(("pages", "heads", "dim", "rows", "resummed", "moved"), [
    # 20 pool pages (2 guards each side) of 2 * B = 32 rows: rows 1, 5..7 are in guard page 0
    # (NaN already), 33 in page 1, 300 in page 9, 600 in guard page 18; 1024 words a page
    (16, 2, 64, [5, 6, 7, 600, 33, 1, 300], [1, 3, 9, 19], [1, 9]),
    # the benchmark's page, 8192 words: the kernel loops over it
    (6, 8, 128, [2, 40, 100, 290], [1, 3, 7, 9], [1, 3]),
])
def test_page_sums_kernel_is_the_torch_checksum(fused: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                                pages: int, heads: int, dim: int, rows: list[int],
                                                resummed: list[int], moved: list[int]) -> None:
    runs = []
    for torch_path in (False, False, True):
        if torch_path:
            _torch_path(monkeypatch)
        p = KVPool(pages, 2, 16, heads, dim, torch.bfloat16, DEV)
        g = torch.Generator(device=DEV).manual_seed(5)
        p.data[1:pages + 2] = torch.rand(p.data[1:pages + 2].shape, device=DEV,
                                         generator=g).bfloat16()
        before = p.checksum()
        p.poison_rows(torch.tensor(rows, device=DEV))
        sums = before.clone()
        p.resum(sums, torch.tensor(resummed, device=DEV))
        after, changed = p.sums_and_changes(before)
        runs.append((_bits(p.data), before, sums, after, changed))
    for got in runs[:2]:
        for a, b in zip(got, runs[2], strict=True):
            assert torch.equal(a, b)
    _, before, sums, after, changed = runs[2]
    assert changed.nonzero().flatten().tolist() == moved  # NaN over NaN moves no sum
    assert torch.equal(sums, after) and not torch.equal(sums, before)


# --- the whole replay: the same verdicts through the kernels as through the torch path -------

@pytest.mark.parametrize("name", ["clean_mtp", "append_past_alloc", "shared_block_written",
                                  "overlap_uncorrected"])
def test_replay_gives_the_torch_paths_verdicts(fused: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path, name: str) -> None:
    from replay_traces import SCENARIOS

    from gpu_backend.replay.run import run_replay
    from gpu_backend.verdicts import DEFAULT_TOL

    trace = SCENARIOS[name](tmp_path / name)
    got = run_replay(trace, "flashinfer", DEFAULT_TOL)
    _torch_path(monkeypatch)
    want = run_replay(trace, "flashinfer", DEFAULT_TOL)
    assert [(r.step, r.row, r.verdict) for r in got.rows] == \
        [(r.step, r.row, r.verdict) for r in want.rows]
    # the two references differ by ~1e-6 (above); FlashInfer's output is the same
    np.testing.assert_allclose([r.err for r in got.rows], [r.err for r in want.rows], rtol=0,
                               atol=1e-5)
