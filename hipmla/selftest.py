"""Known-answer checks of a decode kernel: it serves only after it reproduced the emulator.

A decoder whose kernel is not the portable one (``hip_src/decode/split.hip``, the trusted
fallback) — an AMD fast kernel, the sm_90 tensor-core kernel — first runs a small known
case through that kernel on its device and compares the result with the emulator's model
of exactly that kernel (:meth:`hipmla.decode.Decoder.emulate`), within the bounds the GPU
tests hold every kernel to. The case (:func:`known_case`) is ragged — an empty sequence,
lengths that leave partial tiles, sequences long enough to be split and merged — and
paged (16 rows a page, pages shuffled, one shared), in the cache format the kernel reads.

The verdict is kept on disk per (arch, code object) under the kernel cache
(``<cache_dir>/selftest``, see :func:`hipmla.runtime.cache_dir`), so a later process
reads it instead of running the case again, and in memory per (kernel, arch), so a
process checks a kernel once. A kernel that fails makes the decoder take the portable
kernel for the same cache format and Q, with one :class:`KernelSelfTestWarning` (and a
record on the ``hipmla`` logger) naming the kernel and what went wrong. A kernel that
cannot be built, loaded or launched fails too, but that verdict is not stored: it says
nothing about the code object's numbers, and the next process tries again.

``HIPMLA_SELFTEST=0`` (or ``Decoder(..., selftest=False)``) skips the check;
``python -m hipmla selftest`` runs every check of the device and prints a table.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from hipmla import kernels, runtime
from hipmla.inputs import DecodeInputs, random_cache
from hipmla.paging import random_page_table
from hipmla.reference import D_QK, HEADS

#: Device vs emulator, bf16 output: |dev - emu| <= EMU_RTOL * |emu| + EMU_ATOL * max|emu|.
#: Two bf16 ulps per element, plus a sliver of the output scale for the rare P that
#: rounds to the other bf16 neighbour because the device sums a dot product in
#: another order.
EMU_RTOL = 2.0 ** -7
EMU_ATOL = 1e-3
#: Device vs emulator LSE (natural log), absolute. The LSE follows its largest scores
#: one for one, and a 576-term f32 dot product summed in another order than the
#: emulator's moves a score by up to a few 1e-4 (H200, 2026-11-30: 3.5e-4 worst). On top
#: of that, the rare P that rounds to the other bf16 neighbour (as in EMU_ATOL) moves l by
#: one bf16 ulp of a P <= 1, at most 2^-8, and l >= 1 (the row's largest score has P = 1),
#: so ln l by at most 2^-8. Measured (H100, 2026-12-06, 64 and 128 heads, several query
#: tokens, mxfp4): one LSE in 2,496 off by 1.20e-3 (the 64-head kernel) and one in 4,992
#: by 9.2e-4 (the 16-head sm_90 kernel), where the emulator itself is 1.2-1.4e-3 from
#: float64 attention; every other LSE within 1e-4. (1e-3 until then.)
EMU_LSE_ATOL = 2.0 ** -8

#: Sequence lengths of the known case: empty, one token, partial 32/64/128-token tiles,
#: and two sequences the device schedule splits (its items are at least 256 tokens), so
#: the partials and the in-kernel merge run too.
CASE_LENS = (0, 1, 33, 100, 300, 700)
CASE_PAGE_SIZE = 16
CASE_SEED = 11
CASE_SM_SCALE = 1 / 24
#: Bumped when the case or the bounds change: verdicts of another version are run again.
#: 3: a kernel of several 16-head rows an item also runs a case of 16 heads x query tokens.
#: 4: a kernel of 16-head rows also runs 8 heads x 4 query tokens (two tokens a row).
VERSION = 4
#: The test-only define of the sm_90 kernels (split_sm90.hip, split_sm90_rows64.hip) that makes them wrong.
BREAK_DEFINE = "HIPMLA_SELFTEST_BREAK"

log = logging.getLogger("hipmla")


class KernelSelfTestWarning(RuntimeWarning):
    """A kernel failed its known-answer check; the decoder runs the portable kernel."""


@dataclass(frozen=True)
class Comparison:
    """Device output and LSE against the emulator's."""

    worst_error: float  # max |device - emulator| over the outputs, over max |emulator|
    lse_error: float  # max |device - emulator| LSE (natural log)
    failure: str  # what is beyond its bound; "" when nothing is

    @property
    def passed(self) -> bool:
        return not self.failure


