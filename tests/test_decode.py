"""The decoder API: argument checks (CPU) and decode on a GPU against the emulator and the
exact reference (``gpu``-marked)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from hipmla import decode
from hipmla.cli import REFERENCE_TOL
from hipmla.emulate import emulate_decode
from hipmla.formats import KV_FORMATS
from hipmla.inputs import benchmark_shapes, make_inputs, random_cache, random_seq_lens
from hipmla.plan import indptr_from_lengths
from hipmla.reference import mla_decode_reference

#: Device vs emulator, bf16 output: |dev - emu| <= EMU_RTOL * |emu| + EMU_ATOL * max|emu|.
#: Two bf16 ulps per element, plus a sliver of the output scale for the rare P that
#: rounds to the other bf16 neighbour because the device sums a dot product in
#: another order.
EMU_RTOL = 2.0 ** -7
EMU_ATOL = 1e-3
#: Device vs emulator LSE (natural log), absolute. The LSE follows its largest scores
#: one for one, and a 576-term f32 dot product summed in another order than the
#: emulator's moves a score by up to a few 1e-4 on these inputs (first H200 run: 2.6e-4
#: and 3.5e-4 on two long ragged batches); the outputs average such shifts away.
EMU_LSE_ATOL = 1e-3


class FakeCAI:
    def __init__(self, shape, typestr, ptr=0x1000, strides=None):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False),
                                         "strides": strides, "version": 3}


# ----------------------------------------------------------------------------- CPU


def test_device_ptr_accepts_raw_addresses_and_interfaces():
    assert decode.device_ptr(0x1234, "q", itemsize=2) == 0x1234
    assert decode.device_ptr(FakeCAI((4, 16, 576), "<u2", 0x2000), "q", itemsize=2,
                             shape=(4, 16, 576)) == 0x2000
    # explicit C-contiguous strides are fine too
    assert decode.device_ptr(FakeCAI((3, 4), "<f4", 0x10, strides=(16, 4)), "lse", itemsize=4,
                             shape=(3, 4), kinds="f") == 0x10


@pytest.mark.parametrize(
    "obj, kwargs, exc, words",
    [
        (0, {}, ValueError, "q: expected a non-null"),
        (-5, {}, ValueError, "non-null"),
        (np.zeros((4, 16, 576), np.uint16), {}, TypeError, "host numpy array"),
        ("0x10", {}, TypeError, "device address"),
        (FakeCAI((4, 16, 576), "<f4"), {}, TypeError, "2-byte"),
        (FakeCAI((4, 16, 576), "<f2"), {}, TypeError, "2-byte raw"),  # IEEE half is not bf16
        (FakeCAI((4, 16, 512), "<u2"), {"shape": (4, 16, 576)}, ValueError, "expected shape"),
        (FakeCAI((4, 16, 576), "<u2", strides=(2, 8, 128)), {"shape": (4, 16, 576)}, ValueError,
         "C-contiguous"),
        (FakeCAI((4, 16, 576), "<u2", ptr=0), {}, ValueError, "null data"),
    ],
)
def test_device_ptr_rejects_bad_buffers(obj, kwargs, exc, words):
    with pytest.raises(exc, match=words):
        decode.device_ptr(obj, "q", itemsize=2, **kwargs)


def test_decoder_config_validates():
    with pytest.raises(ValueError, match="kv_format"):
        decode.DecoderConfig("int4", 0.1)
    with pytest.raises(ValueError, match="q_precision"):
        decode.DecoderConfig("mxfp4", 0.1, q_precision="fp16")
    with pytest.raises(ValueError, match="sm_scale"):
        decode.DecoderConfig("mxfp4", -1.0)
    with pytest.raises(ValueError, match="heads"):
        decode.DecoderConfig("mxfp4", 0.1, heads=32)


def test_fp8_variant_follows_arch():
    assert decode.fp8_variant_for("gfx942") == "e4m3fnuz"
    assert decode.fp8_variant_for("gfx950") == "e4m3fn"
    assert decode.fp8_variant_for("sm_90") == "e4m3fn"


class FakeFunction:
    def __init__(self, symbol):
        self.symbol = symbol
        self.launches = []

    def bind(self, args):
        def launch(grid, block, shared_bytes=0, stream=None):
            self.launches.append((grid, block, args.n_work, args.batch, args.q, args.work, stream))

        return launch


def fake_runtime(monkeypatch, arch: str):
    """Fake the runtime under a Decoder: launches are recorded, nothing touches a GPU."""
    from hipmla import runtime

    info = runtime.DeviceInfo(0, "fake", arch, arch, "amd", 8, 64, 65536, 65536,
                              1 << 34, 1 << 22, 0, 0, 0, 0.0)
    addresses = iter(range(0x10000, 1 << 40, 0x10000))

    class FakeBuffer:
        def __init__(self, nbytes):
            self.ptr, self.nbytes = next(addresses), nbytes

        def free(self):
            self.ptr = 0

    class FakeArray(FakeBuffer):
        @classmethod
        def from_host(cls, arr, stream=None):
            return cls(arr.nbytes)

    functions = {}
    monkeypatch.setattr(runtime, "device_info", lambda index=0: info)
    monkeypatch.setattr(runtime, "use_device", lambda index: None)
    monkeypatch.setattr(runtime, "synchronize", lambda: None)
    monkeypatch.setattr(runtime, "load_kernel",
                        lambda spec, arch: functions.setdefault(spec.symbol, FakeFunction(spec.symbol)))
    monkeypatch.setattr(runtime, "alloc", FakeBuffer)
    monkeypatch.setattr(runtime, "DeviceArray", FakeArray)
    return functions


@pytest.fixture
def host_decoder(monkeypatch):
    """An mxfp4 Decoder on a faked arch without a fast kernel."""
    functions = fake_runtime(monkeypatch, "sm_90")
    dec = decode.Decoder("mxfp4", 1 / 24)
    dec.functions = functions
    return dec


def test_gfx950_routes_whole_tiles_to_the_fast_kernel(monkeypatch):
    functions = fake_runtime(monkeypatch, "gfx950")
    dec = decode.Decoder("mxfp4", 1 / 24)  # q_precision "auto"
    assert dec.config.q_precision == "fp8" and dec._fast is not None
    plan = dec.plan(np.array([1000, 5, 0, 256]))
    n_fast, n_portable = plan.plan.n_fast, plan.plan.n_portable
    assert n_fast > 0 and n_portable > 0
    dec.run(plan, **host_buffers(4, 1261))
    fast = functions[dec._fast.symbol].launches
    portable = functions[dec._split.symbol].launches
    assert [l[0] for l in fast] == [(n_fast, 1, 1)] and fast[0][2] == n_fast
    assert [l[0] for l in portable] == [(n_portable, 1, 1)] and portable[0][2] == n_portable
    # the portable launch reads the work list after the fast items (4 int32 per item)
    assert portable[0][5] == fast[0][5] + 16 * n_fast
    assert functions[dec._combine.symbol].launches[0][0] == (4, 1, 1)
    bf16 = decode.Decoder("mxfp4", 1 / 24, q_precision="bf16")
    assert bf16._fast is None  # no fast kernel for bf16 Q: everything portable


def host_buffers(b, rows):
    return dict(q=FakeCAI((b, 16, 576), "<u2", 0x100000), kv=FakeCAI((rows, 288), "|u1", 0x200000),
                kv_indptr=FakeCAI((b + 1,), "<i4", 0x300000), out=FakeCAI((b, 16, 512), "<u2", 0x400000),
                kv_scale=FakeCAI((rows, 24), "|u1", 0x500000))


def test_run_launches_split_then_combine_only_when_split(host_decoder):
    dec = host_decoder
    split_fn = dec.functions[dec._split.symbol]
    combine_fn = dec.functions[dec._combine.symbol]
    whole = dec.plan(np.array([100, 0, 200]))  # short: one item each, no combine
    bufs = host_buffers(3, 400)
    dec.run(whole, **bufs)
    assert [l[:4] for l in split_fn.launches] == [((3, 1, 1), (256, 1, 1), 3, 3)]
    assert combine_fn.launches == []
    split = dec.plan(np.array([20000, 5]))
    assert split.plan.needs_combine
    bufs = host_buffers(2, 20005)
    dec.run(split, **bufs)
    assert split_fn.launches[-1][0] == (split.plan.n_work, 1, 1)
    assert [l[:4] for l in combine_fn.launches] == [((2, 1, 1), (256, 1, 1), split.plan.n_work, 2)]


def test_run_resolves_arguments_once_per_argument_set(host_decoder, monkeypatch):
    dec = host_decoder
    plan = dec.plan(np.array([100, 300]))
    bufs = host_buffers(2, 400)
    calls = []
    real = dec._prepare
    monkeypatch.setattr(dec, "_prepare", lambda *a: (calls.append(1), real(*a)))
    for _ in range(3):
        dec.run(plan, **bufs)
    assert len(calls) == 1
    assert len(dec.functions[dec._split.symbol].launches) == 3
    other = dict(bufs, out=FakeCAI((2, 16, 512), "<u2", 0x900000))
    dec.run(plan, **other)
    assert len(calls) == 2 and dec.functions[dec._split.symbol].launches[-1][4] == 0x100000
    dec.release(plan)
    with pytest.raises(ValueError, match="plan"):
        dec.run(plan, **other)  # a released plan is never launched from the cache


def test_run_rejects_bad_arguments_before_any_launch(host_decoder):
    dec = host_decoder
    plan = dec.plan(np.array([100, 300]))
    good = host_buffers(2, 400)
    cases = [
        (dict(good, q=FakeCAI((3, 16, 576), "<u2", 0x100000)), ValueError, "q: expected shape"),
        (dict(good, kv_scale=None), ValueError, "kv_scale"),
        (dict(good, kv=FakeCAI((10, 288), "|u1", 0x200000)), ValueError, "kv: the plan"),
        (dict(good, kv_scale=0x500000), ValueError, "kv_scale_stride"),
        (dict(good, q=np.zeros((2, 16, 576), np.uint16)), TypeError, "host numpy"),
        (dict(good, out=FakeCAI((2, 16, 512), "<f4", 0x400000)), TypeError, "out"),
        (dict(good, kv=0x200008), ValueError, "16-byte aligned"),
        (dict(good, fp8_scale=float("nan")), None, None),  # ignored for mxfp4
    ]
    for args, exc, words in cases:
        if exc is None:
            continue
        with pytest.raises(exc, match=words):
            dec.run(plan, **args)
    assert dec.functions[dec._split.symbol].launches == []
    with pytest.raises(ValueError, match="plan"):
        dec.run(object(), **good)


# ----------------------------------------------------------------------------- GPU helpers


def log_errors(what: str, out, lse, emu_out, emu_lse) -> None:
    """Append the measured device-vs-emulator errors to $HIPMLA_TEST_LOG, if set, so a
    GPU run can report the worst case rather than a pass/fail."""
    import os

    path = os.environ.get("HIPMLA_TEST_LOG")
    if not path:
        return
    o, e = np.asarray(out, np.float32), np.asarray(emu_out, np.float32)
    scale = float(np.abs(e).max(initial=0)) or 1.0
    with np.errstate(invalid="ignore"):
        lerr = np.where(np.isneginf(lse) & np.isneginf(emu_lse), 0, np.abs(lse - emu_lse))
    with open(path, "a") as f:
        f.write(f"{what}\tmax_abs {float(np.abs(o - e).max(initial=0)):.3e}\t"
                f"rel_to_scale {float(np.abs(o - e).max(initial=0)) / scale:.3e}\t"
                f"bitexact {float((o == e).mean()) if o.size else 1.0:.5f}\t"
                f"lse {float(lerr.max(initial=0)):.3e}\n")


def assert_close_to_emulator(out, lse, emu_out, emu_lse, what: str):
    log_errors(what, out, lse, emu_out, emu_lse)
    o = np.asarray(out, dtype=np.float32)
    e = np.asarray(emu_out, dtype=np.float32)
    assert np.isfinite(o).all(), f"{what}: non-finite output"
    scale = float(np.abs(e).max(initial=0)) or 1.0
    err = np.abs(o - e)
    bound = EMU_RTOL * np.abs(e) + EMU_ATOL * scale
    bad = err > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.size} outputs off the emulator, "
                           f"worst {float(err.max()):.3e} (scale {scale:.3e})")
    both_inf = np.isneginf(lse) & np.isneginf(emu_lse)
    assert (np.isneginf(lse) == np.isneginf(emu_lse)).all(), f"{what}: LSE -inf pattern differs"
    with np.errstate(invalid="ignore"):  # -inf - -inf where both are empty
        lerr = np.where(both_inf, 0, np.abs(lse - emu_lse))
    assert float(lerr.max(initial=0)) <= EMU_LSE_ATOL, f"{what}: LSE off by {float(lerr.max()):.3e}"


def assert_close_to_reference(out, lse, ref_out, ref_lse, q_precision: str, what: str):
    tol = REFERENCE_TOL[q_precision]
    err = np.abs(np.asarray(out, np.float32) - ref_out)
    assert (err <= tol * (1 + np.abs(ref_out))).all(), f"{what}: worst error vs reference {err.max():.3e}"
    fin = np.isfinite(ref_lse)
    assert (np.isneginf(lse) == ~fin).all(), f"{what}: empty-sequence LSE not -inf"
    assert np.abs(lse[fin] - ref_lse[fin]).max(initial=0) <= tol * 4, f"{what}: LSE far from reference"


@pytest.fixture(scope="module")
def decoders():
    made: dict[tuple[str, str], decode.Decoder] = {}

    def get(kv_format: str, q_precision: str = "bf16", sm_scale: float = 1 / 24) -> decode.Decoder:
        key = (kv_format, q_precision)
        if key not in made:
            made[key] = decode.Decoder(kv_format, sm_scale, q_precision=q_precision)
        return made[key]

    yield get
    for d in made.values():
        d.close()


def sample(batch: int, lens: np.ndarray, k: int = 6) -> np.ndarray:
    """A few sequences to check on the host: spread, the longest, and an empty one."""
    picks = set(np.linspace(0, batch - 1, min(k, batch)).round().astype(int).tolist())
    picks.add(int(np.argmax(lens)))
    empty = np.flatnonzero(lens == 0)
    if empty.size:
        picks.add(int(empty[0]))
    return np.array(sorted(picks))


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", KV_FORMATS)
@pytest.mark.parametrize("shape", benchmark_shapes(), ids=lambda s: s.name)
def test_benchmark_shapes(decoders, kv_format, shape):
    dec = decoders(kv_format)
    inputs = make_inputs(shape.seq_lens, kv_format, seed=shape.batch + shape.kv_len,
                         fp8_variant=dec.fp8_variant)
    out, lse = dec.decode(inputs.q, inputs.kv, inputs.kv_indptr)
    seqs = sample(shape.batch, shape.seq_lens, 4)
    plan = dec.plan(kv_indptr=inputs.kv_indptr)
    emu_out, emu_lse = emulate_decode(inputs.q, inputs.kv, plan.plan, inputs.sm_scale, seqs=seqs)
    dec.release(plan)
    what = f"{kv_format} {shape.name}"
    assert_close_to_emulator(out[seqs], lse[seqs], emu_out, emu_lse, what)
    ref_out, ref_lse = mla_decode_reference(inputs.q, inputs.kv, inputs.kv_indptr, inputs.sm_scale, seqs=seqs)
    assert_close_to_reference(out[seqs], lse[seqs], ref_out, ref_lse, "bf16", what)


@pytest.mark.gpu
@pytest.mark.parametrize("q_precision", ["fp8", "mxfp4"])
def test_quantized_q_matches_its_emulator(decoders, q_precision):
    dec = decoders("mxfp4", q_precision, sm_scale=inputs_scale())
    lens = np.array([1000, 0, 77, 4096, 129])
    inputs = make_inputs(lens, "mxfp4", seed=3)
    out, lse = dec.decode(inputs.q, inputs.kv, inputs.kv_indptr)
    plan = dec.plan(kv_indptr=inputs.kv_indptr)
    emu_out, emu_lse = emulate_decode(inputs.q, inputs.kv, plan.plan, inputs.sm_scale, q_precision=q_precision,
                                      q_fp8_variant=dec.fp8_variant)
    dec.release(plan)
    assert_close_to_emulator(out, lse, emu_out, emu_lse, f"q {q_precision}")


def inputs_scale() -> float:
    from hipmla.inputs import BENCH_SM_SCALE

    return BENCH_SM_SCALE


class RaggedPool:
    """One random cache per format on the device, shared by all ragged configurations."""

    ROWS = 2_000_000

    def __init__(self, dec: decode.Decoder, kv_format: str):
        from hipmla import runtime

        rng = np.random.default_rng(1234)
        self.kv = random_cache(self.ROWS, kv_format, rng, fp8_variant=dec.fp8_variant)
        self.d_kv = runtime.DeviceArray.from_host(self.kv.data)
        self.d_scale = runtime.DeviceArray.from_host(self.kv.scales) if kv_format == "mxfp4" else None

    def free(self):
        self.d_kv.free()
        if self.d_scale is not None:
            self.d_scale.free()


def ragged_configs(n: int = 50) -> list[np.ndarray]:
    rng = np.random.default_rng(2026)
    out = []
    while len(out) < n:
        lens = random_seq_lens(rng)
        if lens.sum() <= RaggedPool.ROWS:
            out.append(lens)
    out[0] = np.zeros(3, np.int64)  # a batch of nothing but empty sequences
    return out


RAGGED_CONFIGS = 50
RAGGED_GROUPS = 5  # separate test items, so a parallel run spreads them over workers
_pools: dict[str, RaggedPool] = {}


def ragged_pool(dec: decode.Decoder, kv_format: str) -> RaggedPool:
    if kv_format not in _pools:
        _pools[kv_format] = RaggedPool(dec, kv_format)
    return _pools[kv_format]


@pytest.mark.gpu
@pytest.mark.parametrize("group", range(RAGGED_GROUPS))
@pytest.mark.parametrize("kv_format", KV_FORMATS)
def test_ragged_batches(decoders, kv_format, group):
    from hipmla import runtime

    dec = decoders(kv_format)
    pool = ragged_pool(dec, kv_format)
    q_rng = np.random.default_rng(7 + group)
    configs = ragged_configs(RAGGED_CONFIGS)
    per_group = RAGGED_CONFIGS // RAGGED_GROUPS
    for i in range(group * per_group, (group + 1) * per_group):
        lens = configs[i]
        b = lens.shape[0]
        indptr = indptr_from_lengths(lens)
        q = q_rng.standard_normal((b, 16, 576), dtype=np.float32).astype(ml_dtypes.bfloat16)
        d_q = runtime.DeviceArray.from_host(q.view(np.uint16))
        d_ind = runtime.DeviceArray.from_host(indptr)
        d_out = runtime.DeviceArray((b, 16, 512), np.uint16)
        d_lse = runtime.DeviceArray((b, 16), np.float32)
        runtime.memset(d_out.ptr, 0xFF, d_out.nbytes)  # NaN poison: every output must be written
        plan = dec.plan(lens)
        dec.run(plan, d_q, pool.d_kv, d_ind, d_out, kv_scale=pool.d_scale, lse=d_lse,
                fp8_scale=pool.kv.fp8_scale if kv_format == "fp8" else None)
        out = d_out.to_host().view(ml_dtypes.bfloat16)
        lse = d_lse.to_host()
        seqs = sample(b, lens)
        emu_out, emu_lse = emulate_decode(q, pool.kv, plan.plan, 1 / 24, seqs=seqs)
        what = f"{kv_format} config {i} (bs {b}, {int(lens.sum())} tokens)"
        assert np.isfinite(out.astype(np.float32)).all(), f"{what}: unwritten or non-finite output"
        assert_close_to_emulator(out[seqs], lse[seqs], emu_out, emu_lse, what)
        ref_out, ref_lse = mla_decode_reference(q, pool.kv, indptr, 1 / 24, seqs=seqs)
        assert_close_to_reference(out[seqs], lse[seqs], ref_out, ref_lse, "bf16", what)
        dec.release(plan)
        for a in (d_q, d_ind, d_out, d_lse):
            a.free()


@pytest.mark.gpu
def test_scratch_is_reused_and_grows_only_when_needed():
    from hipmla import runtime

    with decode.Decoder("mxfp4", 1 / 24) as dec:
        lens_small = np.array([4000, 3000])
        lens_big = np.array([20000, 20000, 1])
        inputs = make_inputs(lens_big, "mxfp4", seed=5)
        d_kv = runtime.DeviceArray.from_host(inputs.kv.data)
        d_sc = runtime.DeviceArray.from_host(inputs.kv.scales)
        d_q = runtime.DeviceArray.from_host(inputs.q.view(np.uint16))
        d_out = runtime.DeviceArray((3, 16, 512), np.uint16)
        d_lse = runtime.DeviceArray((3, 16), np.float32)
        d_ind_big = runtime.DeviceArray.from_host(inputs.kv_indptr)

        p_big = dec.plan(lens_big)
        size = dec.scratch_bytes
        assert size > 0, "a split plan must allocate scratch"
        for _ in range(3):
            dec.run(p_big, d_q, d_kv, d_ind_big, d_out, kv_scale=d_sc, lse=d_lse)
        assert dec.scratch_bytes == size
        p_small = dec.plan(lens_small)
        assert dec.scratch_bytes == size, "a smaller plan must not reallocate"
        runtime.synchronize()
        out = d_out.to_host().view(ml_dtypes.bfloat16)
        lse = d_lse.to_host()
        emu_out, emu_lse = emulate_decode(inputs.q, inputs.kv, p_big.plan, 1 / 24)
        assert_close_to_emulator(out, lse, emu_out, emu_lse, "after repeated runs")
        # a new, different plan between calls on a prefix of the same cache
        small_q = inputs.q[:2].copy()
        d_q2 = runtime.DeviceArray.from_host(small_q.view(np.uint16))
        d_ind_small = runtime.DeviceArray.from_host(indptr_from_lengths(lens_small))
        d_out2 = runtime.DeviceArray((2, 16, 512), np.uint16)
        d_lse2 = runtime.DeviceArray((2, 16), np.float32)
        dec.run(p_small, d_q2, d_kv, d_ind_small, d_out2, kv_scale=d_sc, lse=d_lse2)
        out2 = d_out2.to_host().view(ml_dtypes.bfloat16)

        emu2 = emulate_decode(small_q, inputs.kv, p_small.plan, 1 / 24)
        assert_close_to_emulator(out2, d_lse2.to_host(), *emu2, "new plan")
        for a in (d_kv, d_sc, d_q, d_out, d_lse, d_ind_big, d_q2, d_ind_small, d_out2, d_lse2):
            a.free()
    assert dec.scratch_bytes == 0, "close() must free the scratch"


@pytest.mark.gpu
def test_invalid_arguments_raise_before_launch():
    from hipmla import runtime

    with decode.Decoder("mxfp4", 1 / 24) as dec, decode.Decoder("fp8", 1 / 24) as dec8:
        lens = np.array([100, 200])
        inputs = make_inputs(lens, "mxfp4", seed=9)
        d_kv = runtime.DeviceArray.from_host(inputs.kv.data)
        d_sc = runtime.DeviceArray.from_host(inputs.kv.scales)
        d_q = runtime.DeviceArray.from_host(inputs.q.view(np.uint16))
        d_ind = runtime.DeviceArray.from_host(inputs.kv_indptr)
        d_out = runtime.DeviceArray((2, 16, 512), np.uint16)
        runtime.memset(d_out.ptr, 0xAB, d_out.nbytes)
        runtime.synchronize()
        plan = dec.plan(lens)
        bad_q = runtime.DeviceArray((3, 16, 576), np.uint16)
        short_kv = runtime.DeviceArray((10, 288), np.uint8)
        cases = [
            (lambda: dec.run(plan, bad_q, d_kv, d_ind, d_out, kv_scale=d_sc), ValueError, "q: expected shape"),
            (lambda: dec.run(plan, d_q, d_kv, d_ind, d_out), ValueError, "kv_scale"),
            (lambda: dec.run(plan, d_q, short_kv, d_ind, d_out, kv_scale=d_sc), ValueError, "kv: the plan"),
            (lambda: dec.run(plan, d_q, d_kv, d_ind, d_out, kv_scale=d_sc.ptr), ValueError, "kv_scale_stride"),
            (lambda: dec.run(plan, inputs.q, d_kv, d_ind, d_out, kv_scale=d_sc), TypeError, "host numpy"),
            (lambda: dec8.run(plan, d_q, d_kv, d_ind, d_out), ValueError, "plan"),
            (lambda: dec.run(plan, d_q, d_kv, d_ind, d_out, kv_scale=d_sc, lse=d_out), TypeError, "lse"),
        ]
        for call, exc, words in cases:
            with pytest.raises(exc, match=words):
                call()
        runtime.synchronize()
        assert (d_out.to_host().view(np.uint8) == 0xAB).all(), "a rejected call must launch nothing"
        for a in (d_kv, d_sc, d_q, d_ind, d_out, bad_q, short_kv):
            a.free()


@pytest.mark.gpu
def test_raw_addresses_work_like_interfaces(decoders):
    from hipmla import runtime

    dec = decoders("mxfp4")
    lens = np.array([300, 5000])
    inputs = make_inputs(lens, "mxfp4", seed=11)
    d = [runtime.DeviceArray.from_host(a) for a in
         (inputs.q.view(np.uint16), inputs.kv.data, inputs.kv_indptr, inputs.kv.scales)]
    d_out = runtime.DeviceArray((2, 16, 512), np.uint16)
    plan = dec.plan(lens)
    dec.run(plan, d[0].ptr, d[1].ptr, d[2].ptr, d_out.ptr, kv_scale=d[3].ptr,
            kv_scale_stride=inputs.kv.scales.shape[1])
    out = d_out.to_host().view(ml_dtypes.bfloat16)
    emu_out, _ = emulate_decode(inputs.q, inputs.kv, plan.plan, inputs.sm_scale)
    assert_close_to_emulator(out, np.zeros((2, 16)), emu_out, np.zeros((2, 16)), "raw addresses")
    dec.release(plan)
    for a in d + [d_out]:
        a.free()


def test_device_ptr_checks_alignment():
    with pytest.raises(ValueError, match="16-byte aligned"):
        decode.device_ptr(0x1008, "kv", itemsize=1, align=16)
    with pytest.raises(ValueError, match="q: device address"):
        decode.device_ptr(FakeCAI((1, 16, 576), "<u2", 0x1002), "q", itemsize=2, align=16)
    assert decode.device_ptr(0x1001, "kv_scale", itemsize=1, align=1) == 0x1001


def test_auto_q_precision_is_the_fast_kernels_where_there_is_one():
    assert decode.resolve_q_precision("auto", "gfx950", "mxfp4") == "fp8"
    assert decode.resolve_q_precision("auto", "gfx950", "bf16") == "bf16"
    assert decode.resolve_q_precision("auto", "gfx942", "mxfp4") == "bf16"  # its fast kernel takes bf16 Q
    assert decode.resolve_q_precision("auto", "sm_90", "mxfp4") == "bf16"
    assert decode.resolve_q_precision("mxfp4", "sm_90", "mxfp4") == "mxfp4"
    with pytest.raises(ValueError, match="q_precision"):
        decode.resolve_q_precision("fp16", "gfx950", "mxfp4")


def test_failed_scratch_growth_keeps_the_old_scratch(host_decoder, monkeypatch):
    from hipmla import runtime

    dec = host_decoder
    small = dec.plan(np.array([600, 5]))  # 3 partial slots
    before = dec._scratch.ptr
    assert before and small.plan.n_slots > 0

    def out_of_memory(nbytes):
        raise runtime.HipError(2, "hipErrorOutOfMemory", "out of memory")

    monkeypatch.setattr(runtime, "alloc", out_of_memory)
    with pytest.raises(runtime.HipError):
        dec.plan(np.array([20000, 5]))  # 16 slots: the scratch must grow
    assert dec._scratch.ptr == before  # still allocated, still big enough for `small`
    dec.run(small, **host_buffers(2, 605))
    assert dec.functions[dec._combine.symbol].launches


def test_changing_the_decoders_stream_takes_effect(host_decoder):
    dec = host_decoder
    plan = dec.plan(np.array([100, 300]))
    bufs = host_buffers(2, 400)
    dec.stream = 111
    dec.run(plan, **bufs)
    dec.stream = 222
    dec.run(plan, **bufs)
    dec.run(plan, **bufs, stream=333)
    assert [l[6] for l in dec.functions[dec._split.symbol].launches] == [111, 222, 333]


def test_argument_cache_never_compares_buffers_with_eq(host_decoder):
    class Tensor(FakeCAI):
        def __eq__(self, other):  # like a tensor: elementwise, may raise or launch work
            raise RuntimeError("elementwise == called")

        __hash__ = object.__hash__

    dec = host_decoder
    plan = dec.plan(np.array([100, 300]))
    bufs = host_buffers(2, 400)
    dec.run(plan, **dict(bufs, q=Tensor((2, 16, 576), "<u2", 0x100000)))
    dec.run(plan, **dict(bufs, q=Tensor((2, 16, 576), "<u2", 0x100000)))  # a new object
    assert len(dec.functions[dec._split.symbol].launches) == 2


def test_out_must_be_16_byte_aligned(host_decoder):
    dec = host_decoder
    plan = dec.plan(np.array([100, 300]))
    with pytest.raises(ValueError, match="out: device address .* 16-byte"):
        dec.run(plan, **dict(host_buffers(2, 400), out=FakeCAI((2, 16, 512), "<u2", 0x400008)))
