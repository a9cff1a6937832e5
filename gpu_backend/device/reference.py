"""The truth side of the replay: contiguous per-request K/V, the fp32 reference output per row,
and the per-row verdicts (docs/design.md §6).

Verdicts, most severe first: fault > corrupt > nan > mismatch > ok. The device keeps, per step,
only what the verdicts need (per-token max error and NaN flags, the pages whose checksum moved);
`verdicts` turns them into codes on the host once the replay's read-back has arrived (queued
every `loop.EARLY` steps), so no step waits for the device.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import torch

from gpu_backend.host.batch import RefGroup
from gpu_backend.host.staging import StepArrays


@functools.lru_cache(maxsize=1)
def triton_kernels() -> ModuleType | None:
    """gpu_backend.device.reference_triton, or None without Triton (the CPU, a GPU image without
    it)."""
    try:
        from gpu_backend.device import reference_triton
    except ImportError:
        return None
    return reference_triton


SCORES_BYTES = 1 << 28  # fp32 scores `attend` holds at once; past it, rows (then queries) go in
# parts: a prompts' step of 64 x 2k queries over 2k keys needed 34.5 GB in one piece, and the
# reference backend stopped on it with the CPU out of memory


# on the CPU a row's queries past this many go in blocks, each over the keys it can see
# (`_causal`): a prompt's causal mask hides half of its scores
QUERY_BLOCK = 256


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, limit: torch.Tensor,
           lo: int = 0) -> torch.Tensor:
    """`_attend` in parts of at most SCORES_BYTES of scores: rows, and a row's queries when one
    row is over it (each query's softmax is its own, so the parts' outputs are the whole's)."""
    R, W, Hq, _ = q.shape
    if R == 1 and W > QUERY_BLOCK and not q.is_cuda:
        return _causal(q, k, v, limit, lo)
    per_query = Hq * k.shape[2] * 4
    if R * W * per_query <= SCORES_BYTES or R * W == 1:
        return _attend(q, k, v, limit, lo)
    if R > 1:
        n = max(SCORES_BYTES // (W * per_query), 1)
        return torch.cat([attend(q[i:i + n], k[i:i + n], v[i:i + n], limit[i:i + n], lo)
                          for i in range(0, R, n)])
    n = max(SCORES_BYTES // per_query, 1)
    return torch.cat([_attend(q[:, j:j + n], k, v, limit[:, j:j + n], lo)
                      for j in range(0, W, n)], dim=1)


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, limit: torch.Tensor,
            lo: int) -> torch.Tensor:
    """One row's queries in blocks of QUERY_BLOCK, each over keys [0, its last limit]: the keys
    past it are masked for the whole block, so leaving them out only drops exp(-inf) = 0 terms
    (rounding may differ: the sums are blocked differently). On the CPU only: the bound is read
    on the host, which on a GPU would wait for the device."""
    L, parts = k.shape[2], []
    for j in range(0, q.shape[1], QUERY_BLOCK):
        lim = limit[:, j:j + QUERY_BLOCK]
        hi = min(max(int(lim.max()) + 1, 1), L)
        parts.append(attend(q[:, j:j + QUERY_BLOCK], k[:, :, :hi], v[:, :, :hi], lim,
                            min(lo, hi)))
    return torch.cat(parts, dim=1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, limit: torch.Tensor,
            lo: int = 0) -> torch.Tensor:
    """Softmax attention in fp32 with a per-query key limit (key i visible iff i <= limit).

    Args: q [R, W, Hq, D]; k, v [R, Hkv, L, D] (HND: (r, h) flattens into one matmul batch with
    no copy); limit [R, W] int64; lo: keys below it are visible to every query (only the tail
    [lo, L) is masked). Returns [R, W, Hq, D] fp32.

    On the GPU with bf16/fp16 K/V the products run on the tensor cores with fp32 outputs: the
    inputs are bf16/fp16 values, so every product is exact in fp32 and only the summation order
    differs from an fp32 matmul. P (fp32) is split into hi + lo halves of V's dtype for P·V, so P
    keeps ~16 bits (output error ~1e-6, measured against fp64 on the H200; the kernels' own noise
    is ~2e-3). Elsewhere everything is upcast to fp32.
    """
    R, W, Hq, D = q.shape
    hkv, L = k.shape[1], k.shape[2]
    g = Hq // hkv
    fast = q.is_cuda and k.dtype in (torch.bfloat16, torch.float16)
    if not fast:
        q, k, v = q.float(), k.float(), v.float()
    qg = q.to(k.dtype).view(R, W, hkv, g, D).permute(0, 2, 3, 1, 4).reshape(R * hkv, g * W, D)
    kt = k.flatten(0, 1).transpose(1, 2)  # [R*hkv, D, L]
    s = (torch.bmm(qg, kt, out_dtype=torch.float32) if fast else torch.bmm(qg, kt))
    s = s.view(R, hkv, g, W, L).div_(math.sqrt(D))
    if lo < L:
        keys = torch.arange(lo, L, device=q.device)
        s[..., lo:].masked_fill_((keys > limit[:, :, None])[:, None, None], float("-inf"))
    p = torch.softmax(s, dim=-1).view(R * hkv, g * W, L)
    vf = v.flatten(0, 1)
    if fast:
        hi = p.to(v.dtype)
        o = torch.bmm(torch.cat([hi, (p - hi).to(v.dtype)], 1), vf, out_dtype=torch.float32)
        o = o[:, : g * W] + o[:, g * W:]
    else:
        o = torch.bmm(p, vf)
    return o.view(R, hkv, g, W, D).permute(0, 3, 1, 2, 4).reshape(R, W, Hq, D)


class TruthStore:
    """Contiguous truth K and V per live request: [2, slots, H_kv, span, D] in the trace's dtype
    (the content is rounded to it, as the kernels see it; `attend` computes in fp32). Slots are
    handed out on the host (`prepare`)."""

    def __init__(self, slots: int, span: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, side: bool = False):
        self.kv = torch.zeros((2, slots, kv_heads, span, head_dim), dtype=dtype, device=device)
        # the stream the reference runs on (`beside`), or None: in order on the current stream
        self.side = _side_stream(torch.device(device)) if side else None

    def write(self, slots: torch.Tensor, pos: torch.Tensor, kv: torch.Tensor) -> None:
        """kv [2, n, H_kv, D] (content_blocks' K and V) at (slot, position) pairs."""
        self.kv[:, slots, :, pos] = kv.permute(1, 0, 2, 3)


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream a device for every replay of the process: what the caching allocator
    holds for a stream is reused by the same stream only."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _side_streams(index)


@functools.cache
def _side_streams(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(index)


@contextmanager
def beside(side: torch.cuda.Stream | None) -> Iterator[None]:
    """Queue the work inside on `side` (None: where it is), after everything queued so far on
    the current stream: the content that wrote the truth and the queries the reference reads.
    Nothing else reads or writes them before `join`, after which the current stream's work
    (the token errors, the next step's content) waits for it. Inside a graph's capture the two
    streams are two branches of the graph."""
    if side is None:
        yield
        return
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        yield


def join(side: torch.cuda.Stream | None) -> None:
    """The current stream waits for the work `beside` queued on `side`."""
    if side is not None:
        torch.cuda.current_stream().wait_stream(side)


def together(device: torch.device | str) -> bool:
    """Whether a step's context rows share one reference launch: only `reference_triton.attend_rows`
    takes such a group, on CUDA."""
    return torch.device(device).type == "cuda" and triton_kernels() is not None


def reference(truth: TruthStore, dv: StepArrays, groups: list[RefGroup],
              q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 reference output [nnz_q, Hq, D] for q [nnz_q, Hq, D] (built at true positions).
    On the GPU one Triton launch per group (`reference_triton`: the truth slots are read in place),
    else
    `attend` over the group's truth K/V. out: where the launches write it, if given (fp32
    [nnz_q, Hq, D]; the torch path may return another tensor)."""
    n, Hq, D = q.shape
    fused = triton_kernels() if q.is_cuda else None
    if fused is not None and not fused.supported(q, truth.kv):
        fused = None
    for g in groups:
        pre = g.pre
        if g.ragged:  # context rows of any lengths, by token, in place
            if fused is None:
                raise RuntimeError("a reference group of context rows together needs "
                                   "gpu_backend.device.reference_triton (HostState.together)")
            if out is None:
                out = torch.empty((n, Hq, D), dtype=torch.float32, device=q.device)
            fused.attend_rows(q, truth.kv, dv[pre + "slots"], dv[pre + "rows"], g.W, g.L,
                              out=out)
            continue
        if g.view:  # the group's tokens in order: q and the output as views (`RefGroup.view`)
            at = slice(g.span[0], g.span[0] + g.R * g.W) if g.span is not None else slice(0, n)
            qg = q[at].view(g.R, g.W, Hq, D)
        else:
            qg = q[dv[pre + "tok"]]
        if g.identity and fused is None:
            return attend_group(truth, dv, g, qg).reshape(n, Hq, D)
        if out is None:
            out = torch.empty((n, Hq, D), dtype=torch.float32, device=q.device)
        into = out[at].view(g.R, g.W, Hq, D) if fused is not None and g.view else None
        o = fused.attend(qg, truth.kv, dv[pre + "slots"], group_limit(dv, g), g.L, out=into) \
            if fused is not None else attend_group(truth, dv, g, qg)
        if into is not None:  # written in place
            continue
        o = o.reshape(g.R * g.W, Hq, D)
        if g.span is not None:
            out[g.span[0]: g.span[1]] = o[: g.span[1] - g.span[0]]
        else:
            out.index_copy_(0, dv[pre + "dst"], o.index_select(0, dv[pre + "src"]))
    assert out is not None, "a step without rows has no reference"
    return out


def group_limit(dv: StepArrays, g: RefGroup) -> torch.Tensor:
    """Group g's limits on the device, [R, W]: query j of row i sees keys up to limit[i, j]. A
    context row's own group reads them from the step's true positions (`RefGroup.true_limit`)."""
    if g.true_limit:
        assert g.span is not None
        return dv["true_pos"][g.span[0]: g.span[1]].view(1, g.W)
    return dv[g.pre + "limit"]


def attend_group(truth: TruthStore, dv: StepArrays, g: RefGroup, qg: torch.Tensor
                 ) -> torch.Tensor:
    """`attend` of one group's queries over its truth K/V (consecutive slots: views, no
    gather)."""
    sel = slice(g.s0, g.s0 + g.R) if g.s0 >= 0 else dv[g.pre + "slots"]
    k, v = truth.kv[0, sel, :, : g.L], truth.kv[1, sel, :, : g.L]
    return attend(qg, k, v, group_limit(dv, g), g.lo)


def unwritten(q: torch.Tensor) -> torch.Tensor:
    """The kernels' out= buffer for queries q [nnz_q, Hq, D]: q's shape and dtype, reading as
    NaN wherever no launch writes. Only the first element of each (token, head) vector is set
    NaN, the rest is left as allocated: a kernel writes a head's vector whole, and
    `token_errors` gives a token with a NaN anywhere in its vectors a NaN error, so a token no
    launch writes judges `nan`, as it did with the whole buffer NaN. Why not all of it: at a
    64 x 2k prompts' step that fill wrote 1.07 GB on the device before the kernels could start
    (0.74 ms of bf16 fills, the pool's poison with it); this one sets one
    element in D."""
    out = torch.empty_like(q)
    out.select(-1, 0).fill_(float("nan"))
    return out


def token_errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """[2, nnz_q] fp32 on the device: max |out - ref| per token (NaN where either holds a NaN),
    and max ref per token (NaN where the reference does)."""
    fused = triton_kernels() if out.is_cuda else None
    if fused is not None:  # one launch instead of six
        return fused.token_errors(out, ref)
    err = (out - ref).abs_().flatten(1).amax(1)
    return torch.stack([err, ref.flatten(1).amax(1)])
