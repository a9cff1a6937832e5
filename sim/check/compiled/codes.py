"""Integer codes shared by the compiled checker's kernels and its Python driver.

Strings of the trace (event names, phases, backends, invariant ids) become small ints before
any kernel runs; a value the trace format does not know gets the "other" code, which every
kernel treats exactly as the Python checker treats an unknown string.
"""

from __future__ import annotations

# block events (blocks.parquet `event`); OTHER: any string the checker does not act on
EVENTS = ("alloc", "reuse", "copy", "free", "evict", "rewind", "hash", "done")
ALLOC, REUSE, COPY, FREE, EVICT, REWIND, HASH, DONE, EV_OTHER = range(9)

# event phase -> merge rank: "sched" events go before the step's launch, anything else after
# (sim.trace.reader.iter_records sorts on (step, 0 | 2, seq); a launch is (step, 1, 0))
EV_PHASES = ("sched",)
SCHED_RANK, LAUNCH_RANK, PROC_RANK = 0, 1, 2

# row phase
ROW_PHASES = ("ctx", "gen")
CTX, GEN, PHASE_OTHER = range(3)

# attention backend of a step: CSR = fa2 | fa3; the block table is xqa; OTHER is neither
BACKENDS = ("fa2", "fa3", "xqa")
FA2, FA3, XQA, BACKEND_OTHER = range(4)

# slot states (sim/check/content.py)
UNWRITTEN, WRITTEN, REJECTED = 0, 1, 2

# One launch's checks in the order StepChecker reports them (registry.LAUNCH_ORDER, and within
# an invariant the order its module produces them). Per-row checks are bits of a row's flags.
(R_I12, R_I1_REACH, R_I1_BLOCKS, R_I13_WIDE, R_I13_KLEN, R_I2_APPEND, R_I2_KLEN, R_I3_COUNT,
 R_I3_SPAN, R_I4_INDPTR, R_I4_LPL, R_I4_RANGE, R_I4_DUP, R_I4_NULL, R_I7_READ, R_I7_WRITE,
 R_I9_LEN, R_I9_POS, R_I8, R_I11_FIRST, R_I11_AHEAD, R_I16, R_I5_PAGES, R_I5_WRITES,
 R_I6_SHARED, R_I6_MATCH, R_I10, N_ROW_CHECKS) = range(28)

# invariant of each violation code: row checks first (by bit), then step-level codes
INVARIANTS = ("I12", "I1", "I1", "I13", "I13", "I2", "I2", "I3", "I3", "I4", "I4", "I4", "I4",
              "I4", "I7", "I7", "I9", "I9", "I8", "I11", "I11", "I16", "I5", "I5", "I6", "I6",
              "I10", "I14", "I20", "POOL", "I17")
V_I14, V_I20, V_POOL, V_I17 = range(N_ROW_CHECKS, N_ROW_CHECKS + 4)

# kernel return status: why a run of the merge loop stopped
DONE_STATUS, NEED_VIOLATIONS, NEED_ENTRIES = range(3)
