"""Split-KV planner: cut a ragged batch into work items from host-side lengths.

A work item is ``(seq, token_begin, token_end, slot)``: one block of the split kernel
handles all heads of sequence ``seq`` over tokens ``[token_begin, token_end)`` of that
sequence (token t of sequence b is KV row ``kv_indptr[b] + t``; the kernels own that
mapping, so a paged cache changes one device function). ``slot == -1`` means the item
covers its whole sequence and writes the final output itself; otherwise it writes a
partial ``(acc, m, l)`` into scratch slot ``slot`` and the combine kernel merges the
slots ``seq_slots[b] .. seq_slots[b+1]-1`` of each split sequence.

A device with a fast split kernel for whole tiles (gfx950 MXFP4: 128 tokens) gets a plan
made with ``fast_tile_tokens``: the first ``n_fast`` rows of ``work`` are ranges of whole
tiles for the fast kernel, the rest (tails, short sequences) go to the portable kernel.
Every other device plans with ``fast_tile_tokens=0`` and gets what it always got.

The plan never looks at device memory: it is built from the lengths the caller
already has on the host, so a decode call never synchronises.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

#: Work items per compute unit the planner aims for: enough to hide a straggler,
#: few enough that the combine stays cheap.
DEFAULT_ITEMS_PER_CU = 2
#: A split shorter than this costs more in partial traffic than it wins in parallelism.
DEFAULT_MIN_SPLIT_TOKENS = 256
#: Split boundaries fall on multiples of this, so every item but a sequence's last one
#: is made of whole kernel tiles (the gfx950 fast path takes only full 128-token tiles).
DEFAULT_ALIGN_TOKENS = 128


@dataclass(frozen=True)
class DecodePlan:
    """Work decomposition of one batch. Arrays are int32 and C-contiguous."""

    seq_lens: np.ndarray  # [b] tokens per sequence
    work: np.ndarray  # [n_work, 4] (seq, token_begin, token_end, slot)
    seq_slots: np.ndarray  # [b + 1] partial slots per sequence (empty range: direct write)
    num_cus: int
    align_tokens: int
    kv_indptr: np.ndarray = field(repr=False)  # [b + 1] the indptr these lengths imply
    n_fast: int = 0  # work[:n_fast] are whole fast tiles for the fast kernel, the rest portable
    fast_tile_tokens: int = 0  # the fast kernel's tile (0: no fast path)

    @property
    def batch(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def n_work(self) -> int:
        return int(self.work.shape[0])

    @property
    def fast_work(self) -> np.ndarray:
        """Items of the fast kernel (a view of the first ``n_fast`` rows of ``work``)."""
        return self.work[: self.n_fast]

    @property
    def portable_work(self) -> np.ndarray:
        """Items of the portable kernel (a view of the rows after the fast ones)."""
        return self.work[self.n_fast :]

    @property
    def n_portable(self) -> int:
        return self.n_work - self.n_fast

    @property
    def n_slots(self) -> int:
        return int(self.seq_slots[-1])

    @property
    def needs_combine(self) -> bool:
        return self.n_slots > 0

    @property
    def total_tokens(self) -> int:
        return int(self.kv_indptr[-1])

    def splits_per_seq(self) -> np.ndarray:
        return np.bincount(self.work[:, 0], minlength=self.batch)


def lengths_from_indptr(kv_indptr: np.ndarray) -> np.ndarray:
    """Per-sequence lengths from a host ``kv_indptr``, validated."""
    from hipmla.validate import check_indptr

    indptr = check_indptr(kv_indptr, "kv_indptr")
    return np.diff(indptr).astype(np.int64)


def indptr_from_lengths(seq_lens) -> np.ndarray:
    lens = _check_lens(seq_lens)
    indptr = np.zeros(lens.shape[0] + 1, dtype=np.int64)
    np.cumsum(lens, out=indptr[1:])
    if indptr[-1] > np.iinfo(np.int32).max:
        raise ValueError(
            f"seq_lens: total tokens {int(indptr[-1])} exceed the int32 row index range"
        )
    return indptr.astype(np.int32)


def _check_lens(seq_lens) -> np.ndarray:
    lens = np.asarray(seq_lens)
    if lens.ndim != 1 or lens.shape[0] < 1:
        raise ValueError(f"seq_lens: expected a 1-D sequence of >= 1 lengths, got shape {lens.shape}")
    if not np.issubdtype(lens.dtype, np.integer):
        raise TypeError(f"seq_lens: expected integers, got dtype {lens.dtype}")
    if (lens < 0).any():
        bad = int(np.flatnonzero(lens < 0)[0])
        raise ValueError(f"seq_lens: lengths must be >= 0, seq_lens[{bad}] = {int(lens[bad])}")
    return lens.astype(np.int64)


def split_size(
    seq_lens: np.ndarray,
    num_cus: int,
    items_per_cu: int = DEFAULT_ITEMS_PER_CU,
    min_split_tokens: int = DEFAULT_MIN_SPLIT_TOKENS,
    align_tokens: int = DEFAULT_ALIGN_TOKENS,
) -> int:
    """Longest token range one work item gets.

    Aim for ``num_cus * items_per_cu`` items of equal length over the whole batch; a
    batch with at least that many sequences is not split at all beyond its longest one.
    """
    total = int(seq_lens.sum())
    longest = int(seq_lens.max()) if seq_lens.size else 0
    if total == 0:
        return max(align_tokens, 1)
    target_items = num_cus * items_per_cu
    chunk = -(-total // target_items)
    chunk = max(chunk, min_split_tokens)
    chunk = -(-chunk // align_tokens) * align_tokens
    return max(min(chunk, -(-longest // align_tokens) * align_tokens), align_tokens)


def make_plan(
    seq_lens,
    num_cus: int,
    *,
    items_per_cu: int = DEFAULT_ITEMS_PER_CU,
    min_split_tokens: int = DEFAULT_MIN_SPLIT_TOKENS,
    align_tokens: int = DEFAULT_ALIGN_TOKENS,
    fast_tile_tokens: int = 0,
) -> DecodePlan:
    """Plan a batch with the given per-sequence lengths for ``num_cus`` compute units.

    Every sequence gets ``ceil(len / chunk)`` items (at least one, so an empty sequence
    still has its output written: zeros and LSE = -inf). Items of one sequence are
    equal up to one alignment unit. Items are ordered longest first so the hardware
    dispatcher, which hands out blocks in order, starts the stragglers first.

    ``fast_tile_tokens`` > 0 (the fast kernel's tile; ``align_tokens`` should be a
    multiple of it, so only a sequence's last item has a remainder) cuts each item into
    its whole tiles, for the fast kernel, and its remainder, for the portable kernel; a
    sequence that thereby gets two items is split (its items write partial slots). Fast
    items come first in ``work``.
    """
    lens = _check_lens(seq_lens)
    for name, v in (("num_cus", num_cus), ("items_per_cu", items_per_cu),
                    ("min_split_tokens", min_split_tokens), ("align_tokens", align_tokens)):
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name}: expected an integer >= 1, got {v!r}")
    if isinstance(fast_tile_tokens, bool) or not isinstance(fast_tile_tokens, (int, np.integer)) \
            or fast_tile_tokens < 0:
        raise ValueError(f"fast_tile_tokens: expected an integer >= 0 (0: no fast kernel), got {fast_tile_tokens!r}")
    indptr = indptr_from_lengths(lens)
    chunk = split_size(lens, num_cus, items_per_cu, min_split_tokens, align_tokens)

    # Units of alignment per sequence, spread as evenly as possible over its splits.
    n_split = np.maximum(-(-lens // chunk), 1)
    seq = np.repeat(np.arange(lens.shape[0]), n_split)
    first = np.concatenate([[0], np.cumsum(n_split)[:-1]])
    k = np.arange(seq.shape[0]) - first[seq]  # split index within its sequence
    units = -(-lens // align_tokens)
    ns = n_split[seq]
    u_begin = (units[seq] * k) // ns
    u_end = (units[seq] * (k + 1)) // ns
    begin = np.minimum(u_begin * align_tokens, lens[seq])
    end = np.minimum(u_end * align_tokens, lens[seq])

    fast = np.zeros(seq.shape[0], dtype=bool)
    if fast_tile_tokens:
        whole = (end - begin) // fast_tile_tokens * fast_tile_tokens
        cut = (whole > 0) & (whole < end - begin)
        # Items with whole tiles and a remainder become two: [begin, mid) fast, [mid, end).
        mid = begin + whole
        seq = np.concatenate([seq, seq[cut]])
        begin, end = np.concatenate([begin, mid[cut]]), np.concatenate([np.where(cut, mid, end), end[cut]])
        fast = np.concatenate([whole > 0, np.zeros(int(cut.sum()), dtype=bool)])
        by_seq = np.lexsort((begin, seq))  # keep each sequence's items in token order
        seq, begin, end, fast = seq[by_seq], begin[by_seq], end[by_seq], fast[by_seq]
        n_split = np.bincount(seq, minlength=lens.shape[0])
        first = np.concatenate([[0], np.cumsum(n_split)[:-1]])
        k = np.arange(seq.shape[0]) - first[seq]

    split = n_split > 1
    seq_slots = np.zeros(lens.shape[0] + 1, dtype=np.int64)
    np.cumsum(np.where(split, n_split, 0), out=seq_slots[1:])
    slot = np.where(split[seq], seq_slots[seq] + k, -1)

    work = np.stack([seq, begin, end, slot], axis=1)
    # Fast items first, each kind longest first.
    order = np.lexsort((-(end - begin), ~fast))
    work = np.ascontiguousarray(work[order], dtype=np.int32)
    arrays = dict(seq_lens=lens.astype(np.int32), work=work, seq_slots=seq_slots.astype(np.int32),
                  kv_indptr=indptr)
    for a in arrays.values():
        # A plan is a checked contract with the kernels (the fast kernel takes whole
        # tiles only): frozen, so no one edits it into an out-of-bounds work list.
        a.setflags(write=False)
    return DecodePlan(
        **arrays,
        num_cus=int(num_cus),
        align_tokens=int(align_tokens),
        n_fast=int(fast.sum()),
        fast_tile_tokens=int(fast_tile_tokens),
    )