@dataclass(frozen=True)
class Verdict:
    """What one kernel's known-answer check found on one arch."""

    symbol: str
    arch: str
    code_hash: str
    kv_format: str
    q_precision: str
    passed: bool
    worst_error: float  # as Comparison's; inf where the kernel did not run to a result
    lse_error: float
    message: str
    cached: bool = False  # read from disk rather than run in this process

    def to_json(self) -> dict:
        """The fields as JSON values (inf errors as null)."""
        d = dataclasses.asdict(self)
        for name in ("worst_error", "lse_error"):
            d[name] = d[name] if math.isfinite(d[name]) else None
        return d

    @classmethod
    def from_json(cls, d: dict) -> Verdict:
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in d.items() if k in fields}
        for name in ("worst_error", "lse_error"):
            values[name] = math.inf if values[name] is None else float(values[name])
        return cls(**values)


# ----------------------------------------------------------------------------- the case


def known_case(kv_format: str, fp8_variant: str = "e4m3fn", heads: int = HEADS, q_len: int = 1) -> DecodeInputs:
    """The known case in ``kv_format``: :data:`CASE_LENS` over a pool of shuffled
    16-row pages with spare pages between them and one first page shared by two
    sequences; random cache codes (:func:`hipmla.inputs.random_cache`: every code but
    NaN), N(0,1) Q of ``heads`` heads (a kernel's ``row_heads``). ``q_len`` > 1: sequence i
    has min(len_i, q_len - i % 2) query tokens (causal; ragged: 0, 1, q_len and q_len - 1
    with CASE_LENS), given by ``qo_indptr``. A pure function of its arguments."""
    rng = np.random.default_rng(CASE_SEED)
    lens = np.array(CASE_LENS)
    layout = random_page_table(lens, CASE_PAGE_SIZE, rng, spare_pages=5, shared=1)
    rows = (int(layout.kv_indices.max()) + 1) * CASE_PAGE_SIZE
    kv = random_cache(rows, kv_format, rng, fp8_variant=fp8_variant, scale_stride=24)
    if q_len == 1:
        q = rng.standard_normal((lens.shape[0], heads, D_QK), dtype=np.float32).astype(ml_dtypes.bfloat16)
        return DecodeInputs(q=q, kv=kv, layout=layout, sm_scale=CASE_SM_SCALE)
    q_lens = np.minimum(lens, q_len - np.arange(lens.shape[0]) % 2)
    qo = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((int(qo[-1]), heads, D_QK), dtype=np.float32).astype(ml_dtypes.bfloat16)
    return DecodeInputs(q=q, kv=kv, layout=layout, sm_scale=CASE_SM_SCALE, qo_indptr=qo)


