"""Small compiled helpers every kernel module uses, and the two ways kernels are compiled.

No NRT (numba's reference-counted runtime) anywhere on the hot path: with it, every read of a
state tuple's field and every array argument of a helper costs two atomic reference-count
updates, more than the work of a row. Nothing compiled this way may allocate (slice copies
included). Helpers are also inlined into their caller: a call would pass the state tuples
(dozens of array structs) by value. Only `persist` and `finish` allocate (plain njit).
"""

from __future__ import annotations

import numba as nb

from sim.check.compiled.state import G_NV

# numba's type stubs do not know the private `_nrt` flag
entry = nb.njit(cache=True, _nrt=False)  # type: ignore[call-overload]
helper = nb.njit(cache=True, _nrt=False, inline="always")  # type: ignore[call-overload]


@helper
def cdiv(a: int, b: int) -> int:
    """ceil(a / b) with Python's floor semantics, as sim.check.view.ceil_div (any sign)."""
    return -((-a) // b)


@helper
def emit(out, g, code, step, request):  # type: ignore[no-untyped-def]
    """Append one violation (the caller made room: see kernel.run)."""
    k = g[G_NV]
    out.code[k], out.step[k], out.request[k] = code, step, request
    g[G_NV] = k + 1
