"""The split schedule the decode kernels derive on the device, modelled on the host.

Every block of the decode grid computes this same split from the batch's lengths
(``hip_src/core/schedule.h``), so a step passes nothing but device arrays; this module is
its bit-for-bit host model, used by the emulator, by tests and to size the grid and the
partials scratch once.

A *row* is 16 heads of one query token: row ``q * head_groups + g`` is head group ``g``
of query token ``q`` (with q_len 1, query token ``q`` is sequence ``q``'s). A work item
is ``(seq, row, begin, end, slot, first_slot, slot_stride, n_items)``: one block runs the
row over tokens ``[begin, end)`` of sequence ``seq``'s cache; a row of one item writes its
output directly, the items of a split row write partial slots ``first_slot + k *
slot_stride`` (k < n_items) and the last to finish merges them. Items are range-major
within a sequence (all its rows of one kv range, then the next range), so the rows that
read a range run side by side; query token j of n sees ``len - n + j + 1`` tokens.
A kernel whose row holds more query rows than the model has heads puts ``row_tokens``
query tokens in a row (row ``q`` is then query tokens ``q .. q + queries - 1``): the
64-row sm_90a kernel below 64 heads, and the 16-head kernels below 16 heads (8 heads x 2
tokens, 4 x 4, 5 x 2: a power of two, :func:`row_shape`). The item covers what the last of them sees (``sees``), and
the kernel masks the earlier ones' last tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hipmla.validate import INT32_MAX, MAX_SEQ_TOKENS

from hipmla.queries import HEAD_COUNTS, head_groups

#: Work items per compute unit the split aims for: enough to hide a straggler, few
#: enough that the merge stays cheap.
DEFAULT_ITEMS_PER_CU = 2
#: A split shorter than this costs more in partial traffic than it wins in parallelism.
#: 128 with the 16-range cap below, against 256 with none: 4x1k 24.5 -> 21.0 us, 4x2k
#: 25.7 -> 23.7, 4x8k 44.4 -> 38.1, 32x1k 34.3 -> 29.9, 64x1k 37.2 -> 37.1 (mxfp4; fp8
#: and bf16 alike; H200, scripts/split_policy_sweep.py,
#: scripts/results/h200-2026-12-01-split-policy-sweep-cap.txt).
DEFAULT_MIN_SPLIT_TOKENS = 128
#: Split boundaries fall on multiples of this, so every item but a sequence's last one
#: is made of whole kernel tiles (the fast kernels' tile is 128 tokens).
DEFAULT_ALIGN_TOKENS = 128
#: Most token ranges one sequence is cut in while they are shorter than
#: DEFAULT_LONG_RANGE_TOKENS (0: no cap). The min_split_tokens floor alone gives a few
#: long sequences one slot per ~chunk tokens; past this many slots a row's merge (one
#: block reads every slot) costs more than the shorter items win: 4x8k with 32 slots a
#: row spends 15.6 of its 44 us merging, 16 longer ones take 38.1 us in all and 8 take
#: 53.9 (the GPU half idle).
DEFAULT_MAX_RANGES = 16
#: Ranges this long are worth their slot: a sequence may have ceil(len / this) ranges
#: even past max_ranges. Without it 4 x 32k + 60 x 500 got 16 ranges of 2048 tokens a
#: long sequence (124 items on 132 SMs) and ran 40% slower than with 52 of 640.
DEFAULT_LONG_RANGE_TOKENS = 512

#: The lone split: when the usual split's chunk is shorter than this, a split that aims at
#: one item per CU (``lone_items``) runs instead, if it gives at most that many items.
#: Short items two to a CU cost more in schedules, prologues and merge slots than the
#: second block hides; long ones gain from it. Measured on the H200 (sm_90 kernel, L2
#: flushed, the placement on; scripts/split_policy_sweep.py,
#: scripts/results/h200-2026-12-04-split-policy-sweep-lone.txt), us with the usual split
#: against one aiming at one item an SM, mxfp4 / fp8 / bf16: 8x8k (chunk 256) 38.9 / 39.1 /
#: 50.8 -> 33.9 / 31.6 / 41.4 (with 32 ranges a row; the old 16-range cap gave the same 128
#: items), 32x1k (128) 24.1 / 25.4 / 32.3 -> 24.0 / 22.9 / 28.0, 64x1k (256) 33.1 / 31.4 /
#: 43.8 -> 33.0 / 31.2 / 40.8, 16x8k (512) 48.7 / 46.7 / 67.0 -> 50.1 / 45.8 / 61.9, but
#: 32x8k (1024) 73.6 / 67.6 / 102.9 -> 84.5 / 74.7 / 103.4 and 64x8k (2048) 126.6 / 112.2 /
#: 174.8 -> 152.5 / 132.0 / 188.3. Ragged batches whose one-a-CU split needs more items
#: than CUs keep the usual split (long+short 71.2 -> 76.2 us otherwise).
DEFAULT_LONE_BELOW_TOKENS = 1024
#: ... per cache format on the sm_90 kernel: MXFP4's is issue-bound, and two blocks an SM
#: hide more of it, so only its shortest items (chunk 128) go one to an SM: 64x1k (chunk
#: 256) took 32.7 -> 33.9 us and 16x8k (512) 49.1 -> 50.8 lone, 4x8k 33.2 -> 28.0 and
#: 32x1k 25.1 -> 24.6 (scripts/results/h200-2026-12-04-split-policy-sweep-lone.txt).
LONE_BELOW_TOKENS = {"bf16": DEFAULT_LONE_BELOW_TOKENS, "fp8": DEFAULT_LONE_BELOW_TOKENS, "mxfp4": 256}
#: Most ranges a sequence gets in the lone split: 4 x 8k then fills 128 SMs with ranges of
#: 256 tokens (32.7 -> 27.5 us mxfp4, 30.2 -> 26.3 fp8, 37.0 -> 31.6 bf16 against 16).
DEFAULT_LONE_MAX_RANGES = 32

#: The fit: a usual split of more items than ``target_items`` (every sequence's last range
#: rounds up, so a ragged batch gets up to one item a row more than the split aims for)
#: runs as a partial second wave on the slots the first one frees: the step takes about two
#: items' time instead of one. It takes instead the first of the chunks ``fit_chunk(chunk,
#: k)`` -- chunk + chunk e / 8 for e in FIT_EIGHTHS, rounded up -- that gives at most
#: target_items items; none: the usual split. Predicted from a makespan model (items in
#: block order on target_items slots, 150 tokens' time of overhead each; 400 random batches
#: of 4-400 sequences: 118 faster by 2-44%, 4 slower by up to 13%, whose extra items were
#: short). Measured (H100, 2026-12-05, docs/BENCHMARKS.md, "The fit"): rag64 -26% (MXFP4), 64x32k -22%,
#: long+short -2..+2%; steps it does not fit pay 0.4-0.6 us for its two item counts. The
#: decoder sets it on NVIDIA; only the NVIDIA builds (sm_90 and portable kernels) have it,
#: the AMD ones do not (core/schedule.h: SGPRs).
FIT_EIGHTHS = (1, 4)
#: ... only while rows + max(target_items, lone_items) is below this: the device counts the
#: usual, lone and both fit splits in one 64-bit scan, 16 bits each.
FIT_MAX_ROWS = 1 << 15

#: heads / 16 of the head counts a decoder may serve (fewer than 16 heads are one group).
HEAD_GROUPS = tuple(sorted({head_groups(h) for h in HEAD_COUNTS}))
#: Query tokens a schedule row may hold (p.row_tokens; :func:`row_shape`): powers of two,
#: so the device's row counts are shifts (core/schedule.h).
ROW_TOKENS = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class SplitPolicy:
    """How a batch is cut into work items (the kernel's ``split_*`` and ``fast_tile``)."""

    target_items: int  # items the split aims for over the whole batch
    min_split_tokens: int = DEFAULT_MIN_SPLIT_TOKENS
    align_tokens: int = DEFAULT_ALIGN_TOKENS
    fast_tile: int = 0  # > 0: partial last tiles become items of their own (whole-tile fast kernels)
    max_ranges: int = DEFAULT_MAX_RANGES  # > 0: most token ranges per sequence (longer items instead)
    long_range_tokens: int = DEFAULT_LONG_RANGE_TOKENS  # ... unless they would be this long anyway
    lone_items: int = 0  # > 0: the lone split (at most one item per CU) may replace short items
    lone_below_tokens: int = DEFAULT_LONE_BELOW_TOKENS  # ... when the usual chunk is shorter than this
    lone_max_ranges: int = DEFAULT_LONE_MAX_RANGES  # its max_ranges (0: no cap)
    fit: bool = False  # the fit may run (NVIDIA builds only)

    def __post_init__(self):
        for name in ("target_items", "min_split_tokens", "align_tokens", "long_range_tokens", "lone_below_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 1 <= v <= INT32_MAX:
                raise ValueError(f"{name}: expected an integer in [1, {INT32_MAX}], got {v!r}")
        for name, note in (("max_ranges", " (0: no cap)"), ("lone_max_ranges", " (0: no cap)"),
                           ("lone_items", " (0: no lone split)")):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v <= INT32_MAX:
                raise ValueError(f"{name}: expected an integer in [0, {INT32_MAX}]{note}, got {v!r}")
        if not isinstance(self.fit, bool):
            raise TypeError(f"fit: expected a bool, got {type(self.fit).__name__} {self.fit!r}")
        if self.align_tokens & (self.align_tokens - 1):
            raise ValueError(f"align_tokens: expected a power of two, got {self.align_tokens}")
        f = self.fast_tile
        if isinstance(f, bool) or not isinstance(f, (int, np.integer)) or f < 0:
            raise ValueError(f"fast_tile: expected an integer >= 0 (0: no fast kernel), got {f!r}")
        if f and self.align_tokens % f:
            raise ValueError(f"fast_tile: {f} must divide align_tokens ({self.align_tokens})")

    @classmethod
    def for_device(cls, num_cus: int, fast_tile: int = 0, items_per_cu: int = DEFAULT_ITEMS_PER_CU,
                   lone: bool = False, fit: bool = False) -> SplitPolicy:
        """``lone``: the lone split (one item per CU for steps of short items) may run; it
        pays where each of those items gets a CU of its own (the placement on NVIDIA,
        core/placement.h) and is measured only there. ``fit``: the fit may run (FIT_EIGHTHS;
        the NVIDIA builds only)."""
        if isinstance(num_cus, bool) or not isinstance(num_cus, (int, np.integer)) or num_cus < 1:
            raise ValueError(f"num_cus: expected an integer >= 1, got {num_cus!r}")
        for name, v, lo in (("fast_tile", fast_tile, 0), ("items_per_cu", items_per_cu, 1)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"{name}: expected an integer >= {lo}, got {v!r}")
        for name, v in (("lone", lone), ("fit", fit)):
            if not isinstance(v, bool):
                raise TypeError(f"{name}: expected a bool, got {type(v).__name__} {v!r}")
        return cls(target_items=int(num_cus) * int(items_per_cu), fast_tile=int(fast_tile),
                   lone_items=int(num_cus) if lone else 0, fit=fit)

    def max_items(self, rows: int) -> int:
        """Most items any step of ``rows`` rows gets (rows = query tokens x max(heads / 16, 1);
        the batch size with q_len 1 and 16 heads): the grid and the scratch slots. (The lone
        split runs only with at most ``lone_items`` items.)"""
        if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or rows < 1:
            raise ValueError(f"rows: expected an integer >= 1, got {rows!r}")
        return int(max(self.target_items, self.lone_items) + rows * (2 if self.fast_tile else 1))


@dataclass(frozen=True)
class Schedule:
    """The items of one batch in block order. Arrays are int64, one row per item."""

    seq: np.ndarray
    row: np.ndarray
    begin: np.ndarray
    end: np.ndarray
    first_slot: np.ndarray
    slot_stride: np.ndarray
    n_items: np.ndarray
    queries: np.ndarray  # query tokens of the item's row (1 unless row_tokens > 1)
    sees: np.ndarray  # kv tokens the row's last query token sees (end <= sees)
    chunk: int
    lone: bool = False  # the lone split ran (SplitPolicy.lone_items)
    fit: int = 0  # > 0: the fit's chunk k - 1 ran (FIT_EIGHTHS)

    @property
    def size(self) -> int:
        return int(self.seq.shape[0])

    @property
    def slot(self) -> np.ndarray:
        """Partial slot of each item (its block index), or -1 where it writes the output."""
        return np.where(self.n_items > 1, np.arange(self.size), -1)

    def items_of_row(self, row: int) -> np.ndarray:
        """Indices of row ``row``'s items, in token order."""
        return np.flatnonzero(self.row == row)

    def items_of(self, seq: int) -> np.ndarray:
        """Indices of sequence ``seq``'s items (every row), in block order."""
        return np.flatnonzero(self.seq == seq)


def check_lens(seq_lens, name: str = "seq_lens") -> np.ndarray:
    if isinstance(seq_lens, (str, bytes, dict, set)) or seq_lens is None:
        raise TypeError(f"{name}: expected a 1-D sequence of integer lengths, got {type(seq_lens).__name__}")
    lens = np.asarray(seq_lens)
    if lens.ndim != 1 or lens.shape[0] < 1:
        raise ValueError(f"{name}: expected a 1-D sequence of >= 1 lengths, got shape {lens.shape}")
    if not np.issubdtype(lens.dtype, np.integer):
        raise TypeError(f"{name}: expected integers, got dtype {lens.dtype}")
    if lens.dtype.kind == "u":
        lens = lens.astype(np.uint64)
        if (lens > MAX_SEQ_TOKENS).any():
            bad = int(np.flatnonzero(lens > MAX_SEQ_TOKENS)[0])
            raise ValueError(f"{name}: lengths must be <= {MAX_SEQ_TOKENS} (2^30), {name}[{bad}] = {int(lens[bad])}")
    lens = lens.astype(np.int64)
    if (lens < 0).any() or (lens > MAX_SEQ_TOKENS).any():
        bad = int(np.flatnonzero((lens < 0) | (lens > MAX_SEQ_TOKENS))[0])
        raise ValueError(f"{name}: lengths must lie in [0, {MAX_SEQ_TOKENS}] (2^30), {name}[{bad}] = {int(lens[bad])}")
    return lens


def split_chunk(total: int, policy: SplitPolicy, target: int | None = None) -> int:
    """Longest token range one item gets (core/schedule.h's ``chunk``) when the split aims
    at ``target`` items (default: the policy's ``target_items``)."""
    chunk = max(-(-int(total) // (policy.target_items if target is None else target)), policy.min_split_tokens)
    return -(-chunk // policy.align_tokens) * policy.align_tokens


#: The lone split is considered only while the batch has fewer rows than this: the device
#: then counts both splits' items in one 64-bit scan (core/schedule.h), each in 32 bits.
LONE_MAX_ROWS = 1 << 30


def _ranges(lens: np.ndarray, chunk: int, max_ranges: int, policy: SplitPolicy) -> tuple[np.ndarray, np.ndarray]:
    """Token ranges per sequence (base) and whether a fast kernel's partial last tile adds
    one more (extra)."""
    base = np.maximum(-(-lens // chunk), 1)
    if max_ranges:
        base = np.minimum(base, np.maximum(max_ranges, -(-lens // policy.long_range_tokens)))
    if not policy.fast_tile:
        return base, np.zeros(lens.shape, bool)
    units = -(-lens // policy.align_tokens)
    last_begin = units * (base - 1) // base * policy.align_tokens
    tail = lens % policy.fast_tile
    return base, (tail > 0) & (lens - last_begin > tail)


def fit_chunk(chunk: int, k: int, align: int) -> int:
    """The fit's chunk k (0, 1) for a usual chunk (core/schedule.h's, bit for bit): chunk +
    floor(chunk FIT_EIGHTHS[k] / 8), rounded up to ``align``, at most 2^31 - 1."""
    c = int(chunk) + int(chunk) * FIT_EIGHTHS[k] // 8
    return min(-(-c // align) * align, INT32_MAX)


def split_ranges(lens: np.ndarray, rows: np.ndarray, policy: SplitPolicy,
                 step_rows: int) -> tuple[int, np.ndarray, np.ndarray, bool, int]:
    """The split of sequences of ``lens`` kv tokens and ``rows`` rows each: (chunk, base,
    extra) as ``_ranges``, whether it is the lone split -- it is where the policy has one,
    the usual chunk is below ``lone_below_tokens`` and the lone split gives at most
    ``lone_items`` items -- and the fit's chunk taken (1, 2; 0: none; see FIT_EIGHTHS).
    ``step_rows`` is the device's bound on the rows (query tokens x head groups, paged.h's
    step_rows: no division by row_tokens), which decides whether the lone split and the
    fit are tried at all."""
    total = int((lens * rows).sum())
    chunk = split_chunk(total, policy)
    if policy.lone_items and chunk < policy.lone_below_tokens \
            and step_rows + max(policy.target_items, policy.lone_items) < LONE_MAX_ROWS:
        lone = split_chunk(total, policy, policy.lone_items)
        base, extra = _ranges(lens, lone, policy.lone_max_ranges, policy)
        if int(((base + extra) * rows).sum()) <= policy.lone_items:
            return lone, base, extra, True, 0
    base, extra = _ranges(lens, chunk, policy.max_ranges, policy)
    if policy.fit and int(((base + extra) * rows).sum()) > policy.target_items \
            and step_rows + max(policy.target_items, policy.lone_items) < FIT_MAX_ROWS:
        for k in range(len(FIT_EIGHTHS)):
            c = fit_chunk(chunk, k, policy.align_tokens)
            b, e = _ranges(lens, c, policy.max_ranges, policy)
            if int(((b + e) * rows).sum()) <= policy.target_items:
                return c, b, e, False, k + 1
    return chunk, base, extra, False, 0


def check_head_groups(head_groups) -> int:
    if isinstance(head_groups, bool) or not isinstance(head_groups, (int, np.integer)) \
            or int(head_groups) not in HEAD_GROUPS:
        raise ValueError(f"head_groups: expected one of {HEAD_GROUPS} (up to 16, 32, 64 or 128 heads), "
                         f"got {head_groups!r}")
    return int(head_groups)


def row_shape(heads: int, row_heads: int) -> tuple[int, int]:
    """``(head_groups, row_tokens)`` of a kernel whose schedule row holds ``row_heads`` query
    rows, serving ``heads`` heads: rows of row_heads heads of one query token, or below
    row_heads heads one row a group of query tokens, as many as fit rounded down to a
    power of two (8 heads x 2 or 4 x 4 fill a 16-head row; 5 x 2 and 3 x 4 leave the rest
    of it idle)."""
    if heads >= row_heads:
        return heads // row_heads, 1
    fit = row_heads // heads
    return 1, 1 << (fit.bit_length() - 1)


def check_row_tokens(row_tokens) -> int:
    if isinstance(row_tokens, bool) or not isinstance(row_tokens, (int, np.integer)) \
            or int(row_tokens) not in ROW_TOKENS:
        raise ValueError(f"row_tokens: expected one of {ROW_TOKENS}, got {row_tokens!r}")
    return int(row_tokens)


def schedule(seq_lens, policy: SplitPolicy, q_lens=None, head_groups: int = 1, row_tokens: int = 1) -> Schedule:
    """The device's split of a batch with these kv lengths (and ``q_lens`` query tokens per
    sequence, default 1 each; ``head_groups`` = heads / 16, 1 below 16 heads), item by item in block order.
    ``row_tokens``: query tokens of one row (:func:`row_shape`: the 64-row sm_90a kernel
    below 64 heads, the 16-head kernels below 16; ``head_groups`` is then 1): a row's item
    covers what its last query token sees."""
    if not isinstance(policy, SplitPolicy):
        raise TypeError(f"policy: expected a hipmla.schedule.SplitPolicy, got {type(policy).__name__}")
    lens = check_lens(seq_lens)
    groups = check_head_groups(head_groups)
    rt = check_row_tokens(row_tokens)
    if rt > 1 and groups != 1:
        raise ValueError(f"row_tokens: several query tokens a row need head_groups 1, got {groups}")
    if q_lens is None:
        nq = np.ones_like(lens)  # one token: it sees the whole sequence (no clamp below)
    else:
        nq = check_lens(q_lens, "q_lens")
        if nq.shape != lens.shape:
            raise ValueError(f"q_lens: expected one count per sequence ({lens.shape[0]}), got shape {nq.shape}")
    align, fast = policy.align_tokens, policy.fast_tile
    rows = -(-nq // rt) * groups
    chunk, base, extra, lone, fit = split_ranges(lens, rows, policy, int(nq.sum()) * groups)
    units = -(-lens // align)
    n = base + extra
    count = n * rows
    first = np.concatenate([[0], np.cumsum(count)[:-1]])
    seq = np.repeat(np.arange(lens.shape[0]), count)
    local = np.arange(seq.shape[0]) - first[seq]
    r = local % np.maximum(rows[seq], 1)
    k = local // np.maximum(rows[seq], 1)
    j = r // groups * rt  # the row's first query token
    queries = np.minimum(rt, nq[seq] - j)
    q_first = np.concatenate([[0], np.cumsum(nq)[:-1]])
    row = (q_first[seq] + j) * groups + r % groups
    ns, us, ls = base[seq], units[seq], lens[seq]
    begin = np.minimum(us * k // ns * align, ls)
    end = np.minimum(us * (k + 1) // ns * align, ls)
    if fast:
        cut = extra[seq]
        whole_end = ls - ls % fast
        end = np.where(cut & (k == ns - 1), whole_end, end)
        rem = cut & (k == ns)
        begin = np.where(rem, whole_end, begin)
        end = np.where(rem, ls, end)
    sees = np.maximum(ls - nq[seq] + j + queries, 0)
    end = np.minimum(end, sees)
    begin = np.minimum(begin, end)
    return Schedule(seq=seq, row=row, begin=begin, end=end, first_slot=first[seq] + r,
                    slot_stride=rows[seq], n_items=n[seq], chunk=chunk, lone=lone, fit=fit,
                    queries=queries, sees=sees)


def short_sequences(seq_lens, q_lens) -> np.ndarray:
    """Sequences with fewer kv tokens than query tokens: invalid (the device flags
    ERR_Q_LEN and writes NaN to their rows)."""
    return np.flatnonzero(check_lens(seq_lens) < check_lens(q_lens, "q_lens"))