def compare(out, lse, emu_out, emu_lse) -> Comparison:
    """Device output ``(b, h, 512)`` and LSE ``(b, h)`` against the emulator's, with the
    bounds :data:`EMU_RTOL`, :data:`EMU_ATOL`, :data:`EMU_LSE_ATOL`. NaN counts as
    infinitely wrong; an LSE of -inf (empty sequence) must be -inf on both sides."""
    o = np.asarray(out, dtype=np.float32)
    e = np.asarray(emu_out, dtype=np.float32)
    scale = float(np.abs(e).max(initial=0)) or 1.0
    with np.errstate(invalid="ignore"):
        err = np.nan_to_num(np.abs(o - e), nan=np.inf)
    bad = ~(err <= EMU_RTOL * np.abs(e) + EMU_ATOL * scale)
    worst = float(err.max(initial=0))
    lse, emu_lse = np.asarray(lse, np.float64), np.asarray(emu_lse, np.float64)
    pattern = np.isneginf(lse) != np.isneginf(emu_lse)
    with np.errstate(invalid="ignore"):  # -inf - -inf where both are empty
        lerr = np.nan_to_num(np.where(np.isneginf(lse) & np.isneginf(emu_lse), 0, np.abs(lse - emu_lse)),
                             nan=np.inf)
    lse_worst = float(lerr.max(initial=0))
    failures = []
    if bad.any():
        failures.append(f"{int(bad.sum())} of {bad.size} outputs off the emulator by more than "
                        f"2^-7 |emu| + {EMU_ATOL:g} x scale, worst {worst:.3e} (scale {scale:.3e})")
    if pattern.any():
        failures.append(f"LSE is -inf (empty sequence) on one side only at {int(pattern.sum())} of "
                        f"{pattern.size} heads")
    if not lse_worst <= EMU_LSE_ATOL:
        failures.append(f"LSE off the emulator by {lse_worst:.3e} (bound {EMU_LSE_ATOL:g})")
    return Comparison(worst / scale, lse_worst, "; ".join(failures))


