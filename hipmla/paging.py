"""Where each sequence's tokens live in the KV cache: contiguous rows or a page table.

The paged convention is FlashInfer's and aiter's: ``kv_indptr`` ``(b+1,)`` int32 offsets
into ``kv_indices``; ``kv_indices`` int32 page ids (any order, repeats allowed: pages
shared between sequences); ``kv_last_page_len`` ``(b,)`` int32 rows used in each
sequence's last page; a page is ``page_size`` consecutive cache rows (data rows and,
for mxfp4, the scale rows of the same index). Token t of sequence s is row
``kv_indices[kv_indptr[s] + t // page_size] * page_size + t % page_size``. Without a page
table, ``kv_indptr`` holds row offsets and sequence s owns rows
``kv_indptr[s] .. kv_indptr[s+1]-1``. The kernels' one copy of this rule is
``hip_src/core/paged.h``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hipmla.formats import KVCache
from hipmla.validate import INT32_MAX, MAX_SEQ_TOKENS, check_array, check_indptr, check_int


#: Page sizes the kernels take: every power of two from 1 (SGLang's token-level
#: indices) to 128.
PAGE_SIZES = tuple(1 << k for k in range(8))


def check_page_size(page_size) -> int:
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) \
            or int(page_size) not in PAGE_SIZES:
        raise ValueError(f"page_size: expected a power of two in 1..128, got {page_size!r}")
    return int(page_size)


@dataclass(frozen=True)
class KvLayout:
    """The map from (sequence, token) to cache row for one batch (host arrays)."""

    kv_indptr: np.ndarray
    kv_indices: np.ndarray | None = None
    kv_last_page_len: np.ndarray | None = None
    page_size: int = 1

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """Raise ValueError unless the arrays describe a valid layout. Run when the layout is
        made and again by each :meth:`hipmla.decode.Decoder.decode`: the arrays are the
        caller's, and a serving loop may edit them in place between steps."""
        indptr = check_indptr(self.kv_indptr, "kv_indptr")
        if int(indptr[-1]) > INT32_MAX:  # the kernels' offsets are int32
            raise ValueError(f"kv_indptr: last entry {int(indptr[-1])} exceeds the int32 range ({INT32_MAX})")
        check_page_size(self.page_size)
        if (self.kv_indices is None) != (self.kv_last_page_len is None):
            missing = "kv_indices" if self.kv_indices is None else "kv_last_page_len"
            raise ValueError(f"{missing}: a page table needs both kv_indices and kv_last_page_len "
                             f"(or neither: contiguous rows), {missing} is missing")
        if self.kv_indices is None:
            if self.page_size != 1:
                raise ValueError(f"page_size: {self.page_size!r} given without a page table "
                                 f"(kv_indices, kv_last_page_len): contiguous rows have no pages")
            self._check_seq_tokens()
            return
        b = indptr.shape[0] - 1
        idx = check_array(self.kv_indices, "kv_indices", dtype=(np.int32, np.int64), ndim=1, contiguous=False)
        last = check_array(self.kv_last_page_len, "kv_last_page_len", dtype=(np.int32, np.int64),
                           shape=(b,), contiguous=False)
        if int(indptr[-1]) > idx.shape[0]:
            raise ValueError(f"kv_indptr: last entry {int(indptr[-1])} exceeds the "
                             f"{idx.shape[0]} entries of kv_indices")
        if idx.size and (idx[: int(indptr[-1])] < 0).any():
            bad = int(np.flatnonzero(idx[: int(indptr[-1])] < 0)[0])
            raise ValueError(f"kv_indices: page ids must be >= 0, kv_indices[{bad}] = {int(idx[bad])}")
        if idx.size and int(idx[: int(indptr[-1])].max(initial=0)) > INT32_MAX // self.page_size:
            bad = int(np.argmax(idx[: int(indptr[-1])]))
            raise ValueError(f"kv_indices: page {int(idx[bad])} (kv_indices[{bad}]) starts past the int32 "
                             f"row range at {self.page_size} rows a page")
        pages = np.diff(indptr.astype(np.int64))
        bad = (pages > 0) & ((last < 1) | (last > self.page_size))
        if bad.any():
            s = int(np.flatnonzero(bad)[0])
            raise ValueError(f"kv_last_page_len: expected 1..{self.page_size} for a sequence with pages, "
                             f"kv_last_page_len[{s}] = {int(last[s])}")
        self._check_seq_tokens()

    def _check_seq_tokens(self) -> None:
        """At most MAX_SEQ_TOKENS a sequence (the kernels' int32 tile counts), in either layout."""
        tokens = self.seq_lens()
        if tokens.size and int(tokens.max()) > MAX_SEQ_TOKENS:
            s = int(np.argmax(tokens))
            pages = int(self.kv_indptr[s + 1]) - int(self.kv_indptr[s])
            how = f" ({pages} pages of {self.page_size})" if self.paged else ""
            raise ValueError(f"kv_indptr: sequence {s} has {int(tokens[s])} tokens{how}, more than a sequence "
                             f"may have ({MAX_SEQ_TOKENS}, 2^30)")

    @classmethod
    def contiguous(cls, seq_lens) -> KvLayout:
        """Sequences one after another from row 0."""
        from hipmla.schedule import check_lens

        lens = check_lens(seq_lens)
        indptr = np.zeros(lens.shape[0] + 1, dtype=np.int64)
        np.cumsum(lens, out=indptr[1:])
        if indptr[-1] > INT32_MAX:
            raise ValueError(f"seq_lens: total tokens {int(indptr[-1])} exceed the int32 row index range")
        return cls(indptr.astype(np.int32))

    @property
    def batch(self) -> int:
        return int(self.kv_indptr.shape[0] - 1)

    @property
    def paged(self) -> bool:
        return self.kv_indices is not None

    def seq_lens(self) -> np.ndarray:
        n = np.diff(np.asarray(self.kv_indptr, dtype=np.int64))
        if not self.paged:
            return n
        last = np.asarray(self.kv_last_page_len, dtype=np.int64)
        return np.where(n > 0, (n - 1) * self.page_size + last, 0)

    def rows(self, seq: int, begin: int = 0, end: int | None = None) -> np.ndarray:
        """Cache rows of tokens ``begin .. end-1`` of sequence ``seq`` (int64)."""
        n = int(self.seq_lens()[seq]) if end is None else int(end)
        t = np.arange(int(begin), n, dtype=np.int64)
        first = int(self.kv_indptr[seq])
        if not self.paged:
            return first + t
        pages = np.asarray(self.kv_indices, dtype=np.int64)[first + t // self.page_size]
        return pages * self.page_size + t % self.page_size

    def max_row(self) -> int:
        """Largest cache row any token reads, or -1 for a batch without tokens."""
        lens = self.seq_lens()
        if not lens.any():
            return -1
        if not self.paged:
            return int(self.kv_indptr[-1]) - 1
        used = np.asarray(self.kv_indices[: int(self.kv_indptr[-1])], dtype=np.int64)
        return int((used.max() + 1) * self.page_size - 1) if used.size else -1

    def check_cache(self, rows: int, name: str = "kv") -> None:
        """Every row the batch reads lies inside a cache of ``rows`` rows."""
        if self.max_row() < rows:
            return
        if not self.paged:
            raise ValueError(f"kv_indptr: last entry {int(self.kv_indptr[-1])} exceeds the {rows} rows "
                             f"of the KV cache ({name})")
        used = np.asarray(self.kv_indices[: int(self.kv_indptr[-1])], dtype=np.int64)
        bad = int(np.flatnonzero((used + 1) * self.page_size > rows)[0])
        raise ValueError(f"kv_indices: page {int(used[bad])} (kv_indices[{bad}]) ends past the {rows} rows "
                         f"of the KV cache ({name}) at {self.page_size} rows a page")


def as_layout(layout_or_indptr) -> KvLayout:
    """A :class:`KvLayout`, or a contiguous one from a host ``kv_indptr``."""
    if isinstance(layout_or_indptr, KvLayout):
        return layout_or_indptr
    if not isinstance(layout_or_indptr, np.ndarray):
        raise TypeError(f"layout: expected a hipmla.paging.KvLayout or a host kv_indptr (numpy int32/int64), "
                        f"got {type(layout_or_indptr).__name__}")
    return KvLayout(check_indptr(layout_or_indptr, "kv_indptr"))


def random_page_table(seq_lens, page_size: int, rng: np.random.Generator, *,
                      spare_pages: int = 0, shared: int = 0) -> KvLayout:
    """A paged layout of these lengths over a pool of pages in random order.

    ``spare_pages`` unused pages are mixed into the pool; ``shared`` pairs of sequences
    (with at least one full page each) share their first page, as prefix-cached
    sequences do. The pool has ``max(kv_indices) + 1`` pages.
    """
    from hipmla.schedule import check_lens

    lens = check_lens(seq_lens)
    page_size = check_page_size(page_size)
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng: expected a numpy.random.Generator (np.random.default_rng(seed)), "
                        f"got {type(rng).__name__}")
    check_int(spare_pages, "spare_pages", 0)
    check_int(shared, "shared", 0)
    pages = -(-lens // page_size)
    total = int(pages.sum())
    perm = rng.permutation(total + int(spare_pages)).astype(np.int32)[:total]
    indptr = np.zeros(lens.shape[0] + 1, dtype=np.int32)
    np.cumsum(pages, out=indptr[1:])
    indices = perm.copy()
    full = np.flatnonzero(lens >= 2 * page_size)
    if shared and full.size >= 2:
        for _ in range(int(shared)):
            a, b = rng.choice(full, size=2, replace=False)
            indices[indptr[b]] = indices[indptr[a]]
    last = np.where(lens > 0, lens - (pages - 1) * page_size, 1).astype(np.int32)
    return KvLayout(indptr, indices, last, page_size)


def gather(kv: KVCache, layout: KvLayout) -> tuple[KVCache, KvLayout]:
    """The same tokens laid out contiguously: a new cache whose sequence s is rows
    ``indptr[s] ..`` of it, and that contiguous layout."""
    lens = layout.seq_lens()
    rows = np.concatenate([layout.rows(s) for s in range(layout.batch)] or [np.zeros(0, np.int64)])
    return take_rows(kv, rows), KvLayout.contiguous(lens)


def take_rows(kv: KVCache, rows: np.ndarray) -> KVCache:
    """A cache made of the given rows of ``kv``, in that order."""
    return KVCache(kv.format, np.ascontiguousarray(kv.data[rows]),
                   scales=None if kv.scales is None else np.ascontiguousarray(kv.scales[rows]),
                   fp8_scale=kv.fp8_scale, fp8_variant=kv.fp8_variant, dim=kv.dim)


def scatter(kv: KVCache, layout: KvLayout, pool_rows: int | None = None) -> KVCache:
    """A page pool holding the contiguous cache ``kv`` (sequence after sequence from row
    0) at the rows ``layout`` maps its tokens to; rows no token uses are zero. Shared
    pages get the last writer's rows, so use it with layouts that share no pages."""
    top = layout.max_row()
    n = max(top + 1, 1) if pool_rows is None else int(pool_rows)
    rows = np.concatenate([layout.rows(s) for s in range(layout.batch)] or [np.zeros(0, np.int64)])
    data = np.zeros((n,) + kv.data.shape[1:], dtype=kv.data.dtype)
    data[rows] = kv.data[: rows.shape[0]]
    scales = None
    if kv.scales is not None:
        scales = np.zeros((n,) + kv.scales.shape[1:], dtype=kv.scales.dtype)
        scales[rows] = kv.scales[: rows.shape[0]]
    return KVCache(kv.format, data, scales=scales, fp8_scale=kv.fp8_scale,
                   fp8_variant=kv.fp8_variant, dim=kv.dim)
