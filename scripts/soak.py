#!/usr/bin/env python3
"""Soak, concurrency and allocation failure of the decoder on a GPU (issue 13, item 8).

    python scripts/soak.py [--steps 10000] [--format mxfp4] [--out DIR]

1. soak: one Decoder over a paged cache (16 rows a page, a preallocated pool of random
   codes) and a batch of 8 sequences that each grow by one token a step, taking a page from
   the pool's free list (random order) whenever a token starts one; ``--steps`` steps of
   ``Decoder.run`` with torch tensors, new views each step, the way a serving loop hands
   them over, and no synchronization between measurement points. At step 100, at the
   baseline (step 1000, or half of a shorter run), every ``--check-every`` steps and at
   the end: host RSS (/proc/self/statm), device memory in use (hipMemGetInfo through
   ``hipmla.runtime.memory_info``) and torch's allocator, and ``check_errors`` must be
   clean. That step's output, LSE and page tables are kept (in buffers allocated before
   the first step) and checked after the last one, so that no emulator temporaries lie
   between two memory samples: the device's tables must be the host's, and two sequences
   (in turn) must match the emulator and exact attention under tests/test_decode_gpu.py's
   bounds. Memory may not grow from the baseline to the end beyond ``--host-growth-mib``
   / ``--device-growth-mib``; torch's allocated bytes not at all.
2. concurrency: two Decoders with their own inputs, each replaying ``--concurrent-steps``
   growing steps (page table copied in on the device, decode, output copied out) on its
   own torch stream from its own Python thread, three rounds; every step's output and LSE
   must be bit-identical to the same steps run one decoder after the other on one stream.
3. allocation failure: on the soaked decoder, ``reserve`` of a larger batch while
   ``hipmla.runtime.alloc`` raises hipErrorOutOfMemory once (simulated), then a reserve
   larger than the device (a real hipErrorOutOfMemory); after each the decoder's state and
   the device memory in use must be unchanged and a step bit-identical; then the larger
   reserve must succeed and its step be bit-identical too.

Progress goes to stderr, one result line per phase and a summary line to stdout; with
``--out DIR``, DIR/soak.log gets both as they happen and DIR/soak.json the measurements.
Exit status 1 when a check failed, 2 when there is no GPU or no torch.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable, Iterator

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "tests"))  # the GPU tests' bounds, not a copy of them

from hipmla import __version__, decode, kernels, runtime  # noqa: E402
from hipmla.formats import KV_FORMATS  # noqa: E402
from hipmla.inputs import random_cache  # noqa: E402
from hipmla.paging import KvLayout, check_page_size  # noqa: E402
from hipmla.reference import mla_decode_reference  # noqa: E402
from test_decode_gpu import SM_SCALE, assert_close_to_emulator, assert_close_to_reference  # noqa: E402

PAGE_SIZE = 16
#: The soak's starting lengths: an empty sequence, one token, both sides of a page edge,
#: a tile edge, and two long ones. Each grows by one token a step.
START_LENS = (0, 1, 15, 16, 17, 127, 1000, 4000)
#: Pages the pool has beyond what the growth needs, so the free list never runs dry exactly.
SPARE_PAGES = 64
#: Sequences per measured step checked against the emulator and the reference, in turn:
#: over a soak every sequence gets checked, and the host's f64 reference stays cheap.
CHECKED_SEQS = 2
#: Memory growth is measured from here to the end (or from half of a shorter run).
BASELINE_STEP = 1000
CONCURRENT_ROUNDS = 3
#: HIP's status when hipMalloc finds no room (hip_runtime_api.h; the HIP-on-CUDA library
#: maps CUDA_ERROR_OUT_OF_MEMORY to it).
HIP_ERROR_OUT_OF_MEMORY = 2
MIB = 1 << 20


# ----------------------------------------------------------------------------- page tables


class GrowingBatch:
    """Sequences that grow by one token a step over a fixed pool of pages, handed out the
    way a serving system's allocator does: a sequence takes the next page of the free list
    (a random permutation of the pool) when its next token starts a page. Pages never
    move, so a token's cache row stays the same while its sequence grows."""

    def __init__(self, lens, page_size: int, pool_pages: int, rng: np.random.Generator):
        self.page_size = check_page_size(page_size)
        self.lens = np.array(lens, dtype=np.int64)
        self.pool_pages = int(pool_pages)
        self._free = rng.permutation(self.pool_pages).astype(np.int32)
        self._taken = 0
        # A row per sequence, as long as the pool: one sequence may end up with every page.
        self._pages = np.zeros((self.lens.shape[0], self.pool_pages), dtype=np.int32)
        self._counts = np.zeros(self.lens.shape[0], dtype=np.int64)
        for s, n in enumerate(-(-self.lens // self.page_size)):
            for _ in range(int(n)):
                self._take(s)

    @staticmethod
    def pages_for(lens, steps: int, page_size: int) -> int:
        """Pages the sequences hold once each has grown by ``steps`` tokens."""
        return int((-(-(np.asarray(lens, dtype=np.int64) + steps) // page_size)).sum())

    @property
    def batch(self) -> int:
        return int(self.lens.shape[0])

    def _take(self, s: int) -> None:
        if self._taken == self.pool_pages:
            raise RuntimeError(f"the pool's {self.pool_pages} pages are all taken")
        self._pages[s, self._counts[s]] = self._free[self._taken]
        self._taken += 1
        self._counts[s] += 1

    def grow(self) -> bool:
        """Every sequence gains a token; True when one took a page (the table changed,
        not only the last-page lengths)."""
        starting = np.flatnonzero(self.lens % self.page_size == 0)
        for s in starting:
            self._take(int(s))
        self.lens += 1
        return starting.size > 0

    def indptr(self) -> np.ndarray:
        out = np.zeros(self.batch + 1, dtype=np.int32)
        np.cumsum(self._counts, out=out[1:])
        return out

    def indices(self) -> np.ndarray:
        return np.concatenate([self._pages[s, :c] for s, c in enumerate(self._counts)])

    def last_page_len(self) -> np.ndarray:
        return np.where(self.lens > 0, self.lens - (self._counts - 1) * self.page_size, 1).astype(np.int32)

    def layout(self) -> KvLayout:
        return KvLayout(self.indptr(), self.indices(), self.last_page_len(), self.page_size)

    def plan(self, steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The tables of the current lengths and of ``steps - 1`` growths after them, one
        row a step: ``(kv_indptr (steps, b+1), kv_indices (steps, pool_pages) zero-padded,
        kv_last_page_len (steps, b))``, int32. Grows the batch."""
        indptr = np.zeros((steps, self.batch + 1), dtype=np.int32)
        indices = np.zeros((steps, self.pool_pages), dtype=np.int32)
        last = np.zeros((steps, self.batch), dtype=np.int32)
        for k in range(steps):
            if k:
                self.grow()
            indptr[k] = self.indptr()
            indices[k, : indptr[k, -1]] = self.indices()
            last[k] = self.last_page_len()
        return indptr, indices, last


def measure_points(steps: int, every: int) -> tuple[list[int], int]:
    """``(steps to measure at, the baseline step among them)``: step 100, the baseline,
    every ``every`` steps, and the last."""
    baseline = max(1, min(BASELINE_STEP, steps // 2))
    points = {p for p in (100, *range(every, steps + 1, every)) if p <= steps} | {baseline, steps}
    return sorted(points), baseline


# ----------------------------------------------------------------------------- allocation failure


class FailingAlloc:
    """How many of the allocations to fail are left (0: the failure happened)."""

    def __init__(self, times: int):
        self.left = times


@contextlib.contextmanager
def failing_alloc(times: int = 1) -> Iterator[FailingAlloc]:
    """``hipmla.runtime.alloc`` raising hipErrorOutOfMemory for the next ``times`` calls,
    as hipMalloc does on a full device, then allocating again; restored on leaving."""
    real = runtime.alloc
    shots = FailingAlloc(times)

    def alloc(nbytes: int):
        if shots.left:
            shots.left -= 1
            raise runtime.HipError(HIP_ERROR_OUT_OF_MEMORY, "hipErrorOutOfMemory",
                                   f"out of memory (simulated, {nbytes} bytes asked for)")
        return real(nbytes)

    runtime.alloc = alloc
    try:
        yield shots
    finally:
        runtime.alloc = real


def decoder_state(dec: decode.Decoder) -> tuple:
    """What a failed reserve must leave as it was: the capacity, and the argument struct
    the kernels receive (it holds the scratch addresses)."""
    return dec.max_batch, dec.scratch_bytes, bytes(dec._params)


def largest_reserve(dec: decode.Decoder) -> int:
    """The largest max_batch (one query token each) whose scratch is no larger than the
    device's memory: reserve() refuses more before allocating."""
    lo, hi = dec.max_batch, decode.MAX_RESERVE
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if dec.scratch_layout(mid, mid).total_bytes <= dec.device.total_mem:
            lo = mid
        else:
            hi = mid - 1
    return lo


def alloc_failure_checks(dec: decode.Decoder, step: Callable[[], object], used: Callable[[], int],
                         device_tolerance: int) -> tuple[list[str], dict]:
    """Failed reserves (a simulated hipErrorOutOfMemory, then a real one: the largest
    scratch reserve() does not refuse outright, as large as the device's memory, more than
    is free beside this process's context) leave ``dec`` unchanged, the device memory in use within
    ``device_tolerance`` bytes and ``step()`` giving what it gave before; a later reserve
    works and ``step()`` still gives the same. ``(failures, measurements)``."""
    failures: list[str] = []
    before, state, mem = step(), decoder_state(dec), used()
    grow_to = 4 * dec.max_batch
    too_big = largest_reserve(dec)
    info: dict = {"max_batch": dec.max_batch, "scratch_bytes": dec.scratch_bytes, "grow_to": grow_to,
                  "too_big": too_big, "too_big_bytes": dec.scratch_layout(too_big, too_big).total_bytes,
                  "used_before": mem}

    def expect_oom(what: str, call: Callable[[], None]) -> None:
        try:
            call()
        except runtime.HipError as e:
            info[f"{what}_error"] = str(e)
            if e.code != HIP_ERROR_OUT_OF_MEMORY:
                failures.append(f"{what}: expected hipErrorOutOfMemory, got {e}")
        else:
            failures.append(f"{what}: reserve succeeded")
            return
        if decoder_state(dec) != state:
            failures.append(f"{what}: the decoder's capacity or launch arguments changed")
        info[f"{what}_used_delta"] = used() - mem
        if abs(info[f"{what}_used_delta"]) > device_tolerance:
            failures.append(f"{what}: device memory in use moved by {info[f'{what}_used_delta']} bytes")
        if step() != before:
            failures.append(f"{what}: the next step's result differs from the one before")

    with failing_alloc() as shots:
        expect_oom("simulated", lambda: dec.reserve(grow_to))
    if shots.left:
        failures.append("simulated: reserve allocated nothing, so no failure was injected")
    expect_oom("real", lambda: dec.reserve(too_big))
    dec.reserve(grow_to)
    info["grown_scratch_bytes"] = dec.scratch_bytes
    if dec.max_batch != grow_to or dec.scratch_bytes <= state[1]:
        failures.append(f"reserve({grow_to}) after the failures left max_batch {dec.max_batch}, "
                        f"scratch {dec.scratch_bytes} bytes")
    if step() != before:
        failures.append("the step after the successful reserve differs from the one before")
    return failures, info


# ----------------------------------------------------------------------------- the GPU side


def host_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_sample(step: int) -> dict:
    """Host and device memory in use now. Collected garbage first: a cycle the collector
    frees is no leak."""
    import torch

    gc.collect()
    free, total = runtime.memory_info()
    return {"step": step, "host_rss": host_rss(), "device_used": total - free,
            "torch_allocated": torch.cuda.memory_allocated(), "torch_reserved": torch.cuda.memory_reserved(),
            "gc_objects": len(gc.get_objects())}


class Rig:
    """One decoder and its own device inputs: a page pool of random codes, Q, and fixed
    buffers for the page table, output and LSE that every step reuses (their contents
    change, never their addresses: the decoder's cached hot path)."""

    def __init__(self, kv_format: str, lens, steps: int, rng: np.random.Generator):
        import torch

        self.dec = decode.Decoder(kv_format, SM_SCALE, max_batch=len(lens))
        pool_pages = GrowingBatch.pages_for(lens, steps, PAGE_SIZE) + SPARE_PAGES
        self.batch = GrowingBatch(lens, PAGE_SIZE, pool_pages, rng)
        self.pool = random_cache(pool_pages * PAGE_SIZE, kv_format, rng, fp8_variant=self.dec.fp8_variant,
                                 scale_stride=24)
        b = self.batch.batch
        self.q_host = rng.standard_normal((b, kernels.HEADS, kernels.D_QK), dtype=np.float32) \
            .astype(ml_dtypes.bfloat16)
        self.q = torch.from_numpy(self.q_host.view(np.int16)).cuda().view(torch.bfloat16)
        data = self.pool.data.view(np.int16) if kv_format == "bf16" else self.pool.data
        self.kv = torch.from_numpy(data.copy()).cuda()  # a copy: torch warns on read-only arrays
        self.kv_scale = torch.from_numpy(self.pool.scales).cuda() if kv_format == "mxfp4" else None
        self.fp8_scale = self.pool.fp8_scale if kv_format == "fp8" else None
        self.indptr = torch.zeros(b + 1, dtype=torch.int32, device="cuda")
        self.indices = torch.zeros(pool_pages, dtype=torch.int32, device="cuda")
        self.last = torch.ones(b, dtype=torch.int32, device="cuda")
        self.out = torch.empty(b, kernels.HEADS, kernels.D_V, dtype=torch.bfloat16, device="cuda")
        self.lse = torch.empty(b, kernels.HEADS, dtype=torch.float32, device="cuda")

    def upload(self, pages: bool) -> None:
        """The host's tables of the current lengths, copied in on the current stream
        without waiting (a pageable source is staged before the copy returns); the
        indices and offsets only when a page was taken."""
        import torch

        self.last.copy_(torch.from_numpy(self.batch.last_page_len()), non_blocking=True)
        if pages:
            indices = self.batch.indices()
            self.indptr.copy_(torch.from_numpy(self.batch.indptr()), non_blocking=True)
            self.indices[: indices.shape[0]].copy_(torch.from_numpy(indices), non_blocking=True)

    def run(self, stream) -> None:
        import torch

        self.dec.run(self.q.view(torch.int16), self.kv, self.indptr, self.out.view(torch.int16),
                     kv_indices=self.indices, kv_last_page_len=self.last, page_size=PAGE_SIZE,
                     kv_scale=self.kv_scale, lse=self.lse, fp8_scale=self.fp8_scale, stream=stream)

    def result_bits(self) -> bytes:
        """Output and LSE of the last step, as bytes (waits for it)."""
        import torch

        torch.cuda.synchronize()
        return self.out.view(torch.int16).cpu().numpy().tobytes() + self.lse.cpu().numpy().tobytes()

    def check(self, out, lse, layout: KvLayout, seqs: np.ndarray, what: str) -> dict:
        """Host ``out``/``lse`` of ``layout`` against the emulator and exact attention, for
        ``seqs``; raises AssertionError beyond the GPU tests' bounds."""
        emu_out, emu_lse = self.dec.emulate(self.q_host, self.pool, layout, seqs=seqs)
        assert_close_to_emulator(out[seqs], lse[seqs], emu_out, emu_lse, what)
        ref_out, ref_lse, ref_mag = mla_decode_reference(self.q_host, self.pool, layout, self.dec.config.sm_scale,
                                                         seqs=seqs, magnitude=True)
        assert_close_to_reference(out[seqs], lse[seqs], ref_out, ref_lse, ref_mag, what, self.dec.config.q_precision)
        o, e = out[seqs].astype(np.float32), emu_out.astype(np.float32)
        return {"seqs": seqs.tolist(), "lens": layout.seq_lens()[seqs].tolist(),
                "emu_max_abs_over_scale": float(np.abs(o - e).max(initial=0)) / (float(np.abs(e).max(initial=0)) or 1),
                "emu_bitexact": float((o == e).mean()) if o.size else 1.0}


class Snapshots:
    """What the soak's output checks need, taken at each measurement point into buffers
    allocated before the first step: the output and LSE, the device's page table and the
    host's. The checks run after the last step, so the emulator's large temporaries never
    sit between two memory samples."""

    def __init__(self, rig: Rig, points: int):
        import torch

        b, pages = rig.batch.batch, rig.batch.pool_pages
        self.out = torch.empty(points, b, kernels.HEADS, kernels.D_V, dtype=torch.int16)
        self.lse = torch.empty(points, b, kernels.HEADS, dtype=torch.float32)
        self.device = (torch.empty(points, b + 1, dtype=torch.int32), torch.empty(points, pages, dtype=torch.int32),
                       torch.empty(points, b, dtype=torch.int32))
        self.host = (np.zeros((points, b + 1), np.int32), np.zeros((points, pages), np.int32),
                     np.zeros((points, b), np.int32))

    def take(self, i: int, rig: Rig) -> None:
        import torch

        self.out[i].copy_(rig.out.view(torch.int16))
        self.lse[i].copy_(rig.lse)
        for dst, src in zip(self.device, (rig.indptr, rig.indices, rig.last)):
            dst[i].copy_(src)
        indptr, indices, last = self.host
        indptr[i] = rig.batch.indptr()
        indices[i, : indptr[i, -1]] = rig.batch.indices()
        last[i] = rig.batch.last_page_len()

    def check(self, i: int, rig: Rig, seqs: np.ndarray, what: str) -> dict:
        """Snapshot ``i`` against the emulator and the reference (AssertionError if not)."""
        dev, host = [a[i].numpy() for a in self.device], [a[i] for a in self.host]
        n = int(host[0][-1])  # the step's entries: past them the device's table holds older ones
        dev[1], host[1] = dev[1][:n], host[1][:n]
        for name, d, h in zip(("kv_indptr", "kv_indices", "kv_last_page_len"), dev, host):
            assert np.array_equal(d, h), f"{what}: the device's {name} is not the host's"
        layout = KvLayout(*(a[i] for a in self.host), PAGE_SIZE)
        out = self.out[i].numpy().view(np.uint16).view(ml_dtypes.bfloat16)
        return rig.check(out, self.lse[i].numpy(), layout, seqs, what)


def soak_phase(rig: Rig, steps: int, every: int, host_tolerance: int, device_tolerance: int, log: Log) -> dict:
    import torch

    stream = torch.cuda.current_stream()
    points, baseline = measure_points(steps, every)
    snapshots = Snapshots(rig, len(points))
    failures: list[str] = []
    samples: list[dict] = []
    b = rig.batch.batch
    errors_clean = True
    loop_s = 0.0
    rig.upload(pages=True)
    t = time.perf_counter()
    for step in range(1, steps + 1):
        if step > 1:
            rig.upload(pages=rig.batch.grow())
        rig.run(stream)
        if step not in points:
            continue
        torch.cuda.synchronize()
        loop_s += time.perf_counter() - t
        samples.append(memory_sample(step))
        try:
            rig.dec.check_errors()
        except decode.DeviceInputError as e:
            errors_clean = False
            failures.append(f"step {step}: {e}")
        snapshots.take(len(samples) - 1, rig)
        s, lens = samples[-1], rig.batch.lens
        log.progress(f"soak step {step:>6}: lengths {lens.min()}..{lens.max()}, {loop_s / step * 1e6:.1f} us/step, "
                     f"host RSS {s['host_rss'] / MIB:.2f} MiB, device used {s['device_used'] / MIB:.1f} MiB, "
                     f"torch allocated {s['torch_allocated']} B, {s['gc_objects']} objects")
        t = time.perf_counter()
    checks: list[dict] = []
    for i, step in enumerate(points):
        seqs = np.array(sorted({(CHECKED_SEQS * i + j) % b for j in range(CHECKED_SEQS)}))
        try:
            checks.append({"step": step, **snapshots.check(i, rig, seqs, f"soak step {step}")})
            c = checks[-1]
            log.progress(f"soak step {step:>6} check: seqs {c['seqs']} (lengths {c['lens']}) match the emulator "
                         f"(|dev-emu| <= {c['emu_max_abs_over_scale']:.2e} of scale, {c['emu_bitexact']:.1%} "
                         f"bit-exact) and the reference")
        except AssertionError as e:
            failures.append(f"step {step}: {e}")
            log.progress(f"soak step {step:>6} check: FAIL {e}")
    base = next(s for s in samples if s["step"] == baseline)
    end = samples[-1]
    growth = {k: end[k] - base[k] for k in ("host_rss", "device_used", "torch_allocated", "torch_reserved",
                                            "gc_objects")}
    if growth["host_rss"] > host_tolerance:
        failures.append(f"host RSS grew {growth['host_rss'] / MIB:.2f} MiB from step {baseline} to {end['step']} "
                        f"(allowed {host_tolerance / MIB:.2f})")
    if growth["device_used"] > device_tolerance:
        failures.append(f"device memory in use grew {growth['device_used']} bytes from step {baseline} "
                        f"to {end['step']} (allowed {device_tolerance})")
    if growth["torch_allocated"] or growth["torch_reserved"] > device_tolerance:
        failures.append(f"torch's allocator grew: allocated {growth['torch_allocated']}, "
                        f"reserved {growth['torch_reserved']} bytes")
    if len(checks) != len(points):
        failures.append(f"{len(points) - len(checks)} of {len(points)} output checks failed")
    us = loop_s / steps * 1e6
    line = (f"{steps} steps ({rig.dec.config.kv_format}, batch {b}, lengths up to {rig.batch.lens.max()}), "
            f"{us:.1f} us/step; from step {baseline} to {end['step']}: host RSS {growth['host_rss'] / MIB:+.2f} MiB, "
            f"device used {growth['device_used'] / MIB:+.2f} MiB (hipMemGetInfo), torch allocated "
            f"{growth['torch_allocated']:+d} B, {growth['gc_objects']:+d} objects; "
            f"{len(checks)}/{len(points)} steps match emulator and reference, check_errors "
            f"{'clean' if errors_clean else 'NOT clean'}")
    return {"failures": failures, "line": line, "baseline_step": baseline, "us_per_step": us,
            "samples": samples, "growth": growth, "checks": checks}


def replay(rig: Rig, plan: tuple, out_all, lse_all, stream) -> None:
    """Every planned step on ``stream``: the step's tables copied into the rig's fixed
    buffers, the decode, the output copied out; nothing waits."""
    import torch

    indptr, indices, last = plan
    with torch.cuda.stream(stream):
        for k in range(indptr.shape[0]):
            rig.indptr.copy_(indptr[k])
            rig.indices.copy_(indices[k])
            rig.last.copy_(last[k])
            rig.run(stream)
            out_all[k].copy_(rig.out)
            lse_all[k].copy_(rig.lse)


def concurrency_phase(kv_format: str, steps: int, seed: int, log: Log) -> dict:
    import torch

    rigs, plans, host_plans = [], [], []
    for i in range(2):
        rng = np.random.default_rng([seed, i])
        lens = rng.integers(0, 3000, size=len(START_LENS))
        lens[i] = 0
        rig = Rig(kv_format, lens, steps, rng)
        host = rig.batch.plan(steps)
        rigs.append(rig)
        host_plans.append(host)
        plans.append(tuple(torch.from_numpy(a).cuda() for a in host))
    b = rigs[0].batch.batch
    shape = (steps, b, kernels.HEADS)

    def outputs() -> list[tuple]:
        return [(torch.empty(*shape, kernels.D_V, dtype=torch.bfloat16, device="cuda"),
                 torch.empty(*shape, dtype=torch.float32, device="cuda")) for _ in rigs]

    def poison(bufs: list[tuple]) -> None:  # NaN everywhere: every step must write its output
        for out, lse in bufs:
            out.view(torch.int16).fill_(-1)
            lse.fill_(float("nan"))
        torch.cuda.synchronize()

    failures: list[str] = []
    sequential, threaded = outputs(), outputs()
    poison(sequential)
    one_stream = torch.cuda.current_stream()
    t = time.perf_counter()
    for rig, plan, (out, lse) in zip(rigs, plans, sequential):
        replay(rig, plan, out, lse, one_stream)
    torch.cuda.synchronize()
    sequential_s = time.perf_counter() - t
    for i, (rig, host) in enumerate(zip(rigs, host_plans)):
        layout = KvLayout(host[0][-1], host[1][-1], host[2][-1], PAGE_SIZE)
        out = sequential[i][0][-1].view(torch.int16).cpu().numpy().view(np.uint16).view(ml_dtypes.bfloat16)
        try:
            rig.check(out, sequential[i][1][-1].cpu().numpy(), layout, np.array([i, b - 1]),
                      f"decoder {i}, last sequential step")
        except AssertionError as e:
            failures.append(str(e))
    streams = [torch.cuda.Stream() for _ in rigs]
    rounds = []
    for r in range(CONCURRENT_ROUNDS):
        poison(threaded)
        barrier = threading.Barrier(len(rigs))
        spans: list[tuple[float, float] | None] = [None] * len(rigs)
        errors: list[str] = []

        def worker(i: int) -> None:
            try:
                barrier.wait()
                t0 = time.perf_counter()
                replay(rigs[i], plans[i], *threaded[i], streams[i])
                streams[i].synchronize()  # its own stream: the span ends with its own last step
                spans[i] = (t0, time.perf_counter())
            except Exception as e:  # noqa: BLE001 - reported as the round's failure
                errors.append(f"thread {i}: {type(e).__name__}: {e}")

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(rigs))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        torch.cuda.synchronize()
        failures += [f"round {r}: {e}" for e in errors]
        differing = []
        for i, rig in enumerate(rigs):
            (so, sl), (to, tl) = sequential[i], threaded[i]
            bad = ((so.view(torch.int16) != to.view(torch.int16)).flatten(1).any(1)
                   | (sl.view(torch.int32) != tl.view(torch.int32)).flatten(1).any(1))
            differing.append(int(bad.sum()))
            if differing[-1]:
                failures.append(f"round {r}: decoder {i}: {differing[-1]} of {steps} steps differ from the "
                                f"sequential run (first: step {int(bad.nonzero()[0])})")
            try:
                rig.dec.check_errors()
            except decode.DeviceInputError as e:
                failures.append(f"round {r}: decoder {i}: {e}")
        # how long both threads were launching and running at once (0 when one failed)
        overlap = wall = 0.0
        if all(spans):
            overlap = max(0.0, min(s[1] for s in spans) - max(s[0] for s in spans))
            wall = max(s[1] for s in spans) - min(s[0] for s in spans)
        rounds.append({"differing_steps": differing, "overlap_s": overlap, "wall_s": wall})
        log.progress(f"concurrency round {r}: differing steps {differing}, threads overlapped "
                     f"{overlap * 1e3:.1f} ms of {wall * 1e3:.1f} ms")
    identical = all(r["differing_steps"] == [0] * len(rigs) for r in rounds)
    line = (f"2 decoders x {steps} steps ({kv_format}, batch {b}), {CONCURRENT_ROUNDS} rounds on 2 streams from "
            f"2 threads: {'bit-identical' if identical else 'NOT identical'} to one after the other on one "
            f"stream (output and LSE of every step); threads overlapped "
            f"{min(r['overlap_s'] for r in rounds) * 1e3:.1f} ms at least; sequential took {sequential_s * 1e3:.1f} ms")
    for rig in rigs:
        rig.dec.close()
    return {"failures": failures, "line": line, "steps": steps, "sequential_s": sequential_s, "rounds": rounds}


def alloc_phase(rig: Rig, device_tolerance: int) -> dict:
    import torch

    stream = torch.cuda.current_stream()

    def step() -> bytes:
        rig.run(stream)
        bits = rig.result_bits()
        rig.dec.check_errors()
        return bits

    def used() -> int:
        free, total = runtime.memory_info()
        return total - free

    failures, info = alloc_failure_checks(rig.dec, step, used, device_tolerance)
    line = (f"reserve({info['grow_to']}) with a simulated hipErrorOutOfMemory, then reserve({info['too_big']}) "
            f"({info['too_big_bytes'] / 2**30:.1f} GiB of scratch, a real one): "
            f"device memory in use moved {info.get('simulated_used_delta')} / {info.get('real_used_delta')} B; "
            + ("the decoder unchanged (max_batch {max_batch}) and the next step bit-identical after each; then "
               "reserve({grow_to}) worked (scratch {scratch_bytes} -> {grown_scratch_bytes} B), its step "
               "bit-identical".format(**info) if not failures else "checks failed"))
    return {"failures": failures, "line": line, **info}


# ----------------------------------------------------------------------------- main


class Log:
    """Progress to stderr, results to stdout, both to DIR/soak.log as they happen."""

    def __init__(self, out: Path | None):
        self._file = open(out / "soak.log", "w") if out is not None else None

    def progress(self, line: str) -> None:
        self._emit(line, sys.stderr)

    def result(self, line: str) -> None:
        self._emit(line, sys.stdout)

    def _emit(self, line: str, stream) -> None:
        print(line, file=stream, flush=True)
        if self._file is not None:
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/soak.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10000, help="soak steps (default 10000)")
    p.add_argument("--format", choices=KV_FORMATS, default="mxfp4", help="KV cache format (default mxfp4)")
    p.add_argument("--check-every", type=int, default=1000,
                   help="steps between measurements and output checks (default 1000)")
    p.add_argument("--concurrent-steps", type=int, default=1000,
                   help="steps per decoder in the concurrency phase (default 1000)")
    p.add_argument("--host-growth-mib", type=float, default=1.0,
                   help="host RSS growth allowed from the baseline to the end (default 1)")
    p.add_argument("--device-growth-mib", type=float, default=0.0,
                   help="device memory growth allowed (hipMemGetInfo, device-wide; default 0)")
    p.add_argument("--seed", type=int, default=13)
    p.add_argument("--out", type=Path, default=None, help="folder for soak.json and soak.log")
    a = p.parse_args(argv)
    for name in ("steps", "check_every", "concurrent_steps"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected an integer >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
    log = Log(a.out)
    try:
        return run_phases(a, log)
    finally:
        log.close()


def run_phases(a: argparse.Namespace, log: Log) -> int:
    try:
        import torch
    except ImportError:
        log.result("soak.py: no torch here (the phases drive the decoder with torch tensors)")
        return 2
    if not runtime.available() or not torch.cuda.is_available():
        log.result("soak.py: no GPU reachable through hip-python and torch")
        return 2
    t0 = time.perf_counter()
    info = runtime.device_info(0)
    results: dict = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
                     "device": dataclasses.asdict(info), "hipmla": __version__, "torch": torch.__version__}
    host_tolerance, device_tolerance = int(a.host_growth_mib * MIB), int(a.device_growth_mib * MIB)
    rig = Rig(a.format, START_LENS, a.steps, np.random.default_rng(a.seed))
    log.progress(f"soak.py on {info.name} ({info.arch}, {info.num_cus} CUs), {a.format} cache, "
                 f"q {rig.dec.config.q_precision}, {a.steps} steps")
    phases = {
        "soak": lambda: soak_phase(rig, a.steps, a.check_every, host_tolerance, device_tolerance, log),
        "concurrency": lambda: concurrency_phase(a.format, a.concurrent_steps, a.seed, log),
        "alloc-failure": lambda: alloc_phase(rig, device_tolerance),
    }
    for name, phase in phases.items():
        try:
            res = phase()
        except Exception as e:  # noqa: BLE001 - a phase that breaks fails, the others still run
            log.progress(traceback.format_exc().rstrip())
            res = {"failures": [f"{type(e).__name__}: {e}"], "line": "raised"}
        results[name] = res
        log.result(f"{name}: {'PASS' if not res['failures'] else 'FAIL'} {res['line']}")
        for f in res["failures"]:
            log.result(f"  {name} FAIL: {f}")
        if a.out is not None:  # after every phase: a run cut short keeps what it measured
            (a.out / "soak.json").write_text(json.dumps(results, indent=1))
    failed = [name for name in phases if results[name]["failures"]]
    results["wall_s"] = time.perf_counter() - t0
    if a.out is not None:
        (a.out / "soak.json").write_text(json.dumps(results, indent=1))
    log.result(f"soak.py: {'FAIL ' + ', '.join(failed) if failed else 'PASS'} "
               f"(soak, concurrency, alloc-failure; {a.format}; {results['wall_s']:.0f} s)")
    rig.dec.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
