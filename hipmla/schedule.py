"""The split schedule the decode kernels derive on the device, modelled on the host.

Every block of the decode grid computes this same split from the batch's lengths
(``hip_src/core/schedule.h``), so a step passes nothing but device arrays; this module is
its bit-for-bit host model, used by the emulator, by tests and to size the grid and the
partials scratch once.

A work item is ``(seq, begin, end, slot, first_slot, n_items)``: one block runs all heads
of sequence ``seq`` over its tokens ``[begin, end)``; a sequence of one item writes its
output directly, the items of a split sequence write partial slots
``first_slot .. first_slot + n_items - 1`` and the last to finish merges them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Work items per compute unit the split aims for: enough to hide a straggler, few
#: enough that the merge stays cheap.
DEFAULT_ITEMS_PER_CU = 2
#: A split shorter than this costs more in partial traffic than it wins in parallelism.
DEFAULT_MIN_SPLIT_TOKENS = 256
#: Split boundaries fall on multiples of this, so every item but a sequence's last one
#: is made of whole kernel tiles (the fast kernels' tile is 128 tokens).
DEFAULT_ALIGN_TOKENS = 128

INT32_MAX = int(np.iinfo(np.int32).max)


@dataclass(frozen=True)
class SplitPolicy:
    """How a batch is cut into work items (the kernel's ``split_*`` and ``fast_tile``)."""

    target_items: int  # items the split aims for over the whole batch
    min_split_tokens: int = DEFAULT_MIN_SPLIT_TOKENS
    align_tokens: int = DEFAULT_ALIGN_TOKENS
    fast_tile: int = 0  # > 0: partial last tiles become items of their own (whole-tile fast kernels)

    def __post_init__(self):
        for name in ("target_items", "min_split_tokens", "align_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 1 <= v <= INT32_MAX:
                raise ValueError(f"{name}: expected an integer in [1, {INT32_MAX}], got {v!r}")
        if self.align_tokens & (self.align_tokens - 1):
            raise ValueError(f"align_tokens: expected a power of two, got {self.align_tokens}")
        f = self.fast_tile
        if isinstance(f, bool) or not isinstance(f, (int, np.integer)) or f < 0:
            raise ValueError(f"fast_tile: expected an integer >= 0 (0: no fast kernel), got {f!r}")
        if f and self.align_tokens % f:
            raise ValueError(f"fast_tile: {f} must divide align_tokens ({self.align_tokens})")

    @classmethod
    def for_device(cls, num_cus: int, fast_tile: int = 0,
                   items_per_cu: int = DEFAULT_ITEMS_PER_CU) -> SplitPolicy:
        if isinstance(num_cus, bool) or not isinstance(num_cus, (int, np.integer)) or num_cus < 1:
            raise ValueError(f"num_cus: expected an integer >= 1, got {num_cus!r}")
        for name, v, lo in (("fast_tile", fast_tile, 0), ("items_per_cu", items_per_cu, 1)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"{name}: expected an integer >= {lo}, got {v!r}")
        return cls(target_items=int(num_cus) * int(items_per_cu), fast_tile=int(fast_tile))

    def max_items(self, batch: int) -> int:
        """Most items any batch of ``batch`` sequences gets: the grid and the scratch slots."""
        if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
            raise ValueError(f"batch: expected an integer >= 1, got {batch!r}")
        return int(self.target_items + batch * (2 if self.fast_tile else 1))


@dataclass(frozen=True)
class Schedule:
    """The items of one batch in block order. Arrays are int64, one row per item."""

    seq: np.ndarray
    begin: np.ndarray
    end: np.ndarray
    first_slot: np.ndarray
    n_items: np.ndarray
    chunk: int

    @property
    def size(self) -> int:
        return int(self.seq.shape[0])

    @property
    def slot(self) -> np.ndarray:
        """Partial slot of each item (its block index), or -1 where it writes the output."""
        return np.where(self.n_items > 1, np.arange(self.size), -1)

    def items_of(self, seq: int) -> np.ndarray:
        """Indices of sequence ``seq``'s items, in token order."""
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
        if (lens > INT32_MAX).any():
            bad = int(np.flatnonzero(lens > INT32_MAX)[0])
            raise ValueError(f"{name}: lengths must be <= {INT32_MAX}, {name}[{bad}] = {int(lens[bad])}")
    lens = lens.astype(np.int64)
    if (lens < 0).any() or (lens > INT32_MAX).any():
        bad = int(np.flatnonzero((lens < 0) | (lens > INT32_MAX))[0])
        raise ValueError(f"{name}: lengths must lie in [0, {INT32_MAX}], {name}[{bad}] = {int(lens[bad])}")
    return lens


def split_chunk(total: int, policy: SplitPolicy) -> int:
    """Longest token range one item gets (core/schedule.h's ``chunk``)."""
    chunk = max(-(-int(total) // policy.target_items), policy.min_split_tokens)
    return -(-chunk // policy.align_tokens) * policy.align_tokens


def schedule(seq_lens, policy: SplitPolicy) -> Schedule:
    """The device's split of a batch with these lengths, item by item in block order."""
    if not isinstance(policy, SplitPolicy):
        raise TypeError(f"policy: expected a hipmla.schedule.SplitPolicy, got {type(policy).__name__}")
    lens = check_lens(seq_lens)
    align, fast = policy.align_tokens, policy.fast_tile
    chunk = split_chunk(int(lens.sum()), policy)
    base = np.maximum(-(-lens // chunk), 1)
    units = -(-lens // align)
    last_begin = units * (base - 1) // base * align
    tail = lens % fast if fast else np.zeros_like(lens)
    extra = (tail > 0) & (lens - last_begin > tail) if fast else np.zeros(lens.shape, bool)
    n = base + extra
    first = np.concatenate([[0], np.cumsum(n)[:-1]])
    seq = np.repeat(np.arange(lens.shape[0]), n)
    k = np.arange(seq.shape[0]) - first[seq]
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
    return Schedule(seq=seq, begin=begin, end=end, first_slot=first[seq], n_items=n[seq], chunk=chunk)
