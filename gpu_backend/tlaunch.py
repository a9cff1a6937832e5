"""Triton launches with less host work per call (GPU only).

Why: the replay step is host-bound (docs/gpu.md), and `kernel[grid](...)` (JITFunction.run)
spends tens of µs of Python per launch on a slow host: knob and environment reads, binding and
specializing every argument, `str(options)` for the cache key, launch-metadata hooks. A step
launches several Triton kernels.

`Launcher` keeps, per specialization, the compiled kernel that the first ordinary launch returns,
and later launches call its launcher directly. The key holds every property Triton specializes
on (tensor dtype and 16-byte alignment; int == 1, int % 16 == 0, int width; the current device),
so two launches with one key run the same compiled code Triton would pick.
"""

from __future__ import annotations

from typing import Any

import torch

_T = torch.Tensor


def _key(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """`_arg_key` of every argument, the common classes inline (half the host time)."""
    return tuple([(a.dtype, a.data_ptr() & 15 == 0) if a.__class__ is _T else
                  (a & 15 == 0, a == 1, -(1 << 31) <= a < (1 << 31), a >= 1 << 63)
                  if a.__class__ is int else
                  _arg_key(a) for a in args])


def _arg_key(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool):
        return ("b", a)
    if isinstance(a, int):
        return (a % 16 == 0, a == 1, -(1 << 31) <= a < (1 << 31), a >= 1 << 63)
    if isinstance(a, float):
        return "f"
    return ("v", a)  # None, strings: part of the signature as Triton sees them


class Launcher:
    """`Launcher(kernel, num_warps=4)(grid, *args, **constexprs)` == kernel[grid](*args,
    **constexprs, num_warps=4). Positional args are the kernel's non-constexpr parameters, in
    order; constexprs go by keyword (every one of them, no defaults)."""

    def __init__(self, fn: Any, **options: Any):
        self.fn, self.options = fn, options
        # the launcher's order; no params: Triton's interpreter (TRITON_INTERPRET=1), no direct
        self.cnames = [p.name for p in getattr(fn, "params", ()) if p.is_constexpr]
        self.direct = hasattr(fn, "params")
        self.cache: dict[Any, Any] = {}

    def __call__(self, grid: tuple[int, ...], *args: Any, **const: Any) -> None:
        if not self.direct:
            self.fn[grid](*args, **const, **self.options)
            return
        dev = torch.cuda.current_device()
        key = (dev, tuple(const.items()), _key(args))
        ck = self.cache.get(key)
        if ck is None:
            ck = self.fn[grid](*args, **const, **self.options)
            self.cache[key] = ck.result() if hasattr(ck, "result") else ck
            return
        g = (*grid, 1, 1)
        # the launcher takes every parameter in order, constexprs too (it skips them)
        ck.run(g[0], g[1], g[2], _stream(dev), ck.function, ck.packed_metadata, None, None,
               None, *args, *[const[n] for n in self.cnames])


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what Triton's driver calls


def _stream(dev: int) -> int:
    if _RAW_STREAM is not None:
        return int(_RAW_STREAM(dev))
    return int(torch.cuda.current_stream(dev).cuda_stream)
