"""The decoder on a GPU (``gpu``-marked): against the emulator (tightly) and the exact
reference (loosely), contiguous and paged caches, graph capture and replay over changing
steps, and no allocation or synchronization inside a step."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest

from hipmla import decode
from hipmla.cli import REFERENCE_TOL
from hipmla.formats import KV_FORMATS
from hipmla.inputs import benchmark_shapes, make_inputs, random_cache, random_seq_lens, spread_sample
from hipmla.paging import KvLayout, gather, random_page_table, take_rows
from hipmla.reference import mla_decode_reference
# Device vs emulator: the bounds every kernel's known-answer check holds it to too.
from hipmla.selftest import EMU_ATOL, EMU_LSE_ATOL, EMU_RTOL

pytestmark = pytest.mark.gpu

SM_SCALE = 1 / 24


def log_errors(what: str, out, lse, emu_out, emu_lse) -> None:
    """Append the measured device-vs-emulator errors to $HIPMLA_TEST_LOG, if set, so a
    GPU run can report the worst case rather than a pass/fail."""
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
    bad = err > EMU_RTOL * np.abs(e) + EMU_ATOL * scale
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.size} outputs off the emulator, "
                           f"worst {float(err.max()):.3e} (scale {scale:.3e})")
    assert (np.isneginf(lse) == np.isneginf(emu_lse)).all(), f"{what}: LSE -inf pattern differs"
    with np.errstate(invalid="ignore"):  # -inf - -inf where both are empty
        lerr = np.where(np.isneginf(lse) & np.isneginf(emu_lse), 0, np.abs(lse - emu_lse))
    assert float(lerr.max(initial=0)) <= EMU_LSE_ATOL, f"{what}: LSE off by {float(lerr.max()):.3e}"


def assert_close_to_reference(out, lse, ref_out, ref_lse, ref_mag, what: str, q_precision: str = "bf16"):
    """Within REFERENCE_TOL of exact attention, relative to 1 + sum p|v| / l (``ref_mag``,
    mla_decode_reference(magnitude=True): the scale of P's rounding error)."""
    tol = REFERENCE_TOL[q_precision]
    err = np.abs(np.asarray(out, np.float32) - ref_out)
    assert (err <= tol * (1 + ref_mag)).all(), f"{what}: worst error vs reference {err.max():.3e}"
    fin = np.isfinite(ref_lse)
    assert (np.isneginf(lse) == ~fin).all(), f"{what}: empty-sequence LSE not -inf"
    assert np.abs(lse[fin] - ref_lse[fin]).max(initial=0) <= tol * 4, f"{what}: LSE far from reference"


@pytest.fixture(scope="module")
def decoders():
    made: dict[tuple[str, str], decode.Decoder] = {}

    def get(kv_format: str, q_precision: str = "bf16", sm_scale: float = SM_SCALE) -> decode.Decoder:
        key = (kv_format, q_precision, sm_scale)
        if key not in made:
            made[key] = decode.Decoder(kv_format, sm_scale, q_precision=q_precision)
        return made[key]

    yield get
    for d in made.values():
        d.close()


def check(dec: decode.Decoder, out, lse, q, kv, layout, seqs, what: str):
    """Against the decoder's own emulator (tightly) and exact attention (loosely)."""
    emu_out, emu_lse = dec.emulate(q, kv, layout, seqs=seqs)
    assert_close_to_emulator(out[seqs], lse[seqs], emu_out, emu_lse, what)
    ref_out, ref_lse, ref_mag = mla_decode_reference(q, kv, layout, dec.config.sm_scale, seqs=seqs, magnitude=True)
    assert_close_to_reference(out[seqs], lse[seqs], ref_out, ref_lse, ref_mag, what, dec.config.q_precision)


# ----------------------------------------------------------------------------- shapes


@pytest.mark.parametrize("kv_format", KV_FORMATS)
@pytest.mark.parametrize("shape", benchmark_shapes(), ids=lambda s: s.name)
def test_benchmark_shapes(decoders, kv_format, shape):
    dec = decoders(kv_format)
    inputs = make_inputs(shape.seq_lens, kv_format, seed=shape.batch + shape.kv_len,
                         fp8_variant=dec.fp8_variant, sm_scale=SM_SCALE)
    out, lse = dec.decode(inputs.q, inputs.kv, inputs.layout)
    check(dec, out, lse, inputs.q, inputs.kv, inputs.layout, spread_sample(inputs.seq_lens, 4),
          f"{kv_format} {shape.name}")


@pytest.mark.parametrize("q_precision", ["fp8", "mxfp4"])
def test_quantized_q_matches_its_emulator(decoders, q_precision):
    dec = decoders("mxfp4", q_precision)
    lens = np.array([1000, 0, 77, 4096, 129])
    inputs = make_inputs(lens, "mxfp4", seed=3, sm_scale=SM_SCALE)
    out, lse = dec.decode(inputs.q, inputs.kv, inputs.layout)
    emu_out, emu_lse = dec.emulate(inputs.q, inputs.kv, inputs.layout)
    assert_close_to_emulator(out, lse, emu_out, emu_lse, f"q {q_precision}")


# ----------------------------------------------------------------------------- ragged, paged

RAGGED_CONFIGS = 36
RAGGED_GROUPS = 6  # separate test items, so a parallel run spreads them over workers
PAGE_SIZES = (1, 16, 64)


def ragged_configs() -> list[np.ndarray]:
    rng = np.random.default_rng(2026)
    out = [random_seq_lens(rng, max_batch=300, max_len=20000) for _ in range(RAGGED_CONFIGS)]
    out[0] = np.zeros(3, np.int64)  # a batch of nothing but empty sequences
    out[1] = np.array([1, 0, 127, 128, 129, 16383, 64, 65])  # around every tile edge
    return out


@pytest.mark.parametrize("group", range(RAGGED_GROUPS))
@pytest.mark.parametrize("kv_format", KV_FORMATS)
def test_paged_ragged_batches(decoders, kv_format, group):
    """Random page order, shared prefix pages, spare pages in the pool, page sizes 1/16/64,
    ragged lengths with empty sequences: the paged step and the same tokens laid out
    contiguously give the same bits, and both match the emulator and the reference."""
    from hipmla import runtime

    dec = decoders(kv_format)
    per_group = RAGGED_CONFIGS // RAGGED_GROUPS
    for i in range(group * per_group, (group + 1) * per_group):
        rng = np.random.default_rng([7, i])
        lens = ragged_configs()[i]
        b = lens.shape[0]
        dec.reserve(b)
        page_size = PAGE_SIZES[i % len(PAGE_SIZES)]
        layout = random_page_table(lens, page_size, rng, spare_pages=17, shared=3)
        pool_rows = (int(layout.kv_indices.max(initial=0)) + 1) * page_size
        pool = random_cache(pool_rows, kv_format, rng, fp8_variant=dec.fp8_variant, scale_stride=24)
        contiguous_kv, contiguous = gather(pool, layout)
        q = rng.standard_normal((b, 16, 576), dtype=np.float32).astype(ml_dtypes.bfloat16)
        results = []
        for kv, lay in ((pool, layout), (contiguous_kv, contiguous)):
            host = {"q": q.view(np.uint16), "kv": kv.data, "kv_indptr": lay.kv_indptr}
            if lay.paged:
                host |= {"kv_indices": lay.kv_indices, "kv_last_page_len": lay.kv_last_page_len}
            if kv.scales is not None:
                host["kv_scale"] = kv.scales
            dev = {k: runtime.DeviceArray.from_host(np.ascontiguousarray(v)) for k, v in host.items()}
            d_out = runtime.DeviceArray((b, 16, 512), np.uint16)
            d_lse = runtime.DeviceArray((b, 16), np.float32)
            runtime.memset(d_out.ptr, 0xFF, d_out.nbytes)  # NaN poison: every output must be written
            runtime.memset(d_lse.ptr, 0xFF, d_lse.nbytes)
            dec.run(out=d_out, lse=d_lse, page_size=lay.page_size,
                    fp8_scale=kv.fp8_scale if kv_format == "fp8" else None, **dev)
            results.append((d_out.to_host(), d_lse.to_host()))
            for a in list(dev.values()) + [d_out, d_lse]:
                a.free()
        (out_p, lse_p), (out_c, lse_c) = results
        what = f"{kv_format} config {i} (bs {b}, {int(lens.sum())} tokens, page {page_size})"
        assert np.array_equal(out_p, out_c), f"{what}: paged and contiguous outputs differ"
        assert np.array_equal(lse_p.view(np.uint32), lse_c.view(np.uint32)), f"{what}: LSE differs"
        out = out_p.view(ml_dtypes.bfloat16)
        assert np.isfinite(out.astype(np.float32)).all(), f"{what}: unwritten or non-finite output"
        check(dec, out, lse_p, q, pool, layout, spread_sample(lens), what)


def fit_cases() -> dict[str, np.ndarray]:
    from hipmla.bench import ragged_mixes

    return {"rag64": ragged_mixes()["rag64"], "long+short": ragged_mixes()["long+short"],
            "40x5000+short": np.array([5000] * 40 + [3, 0, 17, 129])}


@pytest.mark.parametrize("case", list(fit_cases()))
@pytest.mark.parametrize("kv_format", KV_FORMATS)
def test_the_fit_matches_its_emulator(kv_format, case):
    """Decoder(fit=True) on ragged batches whose usual split gives more items than slots
    (so the fit's longer chunk runs: the host schedule says so), on a paged cache: the
    device's schedule must be the host model's, bit for bit, or the merged splits differ
    from the emulator's."""
    from hipmla import runtime
    from hipmla.schedule import schedule

    dec = decode.Decoder(kv_format, SM_SCALE, fit=True)
    try:
        lens = fit_cases()[case]
        b = lens.shape[0]
        assert schedule(lens, dec.policy).fit > 0, f"{case}: the fit does not run on this device"
        dec.reserve(b)
        rng = np.random.default_rng([11, b])
        layout = random_page_table(lens, 16, rng, spare_pages=5, shared=0)
        pool = random_cache((int(layout.kv_indices.max(initial=0)) + 1) * 16, kv_format, rng,
                            fp8_variant=dec.fp8_variant)
        q = rng.standard_normal((b, 16, 576), dtype=np.float32).astype(ml_dtypes.bfloat16)
        host = {"q": q.view(np.uint16), "kv": pool.data, "kv_indptr": layout.kv_indptr,
                "kv_indices": layout.kv_indices, "kv_last_page_len": layout.kv_last_page_len}
        if pool.scales is not None:
            host["kv_scale"] = pool.scales
        dev = {k: runtime.DeviceArray.from_host(np.ascontiguousarray(v)) for k, v in host.items()}
        d_out = runtime.DeviceArray((b, 16, 512), np.uint16)
        d_lse = runtime.DeviceArray((b, 16), np.float32)
        runtime.memset(d_out.ptr, 0xFF, d_out.nbytes)
        runtime.memset(d_lse.ptr, 0xFF, d_lse.nbytes)
        dec.run(out=d_out, lse=d_lse, page_size=16, fp8_scale=pool.fp8_scale if kv_format == "fp8" else None, **dev)
        out, lse = d_out.to_host().view(ml_dtypes.bfloat16), d_lse.to_host()
        for a in list(dev.values()) + [d_out, d_lse]:
            a.free()
        assert np.isfinite(out.astype(np.float32)).all(), f"{case}: unwritten or non-finite output"
        check(dec, out, lse, q, pool, layout, spread_sample(lens), f"{kv_format} {case} with the fit")
    finally:
        dec.close()


# ----------------------------------------------------------------------------- serving


class CountingHip:
    """hip-python's module with every allocation, copy and synchronization counted."""

    WATCHED = ("hipMalloc", "hipFree", "hipMemcpy", "hipMemcpyAsync", "hipMemsetAsync", "hipMemset",
               "hipDeviceSynchronize", "hipStreamSynchronize", "hipEventSynchronize", "hipModuleLaunchKernel")

    def __init__(self, hip):
        self._hip = hip
        self.calls: dict[str, int] = {}

    def __getattr__(self, name):
        real = getattr(self._hip, name)
        if name not in self.WATCHED:
            return real

        def counted(*a, **k):
            self.calls[name] = self.calls.get(name, 0) + 1
            return real(*a, **k)

        return counted


def test_steps_allocate_copy_and_synchronize_nothing(decoders, monkeypatch):
    """100 steps through new views of the same buffers, with changing lengths, make no
    allocation, copy or synchronization call and no hip-python launch (launches go
    through the ctypes binding)."""
    torch = pytest.importorskip("torch")
    from hipmla import runtime

    dec = decoders("mxfp4")
    b, pages, page_size = 8, 600, 16
    rng = np.random.default_rng(5)
    pool = random_cache(pages * page_size, "mxfp4", rng, scale_stride=24)
    kv = torch.from_numpy(pool.data).cuda()
    sc = torch.from_numpy(pool.scales).cuda()
    q = torch.randn(b, 16, 576, device="cuda").to(torch.bfloat16)
    out = torch.empty(b, 16, 512, device="cuda", dtype=torch.bfloat16)
    indptr = torch.zeros(b + 1, dtype=torch.int32, device="cuda")
    indices = torch.from_numpy(rng.permutation(pages).astype(np.int32)).cuda()
    last = torch.ones(b, dtype=torch.int32, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    counting = CountingHip(runtime.hip)
    dec.run(q.view(torch.int16), kv, indptr, out.view(torch.int16), kv_indices=indices,
            kv_last_page_len=last, page_size=page_size, kv_scale=sc, stream=stream)
    monkeypatch.setattr(runtime, "hip", counting)
    for step in range(100):
        lens = rng.integers(0, 70 * page_size, size=b)
        layout = random_page_table(lens, page_size, rng)
        indptr.copy_(torch.from_numpy(layout.kv_indptr))  # the caller's own step work
        last.copy_(torch.from_numpy(layout.kv_last_page_len))
        dec.run(q.view(torch.int16), kv, indptr, out.view(torch.int16), kv_indices=indices,
                kv_last_page_len=last, page_size=page_size, kv_scale=sc, stream=stream)
    monkeypatch.undo()
    torch.cuda.synchronize()
    assert counting.calls == {}, f"a step called {counting.calls}"


def test_one_captured_graph_serves_fifty_changing_steps(decoders):
    """Capture one paged step into a CUDA graph, then replay it for 50 steps whose lengths
    grow by one token and whose page tables change (new pages appended, pages moved):
    every replay is bit-identical to an eager run of the same step, and within tolerance
    of the reference."""
    torch = pytest.importorskip("torch")

    dec = decoders("mxfp4")
    b, page_size, pool_pages = 12, 16, 4096
    rng = np.random.default_rng(50)
    pool = random_cache(pool_pages * page_size, "mxfp4", rng, scale_stride=24)
    kv = torch.from_numpy(pool.data).cuda()
    sc = torch.from_numpy(pool.scales).cuda()
    qh = rng.standard_normal((b, 16, 576), dtype=np.float32).astype(ml_dtypes.bfloat16)
    q = torch.from_numpy(qh.view(np.uint16).astype(np.int16)).cuda()
    max_pages = pool_pages
    indptr = torch.zeros(b + 1, dtype=torch.int32, device="cuda")
    indices = torch.zeros(max_pages, dtype=torch.int32, device="cuda")
    last = torch.ones(b, dtype=torch.int32, device="cuda")
    out_graph = torch.empty(b, 16, 512, dtype=torch.int16, device="cuda")
    lse_graph = torch.empty(b, 16, dtype=torch.float32, device="cuda")
    out_eager = torch.empty_like(out_graph)
    lse_eager = torch.empty_like(lse_graph)

    lens = rng.integers(0, 3000, size=b)
    lens[3] = 0  # an empty sequence that starts to grow
    owned = [list(rng.choice(pool_pages, size=-(-int(n) // page_size), replace=False)) for n in lens]
    free = [p for p in rng.permutation(pool_pages).tolist() if all(p not in o for o in owned)]

    def upload() -> KvLayout:
        pages = [np.array(o, dtype=np.int32) for o in owned]
        ip = np.zeros(b + 1, dtype=np.int32)
        np.cumsum([len(p) for p in pages], out=ip[1:])
        flat = np.concatenate(pages + [np.zeros(0, np.int32)]).astype(np.int32)
        lp = np.where(lens > 0, lens - (np.maximum(-(-lens // page_size), 1) - 1) * page_size, 1).astype(np.int32)
        indptr.copy_(torch.from_numpy(ip))
        indices[: flat.shape[0]].copy_(torch.from_numpy(flat))
        last.copy_(torch.from_numpy(lp))
        return KvLayout(ip, flat, lp, page_size)

    def step(out, lse, stream):
        dec.run(q, kv, indptr, out, kv_indices=indices, kv_last_page_len=last, page_size=page_size,
                kv_scale=sc, lse=lse, stream=stream)

    upload()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up on the capture stream: argument checks happen here
        step(out_graph, lse_graph, side.cuda_stream)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(out_graph, lse_graph, torch.cuda.current_stream().cuda_stream)

    checked = 0
    for s in range(50):
        for i in range(b):  # every sequence grows by one token
            if lens[i] % page_size == 0:
                owned[i].append(free.pop())
            lens[i] += 1
        if s % 7 == 3:  # the serving system moves a page: the table changes, not the graph
            i = int(np.argmax(lens))
            new = free.pop()
            kv[new * page_size:(new + 1) * page_size].copy_(kv[owned[i][0] * page_size:(owned[i][0] + 1) * page_size])
            sc[new * page_size:(new + 1) * page_size].copy_(sc[owned[i][0] * page_size:(owned[i][0] + 1) * page_size])
            owned[i][0] = new
        layout = upload()
        out_graph.fill_(-1)
        graph.replay()
        step(out_eager, lse_eager, torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        og, oe = out_graph.cpu().numpy(), out_eager.cpu().numpy()
        lg, le = lse_graph.cpu().numpy(), lse_eager.cpu().numpy()
        assert np.array_equal(og, oe), f"step {s}: replay differs from the eager run"
        assert np.array_equal(lg.view(np.uint32), le.view(np.uint32)), f"step {s}: replay LSE differs"
        if s % 10 == 0 or s == 49:
            host_pool = type(pool)("mxfp4", kv.cpu().numpy(), scales=sc.cpu().numpy())
            seqs = np.arange(b)
            out = og.view(np.uint16).view(ml_dtypes.bfloat16)
            check(dec, out, lg, qh, host_pool, layout, seqs, f"graph step {s}")
            checked += 1
    assert checked == 6


@pytest.mark.parametrize("kind, bit", [("decreasing indptr", 1), ("page past the pool", 4),
                                       ("negative page id", 4), ("last page length", 8),
                                       ("table too short", 2), ("indptr wrapped past int32", 1)])
def test_invalid_device_input_gives_nan_and_an_error(decoders, kind, bit):
    """Page tables the host never reads, corrupted on the device: the affected sequence
    gets NaN (no read outside the given arrays: memcheck runs the same cases in
    scripts/sanitize_case.py), the others stay right, check_errors names it once."""
    from hipmla import runtime

    dec = decoders("fp8")
    rng = np.random.default_rng(bit)
    lens = np.array([700, 0, 33, 4000, 129, 1])
    layout = random_page_table(lens, 16, rng, spare_pages=5)
    pool = random_cache((int(layout.kv_indices.max()) + 1) * 16, "fp8", rng)
    q = rng.standard_normal((6, 16, 576), dtype=np.float32).astype(ml_dtypes.bfloat16)
    ip, idx, last = layout.kv_indptr.copy(), layout.kv_indices.copy(), layout.kv_last_page_len.copy()
    hit = 3
    if kind == "decreasing indptr":
        ip[4] = ip[3] - 1  # sequence 3 ends before it starts
    elif kind == "indptr wrapped past int32":
        ip[4] = np.int32(-2**31 + 2)  # an int64 offset past 2^31 cast to int32: 3 and 4 are hit
    elif kind == "page past the pool":
        idx[ip[3] + 7] = pool.rows // 16 + 100
    elif kind == "negative page id":
        idx[ip[3]] = -1
    elif kind == "last page length":
        last[3] = 0
    else:
        idx, hit = idx[: ip[-1] - 1], 5  # one entry short: the last sequence's page is missing
    dev = {k: runtime.DeviceArray.from_host(np.ascontiguousarray(v)) for k, v in
           (("q", q.view(np.uint16)), ("kv", pool.data), ("kv_indptr", ip), ("kv_indices", idx),
            ("kv_last_page_len", last))}
    d_out = runtime.DeviceArray((6, 16, 512), np.uint16)
    d_lse = runtime.DeviceArray((6, 16), np.float32)
    dec.check_errors()  # nothing left over from other tests
    dec.run(out=d_out, lse=d_lse, page_size=16, fp8_scale=pool.fp8_scale, **dev)
    out = d_out.to_host().view(ml_dtypes.bfloat16).astype(np.float32)
    lse = d_lse.to_host()
    with pytest.raises(decode.DeviceInputError) as e:
        dec.check_errors()
    assert e.value.bits & bit, (kind, e.value.bits)
    dec.check_errors()  # cleared
    assert np.isnan(out[hit]).all() and np.isnan(lse[hit]).all(), kind
    if kind == "indptr wrapped past int32":
        assert np.isnan(out[4]).all() and np.isnan(lse[4]).all()
    indptr_kinds = ("decreasing indptr", "indptr wrapped past int32")
    ok = [s for s in range(6) if s != hit and not (kind in indptr_kinds and s == 4)]
    assert np.isfinite(out[ok]).all(), kind
    emu_out, emu_lse = dec.emulate(q, pool, layout, seqs=[0, 2])
    assert np.abs(out[[0, 2]] - emu_out.astype(np.float32)).max() <= 2e-2 * np.abs(emu_out.astype(np.float32)).max()
    for a in list(dev.values()) + [d_out, d_lse]:
        a.free()


# ----------------------------------------------------------------------------- query tokens, heads


# 4 and 8 (queries.PADDED_HEADS): four and two query tokens a 16-head row, each head masked
# at its own token's bound.
MTP_HEADS = (4, 8, 16, 32, 64, 128)


@pytest.mark.parametrize("heads", MTP_HEADS)
@pytest.mark.parametrize("kv_format", KV_FORMATS)
def test_several_query_tokens_and_heads(kv_format, heads):
    """q_len 1..8 ragged in one batch, with sequences of no query token, one whose kv
    tokens equal its query tokens (the causal boundary: its first token sees one), a paged
    cache, each head count: against the decoder's emulator and the exact reference."""
    rng = np.random.default_rng(heads + len(kv_format))
    q_lens = np.array([1, 8, 0, 3, 2, 5, 1, 4, 0, 7, 6, 2])
    lens = q_lens + np.array([0, 0, 0, 40, 1, 700, 3000, 127, 5, 9000, 64, 300])
    qo = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    t_q = int(qo[-1])
    layout = random_page_table(lens, 16, rng, spare_pages=9, shared=2)
    pool = random_cache((int(layout.kv_indices.max()) + 1) * 16, kv_format, rng, scale_stride=24)
    q = rng.standard_normal((t_q, heads, 576), dtype=np.float32).astype(ml_dtypes.bfloat16)
    with decode.Decoder(kv_format, SM_SCALE, heads=heads, max_batch=lens.size, max_q_tokens=t_q) as dec:
        out, lse = dec.decode(q, pool, layout, qo_indptr=qo)
        assert out.shape == (t_q, heads, 512) and lse.shape == (t_q, heads)
        emu_out, emu_lse = dec.emulate(q, pool, layout, qo_indptr=qo)
        what = f"{kv_format} {heads} heads, q_len {q_lens.tolist()}"
        assert_close_to_emulator(out, lse, emu_out, emu_lse, what)
        ref_out, ref_lse, ref_mag = mla_decode_reference(q, pool, layout, SM_SCALE, qo_indptr=qo, magnitude=True)
        assert_close_to_reference(out, lse, ref_out, ref_lse, ref_mag, what)
        # The causal boundary: sequence 1 has 8 kv tokens and 8 query tokens; its first
        # query token sees kv token 0 alone, so its output is that token's V.
        v0 = pool.dequantize(layout.rows(1, 0, 1))[0, :512]
        np.testing.assert_allclose(out[int(qo[1])].astype(np.float32), np.broadcast_to(v0, (heads, 512)),
                                   rtol=2 ** -7, atol=1e-6)
        dec.check_errors()


@pytest.mark.parametrize("kv_format", KV_FORMATS)
def test_split_merge_bytes_do_not_depend_on_who_merges(kv_format):
    """core/merge.h: the items of a split row merge a share of its columns each, or, when
    one stops waiting for its siblings, the last item merges the whole row. A build that
    never waits (HIPMLA_MERGE_WAIT_NS=0: nearly every row merged by its last item) gives
    the same bytes as the one that shares: rows of 2 to 16 items, several query tokens and
    head groups (slots strided by the rows of a sequence), empty and one-token sequences."""
    import dataclasses

    from hipmla.schedule import schedule

    rng = np.random.default_rng(7)
    q_lens = np.array([1, 3, 0, 2, 1, 1])
    lens = q_lens + np.array([20000, 5000, 0, 900, 1, 12000])
    qo = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    t_q, heads = int(qo[-1]), 32
    layout = random_page_table(lens, 16, rng, spare_pages=5, shared=1)
    pool = random_cache((int(layout.kv_indices.max()) + 1) * 16, kv_format, rng, scale_stride=24)
    q = rng.standard_normal((t_q, heads, 576), dtype=np.float32).astype(ml_dtypes.bfloat16)
    results = []
    with decode.Decoder(kv_format, SM_SCALE, heads=heads, max_batch=lens.size, max_q_tokens=t_q) as dec:
        spec = dataclasses.replace(dec._split, defines=dec._split.defines + (("HIPMLA_MERGE_WAIT_NS", "0"),))
        split = schedule(lens, dec.policy, q_lens, head_groups=heads // 16)
        assert split.n_items.max() >= 8 and (split.slot_stride[split.n_items > 1] > 1).any()
        results.append(dec.decode(q, pool, layout, qo_indptr=qo))
        emu_out, emu_lse = dec.emulate(q, pool, layout, qo_indptr=qo)
        assert_close_to_emulator(*results[0], emu_out, emu_lse, f"{kv_format} shared merge")
        dec.check_errors()
    with decode.Decoder(kv_format, SM_SCALE, heads=heads, max_batch=lens.size, max_q_tokens=t_q,
                        kernel=spec, selftest=False) as dec:
        for _ in range(3):  # and again on the counters the first step left
            results.append(dec.decode(q, pool, layout, qo_indptr=qo))
        dec.check_errors()
    for out, lse in results[1:]:
        assert np.array_equal(out.view(np.uint16), results[0][0].view(np.uint16))
        assert np.array_equal(lse.view(np.uint32), results[0][1].view(np.uint32))


def test_fewer_kv_than_query_tokens_on_the_device_gives_nan_and_an_error():
    """L < n where only the device knows the lengths: those rows NaN, ERR_Q_LEN, others right."""
    from hipmla import runtime

    dec = decode.Decoder("bf16", SM_SCALE, heads=32, max_batch=3, max_q_tokens=8)
    rng = np.random.default_rng(7)
    lens = np.array([50, 2, 9])
    qo = np.array([0, 2, 5, 6], np.int32)  # sequence 1: 3 query tokens, 2 kv tokens
    kv = random_cache(int(lens.sum()), "bf16", rng)
    q = rng.standard_normal((6, 32, 576), dtype=np.float32).astype(ml_dtypes.bfloat16)
    layout = KvLayout.contiguous(lens)
    dev = {k: runtime.DeviceArray.from_host(np.ascontiguousarray(v)) for k, v in
           (("q", q.view(np.uint16)), ("kv", kv.data), ("kv_indptr", layout.kv_indptr.astype(np.int32)),
            ("qo_indptr", qo))}
    d_out = runtime.DeviceArray((6, 32, 512), np.uint16)
    d_lse = runtime.DeviceArray((6, 32), np.float32)
    try:
        dec.run(out=d_out, lse=d_lse, **dev)
        out = d_out.to_host().view(ml_dtypes.bfloat16).astype(np.float32)
        lse = d_lse.to_host()
        with pytest.raises(decode.DeviceInputError, match="fewer kv tokens") as e:
            dec.check_errors()
        assert e.value.bits == 32
        assert np.isnan(out[2:5]).all() and np.isnan(lse[2:5]).all()
        good = [0, 1, 5]
        assert np.isfinite(out[good]).all()
        # The other sequences, as a valid step of their own, by the exact reference.
        kv_sub = take_rows(kv, np.concatenate([layout.rows(0), layout.rows(2)]))
        ref_out, ref_lse, ref_mag = mla_decode_reference(q[good], kv_sub, KvLayout.contiguous(lens[[0, 2]]), SM_SCALE,
                                                         qo_indptr=np.array([0, 2, 3]), magnitude=True)
        assert_close_to_reference(out[good], lse[good], ref_out, ref_lse, ref_mag, "rows beside a short sequence")
    finally:
        for a in list(dev.values()) + [d_out, d_lse]:
            a.free()
        dec.close()
