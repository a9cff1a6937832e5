"""How `prepare.prepared_steps` cuts the replayed steps into chunks (`ramp`), and how many
words it gives a chunk ahead (`words_ahead`, for `staging.Chunk(words=)`)."""

from __future__ import annotations

from gpu_backend.staging import ALIGN


def ramp(i: int, per: int, lead: int) -> int:
    """The chunk of the i-th step with rows: chunk 0 holds the first `lead` steps, then chunk c
    has min(c, per) steps. The loop launches a step once it holds the next one (`driver._loop`),
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
