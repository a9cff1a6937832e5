"""Host -> device staging: many steps' index arrays in one pinned buffer and one copy.

A copy from pageable host memory makes CUDA synchronize the stream first, and every small upload
costs a launch. Here the host packs the arrays of a whole chunk of steps (`gpu_backend.host.prepare`
builds them ahead) into one pinned int64 buffer and copies it with `non_blocking=True`; the
device then holds it as int64 (indexing), int32 (kernel arguments) and bool (masks), the last
two converted there when a view first needs them, so no step converts anything on the host but
the few small int32 arrays the FlashInfer planners read on the host (`HOST32`, made on
first use). The chunk's buffers are never written again, so nothing waits for a copy to finish
before reusing them.

How `prepare.prepared_steps` cuts the replayed steps into chunks (`ramp`), and how many
words it gives a chunk ahead (`words_ahead`, for `staging.Chunk(words=)`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import numpy as np
import torch

ALIGN = 32  # words: every array starts 256 B (int64) / 128 B (int32) aligned, as an allocation
# the forms a staged array is read in, each one copy of its chunk: int64, int32 and bool on the
# device, int32 on the host (a copy, for a planner), float64 on the device (arrays staged as it)
I64, I32, MASK, HOST32, F64 = "d64", "d32", "db", "h32", "f64"
Slot = tuple[tuple[int, ...], tuple[int, ...], int]  # an array's (shape, strides, offset)
_ZEROS = np.zeros(ALIGN, dtype=np.int64)  # padding between arrays (only ever read)


class Chunk:
    """One pinned upload of many steps' arrays; `add` (or `claim`) before `upload`, `view`
    after. words > 0: the arrays are written into a pinned buffer of that many words as they
    are added (grown if they outgrow it), and `upload` copies nothing on the host; else they are
    queued and concatenated into one at `upload` (a chunk of unknown size: the prompts' step)."""

    def __init__(self, device: torch.device | str, words: int = 0):
        self.dev = torch.device(device)
        self.parts: list[np.ndarray] = []
        self.n = 0
        self.bufs: dict[str, torch.Tensor] = {}
        # the buffer written in place (None: `parts`). Why: at 64 x 2k a generation step
        # stages ~13.5k words, and their concatenation was ~8% of its preparation on a
        # development machine; `claim` lets a compiled pass write its block there directly
        self.h64 = self.pinned(words) if words > 0 else None
        self.host = self.h64.numpy() if self.h64 is not None else None

    def add(self, a: np.ndarray) -> Slot:
        """Stage one array (int64, or float64 stored as its bits); returns its slot."""
        if a.ndim == 1:  # most arrays: no stride arithmetic (~1 µs less each), and int32 and
            # bool ones are widened by the copy into the buffer, not here
            flat = a.view(np.int64) if a.dtype == np.float64 else _integral(a)
            shape: tuple[int, ...] = a.shape
            strides: tuple[int, ...] = (1,)
        else:
            a = np.ascontiguousarray(a)
            flat = a.view(np.int64).ravel() if a.dtype == np.float64 else \
                a.astype(np.int64, copy=False).ravel()
            shape = a.shape
            strides = tuple(int(x) // a.itemsize for x in a.strides) if flat.size else \
                (1,) * a.ndim
        off = self._aligned(flat.size)
        if self.host is not None:
            self.host[off: self.n] = flat
        else:
            self.parts.append(flat)
        return shape, strides, off

    def claim(self, n: int) -> tuple[int, np.ndarray]:
        """(offset, n words) at the chunk's end for the caller to write before `upload`;
        `trim` gives back what it leaves unused."""
        off = self._aligned(n)
        if self.host is not None:
            return off, self.host[off: self.n]
        self.parts.append(np.empty(n, np.int64))
        return off, self.parts[-1]

    def trim(self, end: int) -> None:
        """The chunk ends at word `end` (at most where it ends): a claim's unused words, or a
        claim and its padding undone."""
        extra, self.n = self.n - end, end
        while extra > 0 and self.host is None:
            last = self.parts[-1]
            if len(last) > extra:
                self.parts[-1] = last[: len(last) - extra]
                return
            self.parts.pop()
            extra -= len(last)

    def _aligned(self, n: int) -> int:
        """Room for n words at the next aligned offset (kernels may load index arrays with
        vector instructions), the padding zeroed; returns the offset and moves the end."""
        pad = -self.n % ALIGN
        off = self.n + pad
        if self.host is not None:
            if off + n > len(self.host):
                self._grow(off + n)
            self.host[self.n: off] = 0
        elif pad:
            self.parts.append(_ZEROS[:pad])
        self.n = off + n
        return off

    def _grow(self, need: int) -> None:
        assert self.host is not None
        h64 = self.pinned(max(need, 2 * len(self.host)))
        host = h64.numpy()
        host[: self.n] = self.host[: self.n]
        self.h64, self.host = h64, host

    def upload(self) -> None:
        if self.h64 is not None:
            h64 = self.h64[: max(self.n, 1)]
        else:
            h64 = self.pinned(max(self.n, 1))
            if self.parts:
                np.concatenate(self.parts, out=h64.numpy()[: self.n], casting="safe")
        self.load(h64)

    def words(self) -> np.ndarray:
        """The staged arrays as the one int64 buffer `upload` would copy (a copy)."""
        if self.host is not None and self.n:
            return self.host[: self.n].copy()
        return np.concatenate(self.parts, dtype=np.int64, casting="safe") if self.parts else \
            np.zeros(1, dtype=np.int64)

    def pinned(self, n: int) -> torch.Tensor:
        """n int64 words on the host, pinned when they go to a CUDA device."""
        return torch.empty(n, dtype=torch.int64, pin_memory=self.dev.type == "cuda")

    def load(self, h64: torch.Tensor) -> None:
        """The device copy of the staged words. Its int32 and bool forms are made there (a
        host-side int32 twin converted every word of every chunk on the host), when a view first
        needs them: a chunk of CUDA-graph steps never does (`graphs.StepGraphs` makes its own
        int32 twin), and each form cost the loop a launch a chunk."""
        d64 = h64.to(self.dev, non_blocking=True) if self.dev.type == "cuda" else h64
        self.bufs = {"h64": h64, "d64": d64, "f64": d64.view(torch.float64)}
        self.parts, self.h64, self.host = [], None, None

    def _form(self, copy: str) -> torch.Tensor:
        """One of the chunk's device copies, the int32 and bool forms made on first use (the
        int32 form wraps the float64 bits: those are never read as int32)."""
        t = self.bufs.get(copy)
        if t is None:
            d64 = self.bufs["d64"]
            t = self.bufs[copy] = d64.to(torch.int32) if copy == "d32" else d64 != 0
        return t

    def view(self, copy: str, slot: Slot) -> torch.Tensor:
        if copy == "h32":  # a small index array a planner reads on the host
            shape, strides, off = slot
            if strides == (1,):  # numpy: ~1 µs, torch's as_strided + to(int32) ~8 on the H200
                h = self.bufs["h64"].numpy()
                return torch.from_numpy(h[off: off + shape[0]].astype(np.int32))
            return self.bufs["h64"].as_strided(*slot).to(torch.int32)
        # one as_strided (every buffer is 1-D from storage offset 0): ~1 µs of host per view,
        # a slice + view + np.prod ~5 (a step makes ~20 views)
        return self._form(copy).as_strided(*slot)


class Read:
    """A typed read of a staged array (a `StepArrays` attribute): the array's name and the form
    it is read in, stated once, so a misspelled name fails the type check, not the GPU run."""

    def __init__(self, name: str, form: str):
        self.name, self.form = name, form

    def __get__(self, dv: StepArrays, owner: type | None = None) -> torch.Tensor:
        return dv.view(self.name, self.form)


class StepArrays(Mapping[str, torch.Tensor]):
    """A step's arrays by name, as views into its chunk: `dv[name]` int64 on the device,
    `dv.view(name, form)` in another form (`I32`, `MASK`, `HOST32`, `F64`), and the attributes
    below: the arrays the kernels, the planners and the content read in a form other than int64.
    Views are made on first use."""

    kv_indices_i32 = Read("kv_indices", I32)
    kv_indptr_i32 = Read("kv_indptr", I32)
    last_page_len_i32 = Read("last_page_len", I32)
    app_row_i32 = Read("app_row", I32)
    append_pos_i32 = Read("append_pos", I32)
    block_table_i32 = Read("block_table", I32)
    kv_len_i32 = Read("kv_len", I32)
    xqa_indices_i32 = Read("xqa_indices", I32)
    kv_indptr_host = Read("kv_indptr", HOST32)
    last_page_len_host = Read("last_page_len", HOST32)
    seq_lens_host = Read("seq_lens", HOST32)
    xqa_indptr_host = Read("xqa_indptr", HOST32)
    xqa_last_page_len_host = Read("xqa_last_page_len", HOST32)
    xqa_seq_lens_host = Read("xqa_seq_lens", HOST32)
    fill_tok_m_f64 = Read("fill_tok_m", F64)
    fill_pos_m_f64 = Read("fill_pos_m", F64)
    app_tok_m_f64 = Read("app_tok_m", F64)
    app_pos_m_f64 = Read("app_pos_m", F64)
    tok_m_f64 = Read("tok_m", F64)
    true_pos_m_f64 = Read("true_pos_m", F64)
    eng_nan_mask = Read("eng_nan", MASK)

    def __init__(self, chunk: Chunk, slots: dict[str, Slot]):
        self.chunk, self.slots = chunk, slots
        self.cache: dict[tuple[str, str], torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.view(name, I64)

    def view(self, name: str, form: str) -> torch.Tensor:
        """Array `name` in form `form` (one of `I64`, `I32`, `MASK`, `HOST32`, `F64`)."""
        t = self.cache.get((name, form))
        if t is None:
            t = self.cache[name, form] = self.chunk.view(form, self.slots[name])
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self.slots)

    def __len__(self) -> int:
        return len(self.slots)

    def span(self, name: str) -> tuple[torch.Tensor, int, int]:
        """(the chunk's int64 device copy, offset, length) of 1-D array `name`, in words: for
        a copy by address (`graphs`) without making a view."""
        (n,), _, off = self.slots[name]
        return self.chunk.bufs["d64"], off, n


class Lazy(StepArrays):
    """A graph step's arrays whose slots are made on first look (`make`), all but its block's
    (`gblk`): the loop reads only that one (`graphs.StepGraphs.run`), and the ~22 slots of a
    64 x 2k generation step took ~5 µs of its preparation on a development machine
    (`steady_jit.packed`)."""

    def __init__(self, chunk: Chunk, make: Callable[[], dict[str, Slot]], gblk: Slot):
        self.chunk, self.make, self.gblk = chunk, make, gblk
        self.cache = {}
        self._slots: dict[str, Slot] | None = None

    @property
    def slots(self) -> dict[str, Slot]:
        if self._slots is None:
            self._slots = self.make()
        return self._slots

    @slots.setter
    def slots(self, slots: dict[str, Slot]) -> None:
        self._slots = slots

    def span(self, name: str) -> tuple[torch.Tensor, int, int]:
        if name != "gblk":
            return super().span(name)
        (n,), _, off = self.gblk
        return self.chunk.bufs["d64"], off, n


class Joined(StepArrays):
    """A step staged in two chunks (`prepare.complete`): the arrays of `then`, and those of
    `first` (staged and uploaded earlier: what the step's content and reference read)."""

    def __init__(self, first: StepArrays, then: StepArrays):
        super().__init__(then.chunk, then.slots)
        self.first = first

    def view(self, name: str, form: str) -> torch.Tensor:
        if name in self.slots:
            return super().view(name, form)
        return self.first.view(name, form)

    def __iter__(self) -> Iterator[str]:
        yield from self.slots
        yield from self.first

    def __len__(self) -> int:
        return len(self.slots) + len(self.first)

    def span(self, name: str) -> tuple[torch.Tensor, int, int]:
        return super().span(name) if name in self.slots else self.first.span(name)


class FromRows(StepArrays):
    """A prompts' step's arrays whose content inputs the device makes from its rows
    (`truth.row_content`): from `ptok` (the tokens) and `prow` ([3, R]: each row's queries,
    truth slot, committed less its first token), `app_tok_m` and `app_pos_m` (float64) and
    `tslot` and `true_pos` (int64) in a few launches, with the values and under the names of
    the staged arrays they stand for (`F64` the float64, `I64` its bits as int64)."""

    MADE = ("app_tok_m", "app_pos_m", "tslot", "true_pos")
    SOURCES = ("ptok", "prow")
    made: dict[str, torch.Tensor] | None = None

    def view(self, name: str, form: str) -> torch.Tensor:
        t = self.cache.get((name, form))
        if t is not None:
            return t
        if name not in self.MADE:
            return super().view(name, form)
        x = self._made()[name]
        if form == F64 and x.dtype == torch.float64:
            t = x
        elif form == I64:
            t = x.view(torch.int64)
        elif form == I32 and x.dtype == torch.int64:
            t = x.to(torch.int32)
        else:
            raise KeyError(f"{name} as {form}")
        self.cache[name, form] = t
        return t

    def _made(self) -> dict[str, torch.Tensor]:
        made = self.made
        if made is None:
            tok, rows = super().view("ptok", I64), super().view("prow", I64)
            n = int(tok.shape[0])
            row = torch.repeat_interleave(rows[0], output_size=n)  # no sync: n is known
            pos = torch.arange(n, dtype=torch.int64, device=tok.device) + rows[2][row]
            made = self.made = {"app_tok_m": tok.to(torch.float64),
                                "app_pos_m": pos.to(torch.float64), "tslot": rows[1][row],
                                "true_pos": pos}
        return made

    def __iter__(self) -> Iterator[str]:
        yield from (k for k in self.slots if k not in self.SOURCES)
        yield from self.MADE

    def __len__(self) -> int:
        return len(self.slots) - len(self.SOURCES) + len(self.MADE)


# dtypes whose values int64 holds exactly: the chunk's concatenation widens them ("safe")
_WIDENED = frozenset(np.dtype(t) for t in (np.int64, np.int32, np.int16, np.int8, np.uint32,
                                           np.uint16, np.uint8, np.bool_))


def _integral(a: np.ndarray) -> np.ndarray:
    """a as it is when int64 holds its values exactly, else a as int64, as `astype` converts it
    (uint64 words). A set lookup: `np.can_cast` took ~1 µs an array, ~35 a generation step."""
    return a if a.dtype in _WIDENED else a.astype(np.int64)


def stage(chunk: Chunk, arrays: dict[str, np.ndarray]) -> StepArrays:
    return StepArrays(chunk, {k: chunk.add(a) for k, a in arrays.items()})


def ramp(i: int, per: int, lead: int) -> int:
    """The chunk of the i-th step with rows: chunk 0 holds the first `lead` steps, then chunk c
    has min(c, per) steps. The loop launches a step once it holds the next one (`loop._loop`),
    so small first chunks start the device sooner: the prompts' step, tens of ms of device
    work at batch 64, runs while the host prepares the steps after it."""
    if i < lead:
        return 0
    j, c = i - lead, 1
    while c < per and j >= c:
        j, c = j - c, c + 1
    return c + j // per if c == per else c


def words_ahead(last_words: int, steps: int, i: int, c: int, per: int, most: int) -> int:
    """The words to give chunk c (`ramp`'s, chunks of at most `per` steps) ahead, after a chunk
    of `steps` steps and `last_words` words ended with the i-th step: its words a step, 1.25x,
    times c's steps, at most `most` (0: none ahead after the prompts' step, chunk 0, whose size
    says nothing of the steps after it)."""
    if i < 1:
        return 0
    return min(most, int(1.25 * last_words / max(steps, 1)) * min(c, per)) + ALIGN