def case_shapes(spec: kernels.KernelSpec) -> list[tuple[int, int]]:
    """(heads, q_len) of the cases ``spec`` runs: its ``row_heads`` heads, and a second case
    whose rows hold several query tokens, each with its own causal bound: for a kernel of
    several 16-head rows an item 16 heads x row_heads / 16 query tokens, for a kernel of
    16-head rows 8 heads x 4 (two query tokens a row, ragged: 4 and 3 a sequence)."""
    if spec.row_heads > HEADS:
        return [(spec.row_heads, 1), (HEADS, spec.row_heads // HEADS)]
    return [(HEADS, 1), (HEADS // 2, 4)]


def run_case(spec: kernels.KernelSpec, device: int = 0) -> Comparison:
    """The known case(s) through ``spec`` on ``device`` (a decoder of its own, with its own
    scratch, that launches exactly this kernel), against that kernel's emulator: the first
    failure, else the worst errors."""
    from hipmla.decode import Decoder, DeviceInputError, fp8_variant_for  # decode imports this module

    kv_format, q_precision = kernels.variant_of(spec)
    worst = Comparison(0.0, 0.0, "")
    for heads, q_len in case_shapes(spec):
        case = known_case(kv_format, fp8_variant_for(runtime.device_info(device).arch), heads, q_len)
        t_q = case.q.shape[0]
        with Decoder(kv_format, case.sm_scale, q_precision=q_precision, device=device, kernel=spec,
                     selftest=False, max_batch=case.batch, max_q_tokens=t_q, heads=heads) as dec:
            try:
                out, lse = dec.decode(case.q, case.kv, case.layout, case.qo_indptr)  # checks the error word
            except DeviceInputError as e:
                return Comparison(math.inf, math.inf, f"the kernel refused the valid input: {e}")
            emu_out, emu_lse = dec.emulate(case.q, case.kv, case.layout, qo_indptr=case.qo_indptr)
        result = compare(out, lse, emu_out, emu_lse)
        if not result.passed:
            where = "" if q_len == 1 else f"{heads} heads x {q_len} query tokens: "
            return dataclasses.replace(result, failure=where + result.failure)
        worst = Comparison(max(worst.worst_error, result.worst_error), max(worst.lse_error, result.lse_error), "")
    return worst


# ----------------------------------------------------------------------------- verdicts


def code_hash(spec: kernels.KernelSpec, arch: str) -> str:
    """sha256 naming the code object ``runtime.load_kernel(spec, arch)`` loads: of its
    bytes where an ahead-of-time build has it, else of what hiprtc compiles it from
    (the translation unit, the options, the arch, the compiler and the platform: the
    compile cache's key) and the symbol."""
    from hipmla.aot import find_prebuilt

    source = kernels.translation_unit(spec.source)
    options = spec.options(arch)
    code = find_prebuilt(spec, arch, source, options)
    if code is not None:
        return hashlib.sha256(code).hexdigest()
    material = json.dumps([spec.symbol, runtime.cache_key(source, options, arch)])
    return hashlib.sha256(material.encode()).hexdigest()


def verdict_dir() -> Path | None:
    """Where verdicts are kept: ``selftest/`` of the kernel cache, or None when that
    cache is off (``HIPMLA_CACHE=0``: then every process checks again)."""
    directory = runtime.cache_dir()
    return None if directory is None else directory / "selftest"


def verdict_path(spec: kernels.KernelSpec, arch: str, digest: str) -> Path | None:
    directory = verdict_dir()
    if directory is None:
        return None
    return directory / (re.sub(r"[^A-Za-z0-9_.-]", "_", f"{spec.symbol}-{arch}")[:80] + f"-{digest[:40]}.json")


def _read(path: Path, spec: kernels.KernelSpec, arch: str, digest: str) -> Verdict | None:
    """The stored verdict of exactly this code object and version, or None."""
    try:
        data = json.loads(path.read_text())
        verdict = Verdict.from_json(data)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None  # none yet, or unreadable: the check runs and rewrites it
    if data.get("version") != VERSION or (verdict.symbol, verdict.arch, verdict.code_hash) != \
            (spec.symbol, arch, digest):
        return None
    return dataclasses.replace(verdict, cached=True)


def check_kernel(spec: kernels.KernelSpec, device: int = 0, *, use_cache: bool = True) -> Verdict:
    """The verdict on ``spec`` on ``device``: the stored one for its code object when
    ``use_cache`` and there is one, else the known case is run (and its verdict stored,
    when the kernel ran to a result)."""
    arch = runtime.device_info(device).arch
    if not spec.builds_for(arch):
        raise ValueError(f"spec: {spec.symbol} builds for {', '.join(spec.archs)}, not {arch}")
    digest = code_hash(spec, arch)
    path = verdict_path(spec, arch, digest)
    if use_cache and path is not None:
        stored = _read(path, spec, arch, digest)
        if stored is not None:
            return stored
    kv_format, q_precision = kernels.variant_of(spec)
    made = dict(symbol=spec.symbol, arch=arch, code_hash=digest, kv_format=kv_format, q_precision=q_precision)
    try:
        result = run_case(spec, device)
    except Exception as e:  # noqa: BLE001 - whatever stops the kernel is its verdict
        text = " ".join(str(e).split()) or "no message"
        return Verdict(**made, passed=False, worst_error=math.inf, lse_error=math.inf,
                       message=f"{type(e).__name__}: {text[:300]}")
    lens = "/".join(map(str, CASE_LENS))
    message = result.failure or (f"{lens} tokens, pages of {CASE_PAGE_SIZE}: output within "
                                 f"{result.worst_error:.1e} of its scale, LSE within {result.lse_error:.1e}")
    verdict = Verdict(**made, passed=result.passed, worst_error=result.worst_error,
                      lse_error=result.lse_error, message=message)
    if path is not None:
        runtime.compiler._store(path, json.dumps({"version": VERSION, **verdict.to_json()}, indent=1).encode())
    return verdict


# ----------------------------------------------------------------------------- the decoder's gate

_lock = threading.Lock()  # one check per kernel, and one warning, when threads build decoders at once
_seen: dict[tuple[kernels.KernelSpec, str], Verdict] = {}


def enabled(requested: bool | None = None) -> bool:
    """Whether decoders check their kernel: ``requested`` when given, else unless
    ``HIPMLA_SELFTEST=0``."""
    if requested is not None:
        if not isinstance(requested, bool):
            raise TypeError(f"selftest: expected True, False or None, got {requested!r}")
        return requested
    return os.environ.get("HIPMLA_SELFTEST", "1").strip() != "0"


def trusted_kernel(spec: kernels.KernelSpec, device: runtime.DeviceInfo, *,
                   requested: bool | None = None) -> kernels.KernelSpec:
    """The kernel a decoder on ``device`` runs when it chose ``spec``: ``spec`` itself if
    it is the portable kernel, if checks are off (:func:`enabled`) or if it passed its
    check (run at most once per process); else the portable kernel for the same cache
    format and Q, after one warning."""
    if not enabled(requested) or spec.source == kernels.SPLIT_SOURCE:
        return spec
    key = (spec, device.arch)
    with _lock:
        verdict = _seen.get(key)
        if verdict is None:
            verdict = _seen[key] = check_kernel(spec, device.index)
            if verdict.passed:
                log.debug("kernel %s passed its self-test on %s (%s%s)", spec.symbol, device.arch,
                          verdict.message, ", stored verdict" if verdict.cached else "")
            else:
                portable = kernels.split_kernel(verdict.kv_format, verdict.q_precision)
                text = (f"kernel {spec.symbol} failed its known-answer self-test on {device.arch}"
                        f"{' (stored verdict)' if verdict.cached else ''}: {verdict.message}; decoding "
                        f"with the portable kernel {portable.symbol} instead (`python -m hipmla selftest` "
                        f"lists every verdict)")
                log.warning("%s", text)
                warnings.warn(f"hipmla: {text}", KernelSelfTestWarning, stacklevel=3)
    return spec if verdict.passed else kernels.split_kernel(verdict.kv_format, verdict.q_precision)


def verdict_of(spec: kernels.KernelSpec, arch: str) -> Verdict | None:
    """The verdict this process's decoders went by for ``spec`` on ``arch``, if any."""
    return _seen.get((spec, arch))


def forget() -> None:
    """Drop this process's verdicts: the next decoder reads or runs its check again."""
    with _lock:
        _seen.clear()


def broken(spec: kernels.KernelSpec) -> kernels.KernelSpec:
    """``spec`` built with :data:`BREAK_DEFINE`: an sm_90 kernel then scales its
    output by 1.5, wrong on purpose — the proof that a wrong build fails its check and
    its decoder falls back."""
    if spec.source not in (kernels.SM90_SOURCE, kernels.SM90_ROWS64_SOURCE):
        raise ValueError(f"spec: only {kernels.SM90_SOURCE} and {kernels.SM90_ROWS64_SOURCE} have the "
                         f"{BREAK_DEFINE} build, not {spec.source} ({spec.symbol})")
    return dataclasses.replace(spec, defines=spec.defines + ((BREAK_DEFINE, "1"),))


def device_plan(arch: str, formats: tuple[str, ...]) -> list[tuple[kernels.KernelSpec, str]]:
    """What ``python -m hipmla selftest`` checks on ``arch``, as ``(spec, role)``: every
    kernel but the portable one that a decoder picks for these cache formats, whatever
    its Q precision (role ``decoder``), then per format the portable kernel with the Q
    ``q_precision="auto"`` picks (role ``portable``, the fallback's reference line)."""
    from hipmla.decode import resolve_q_precision

    plan: list[tuple[kernels.KernelSpec, str]] = []
    for kv_format in formats:
        for q_precision in kernels.Q_PRECISIONS:
            for heads in (HEADS, kernels.SM90_ROWS64_HEADS):
                spec = kernels.decoder_kernel(arch, kv_format, q_precision, heads)
                if spec.source != kernels.SPLIT_SOURCE and (spec, "decoder") not in plan:
                    plan.append((spec, "decoder"))
    for kv_format in formats:
        plan.append((kernels.split_kernel(kv_format, resolve_q_precision("auto", arch, kv_format)), "portable"))
    return plan
