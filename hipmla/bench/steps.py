"""The steps the benchmarks time: the ragged mixes beside the 8 uniform shapes, a step's
device buffers, and the bytes a step must move (the numerator of every GB/s)."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from hipmla import runtime
from hipmla.paging import KvLayout, random_page_table, scatter


def ragged_mixes() -> dict[str, np.ndarray]:
    """Three ragged batches of the bench: 64 and 300 sequences of uniform random lengths,
    and 4 long sequences beside 60 short ones."""
    rng = np.random.default_rng(6)
    return {
        "rag64": rng.integers(0, 16385, size=64),
        "rag300": rng.integers(0, 8193, size=300),
        "long+short": np.array([32768] * 4 + [500] * 60),
    }


def bytes_moved(kv_format: str, tokens: int, batch: int, scale_stride: int, n_slots: int,
                heads: int = 16, page_size: int = 0) -> int:
    """What a step must move: KV rows, Q, output + LSE, partials written and read back,
    the lengths (and page table) every block reads."""
    per_token = {"bf16": 1152, "fp8": 576, "mxfp4": 288 + scale_stride}[kv_format]
    q = batch * heads * 576 * 2
    out = batch * heads * (512 * 2 + 4)
    partials = 2 * n_slots * heads * (512 + 2) * 4
    meta = (batch + 1) * 4 + (batch * 4 + -(-tokens // page_size) * 4 if page_size else 0)
    return tokens * per_token + q + out + partials + meta


def device_step(cache, layout: KvLayout, rng: np.random.Generator, heads: int = 16):
    """One decode step's device buffers for ``cache`` read through ``layout``: random bf16 Q
    (N(0, 1)) of ``heads`` heads, the cache and its layout uploaded, output and LSE
    allocated. Returns the host Q, the buffers (``Decoder.run``'s keyword arguments) and the
    other arguments."""
    b = layout.batch
    q = rng.standard_normal((b, heads, 576), dtype=np.float32).astype(ml_dtypes.bfloat16)
    host = {"q": q.view(np.uint16), "kv": cache.data, "kv_indptr": layout.kv_indptr,
            "kv_indices": layout.kv_indices, "kv_last_page_len": layout.kv_last_page_len,
            "kv_scale": cache.scales}
    bufs = {k: runtime.DeviceArray.from_host(np.ascontiguousarray(v)) if v is not None else None
            for k, v in host.items()}
    bufs["out"] = runtime.DeviceArray((b, heads, 512), np.uint16)
    bufs["lse"] = runtime.DeviceArray((b, heads), np.float32)
    extra = dict(page_size=layout.page_size, fp8_scale=cache.fp8_scale if cache.format == "fp8" else None)
    return q, bufs, extra


def lens_step(kv, lens, page_size: int, rng: np.random.Generator, heads: int = 16):
    """:func:`device_step` for sequences of ``lens`` tokens read from the front of ``kv``:
    contiguous rows (``page_size`` 0), or ``kv`` scattered into pages of ``page_size`` rows
    in random order. Returns what :func:`device_step` returns."""
    layout = random_page_table(lens, page_size, rng) if page_size else KvLayout.contiguous(lens)
    return device_step(scatter(kv, layout) if page_size else kv, layout, rng, heads)
