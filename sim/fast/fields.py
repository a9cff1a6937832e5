"""Array layouts shared by the fast engine's kernel and its Python driver: the field index of
each per-request column, loop scalar, output column and code (sim/fast/kernel.py's docstring
draws the arrays)."""

# -- per-request fields (columns of R) -------------------------------------------------------
(F_RID, F_ARR, F_P, F_O, F_TOK, F_STATE, F_PREFILL, F_CTXPOS, F_COMMIT, F_NHOST, F_C, F_A,
 F_GSTEPS, F_PREVNEW, F_FIRST, F_FIN, F_REASON, F_NPRE, F_PAUSE, F_LIM, F_BTC,
 F_LROW, F_LPN, F_LAN, F_TLOW, NF) = range(26)
# F_LROW, F_LPN, F_LAN: the request's last row in the trace (ordinal, its lists' lengths);
# F_TLOW: the lowest index of T[slot] written since (the lists agree with T below it)
# states (sim.request.State) and finish reasons
S_WAIT, S_CTX, S_GEN, S_FIN = 0, 1, 2, 3
REASONS = ("unfinished", "length", "max_seq_len", "rejected")
# loop scalars (G)
(G_NOW, G_STEP, G_DEVFREE, G_STALL, G_SEQ, G_EVSTEP, G_EVPHASE, G_NRUN, G_WHEAD, G_WLEN,
 G_PHEAD, G_PLEN, G_AI, G_AN, G_MORE, G_NSLOT, G_NPLANS, G_PROCESSED, G_ROWS, NG) = range(20)
# output counters (K)
(K_S, K_R, K_PG, K_AL, K_TK, K_E, K_D, K_V, NK) = range(9)
# configuration (cfg)
(C_B, C_MAXB, C_MAXTOK, C_CHUNK, C_POLICY, C_BACKEND, C_WIDTH, C_CLAMP, C_MAXPOS, C_MAXSEQ,
 C_PLANKEY, C_USABLE, C_DETAIL, C_STEP_BASE, C_NS_TOK, C_NS_KV, C_HOST_BASE, C_HOST_ROW,
 C_DELTA, C_WINDOW, NC) = range(21)
GNE, MAXUTIL = 1, 0
FA2, FA3, XQA = 0, 1, 2
W_RESERVED, W_LHOST, W_LDEV = 0, 1, 2
P_FRESH, P_NOWIDTH, P_PERBATCH = 0, 1, 2
# event codes (sim.kv.events), violation codes
E_ALLOC, E_FREE, E_DONE = 0, 1, 2
EVENTS = ("alloc", "free", "done")
V_I18, V_LIVENESS = 0, 1
# step columns (S) and row columns (W)
NS = 18  # StepRecord's 17 ints without backend, + spare slots (kv series)
(W_STEP, W_ROW, W_REQ, W_PHASE, W_Q, W_KVINDPTR, W_LPL, W_KVLEN, W_APPEND, W_ROPE,
 W_CACHED_HOST, W_KVLEN_HOST, W_COMMIT, W_RESERVED, W_ACCEPTED, W_NEW, W_PREVNEW, W_NPAGES,
 W_NALLOC, W_NTOK, W_PREV, W_PKEEP, W_AKEEP, W_PTAIL, W_ATAIL, NW) = range(26)
# done-request columns (D)
(D_RID, D_ARR, D_P, D_O, D_TOK, D_NHOST, D_FIRST, D_FIN, D_REASON, D_NPRE, D_GSTEPS, ND) = range(12)
# codes the loop returns with
DONE, NEED_ARRIVALS, FLUSH = 0, 1, 2
