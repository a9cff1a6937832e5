"""sim.heap: freed memory stays in the heap inside `kept()`, and is given back after it (or at
`trim()`, after `kept(trim=False)`).

Seen through the process's minor page faults (ten 1 MiB arrays made, written and dropped, pass
after pass: a page that went back to the kernel faults again) and its resident memory. Run in a
fresh interpreter, so that nothing this test process did to its heap first counts.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sim import heap

pytestmark = pytest.mark.skipif(not heap.available(), reason="no glibc mallopt here")

PROBE = r"""
import json, resource
import numpy as np
from sim import heap

def one_pass(arrays=10, words=131197):  # a 64 x 2k prompts' step's token arrays
    held = [np.empty(words, np.int64) for _ in range(arrays)]
    for a in held:
        a.fill(1)

def faults(passes=20):
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(passes):
        one_pass()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

out = {"default": faults()}
with heap.kept():
    one_pass()  # the heap grows to hold a pass once
    out["kept"] = faults()
    with heap.kept():
        pass
    out["kept_after_inner"] = faults()  # the outer block still keeps
    big = [np.ones(1 << 21, np.int64) for _ in range(16)]  # 256 MiB in 16 MiB blocks
    del big
    out["rss_kept_mb"] = rss_mb()
out["rss_after_mb"] = rss_mb()
out["after"] = faults()
with heap.kept(trim=False):  # the replay's: the freed memory stays until `heap.trim()`
    big = [np.ones(1 << 21, np.int64) for _ in range(16)]
    small = [np.ones(1000 + i, np.int64) for i in range(100)]  # above the big ones
    del big
out["rss_untrimmed_mb"] = rss_mb()
heap.trim()
out["rss_trimmed_mb"] = rss_mb()
print(json.dumps(out))
"""

PAGES = 20 * 10 * 131197 * 8 // 4096  # the pages a `faults()` writes


def test_kept_reuses_freed_pages_and_gives_them_back_at_its_end() -> None:
    got = json.loads(subprocess.run([sys.executable, "-c", PROBE], check=True,
                                    capture_output=True, text=True).stdout)
    assert got["kept"] < PAGES // 50, got  # at most the first pass's pages
    assert got["kept_after_inner"] < PAGES // 50, got
    assert got["rss_kept_mb"] - got["rss_after_mb"] > 200, got  # the 256 MiB held, then not
    # after: no more faults than with glibc's defaults in a fresh process
    assert got["after"] <= got["default"] * 1.1, got
    # kept(trim=False): still held after the block, given back by trim()
    assert got["rss_untrimmed_mb"] - got["rss_trimmed_mb"] > 200, got
