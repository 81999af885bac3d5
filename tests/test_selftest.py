"""Kernels that check themselves (hipmla.selftest): the known case, the comparison, the
verdict cache, the decoder's fallback and its one warning, the opt-outs and the CLI.

CPU tests run on the faked runtime of tests/test_decode.py, with the case's runner
replaced where they test the gate around it; two run the real runner on the fake (the
emulator standing in for the device passes, the fake's zeros fail). GPU tests (``gpu``):
the decoder's kernels of this device pass; on sm_90 the deliberately broken build
(``selftest.broken``) fails, and a decoder built on it falls back to the portable kernel
with a warning and still decodes right."""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
import warnings
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from hipmla import cli, decode, kernels, runtime, selftest
from hipmla.formats import KV_FORMATS
from hipmla.selftest import Comparison, KernelSelfTestWarning
from test_decode import args, fake_runtime

PASS = Comparison(worst_error=2e-3, lse_error=3e-5, failure="")
FAIL = Comparison(worst_error=0.5, lse_error=3e-5,
                  failure="98304 of 98304 outputs off the emulator by more than 2^-7 |emu| + 0.001 x scale")
SM90 = kernels.sm90_split_kernel("mxfp4")
PORTABLE = kernels.split_kernel("mxfp4", "bf16")


@pytest.fixture
def verdicts(monkeypatch, tmp_path):
    """Checks on, verdicts under ``tmp_path``, and the compile cache key (which would ask
    hiprtc its version) made of the translation unit, options, arch and a compiler
    version the test can change."""
    monkeypatch.setenv("HIPMLA_SELFTEST", "1")
    monkeypatch.setenv("HIPMLA_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("HIPMLA_CACHE", raising=False)
    compiler = {"version": "hiprtc 1.0"}

    def cache_key(source: str, options: list[str], arch: str) -> str:
        material = json.dumps([source, list(options), arch, compiler["version"]])
        return hashlib.sha256(material.encode()).hexdigest()

    monkeypatch.setattr(runtime, "cache_key", cache_key)
    selftest.forget()
    yield SimpleNamespace(compiler=compiler, dir=tmp_path / "selftest")
    selftest.forget()


@pytest.fixture
def checks(verdicts, monkeypatch):
    """:func:`verdicts`, with the case's runner replaced: it records each kernel it is
    given and returns (or raises) ``checks.result``."""
    verdicts.runs, verdicts.result = [], PASS

    def run_case(spec, device=0):
        verdicts.runs.append(spec)
        if isinstance(verdicts.result, Exception):
            raise verdicts.result
        return verdicts.result

    monkeypatch.setattr(selftest, "run_case", run_case)
    return verdicts


def stored(directory) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))]


# ----------------------------------------------------------------------------- the case and the bounds


@pytest.mark.parametrize("kv_format", KV_FORMATS)
def test_known_case_is_ragged_paged_and_the_same_every_time(kv_format):
    case = selftest.known_case(kv_format)
    lens = case.layout.seq_lens()
    assert list(lens) == list(selftest.CASE_LENS)
    assert 0 in lens and any(n % 32 for n in lens)  # an empty sequence and partial tiles
    assert case.layout.paged and case.layout.page_size == 16
    used = case.layout.kv_indices[: case.layout.kv_indptr[-1]]
    assert len(set(used.tolist())) < used.size  # a page shared by two sequences
    assert not np.array_equal(used, np.sort(used))  # pages out of order
    assert case.kv.format == kv_format and case.kv.rows > 16 * len(set(used.tolist()))  # spare pages too
    again = selftest.known_case(kv_format)
    assert np.array_equal(case.kv.data, again.kv.data) and np.array_equal(case.q, again.q)
    assert selftest.known_case(kv_format, "e4m3fnuz").kv.fp8_variant == ("e4m3fnuz" if kv_format == "fp8" else "e4m3fn")


def test_the_case_splits_sequences_on_a_large_device():
    """Split sequences (partials and the in-kernel merge) even on an H200's 132 SMs."""
    from hipmla.schedule import SplitPolicy, schedule

    items = schedule(np.array(selftest.CASE_LENS), SplitPolicy.for_device(132))
    assert (items.n_items > 1).sum() >= 5


def _outputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    out = rng.standard_normal((3, 16, 512), dtype=np.float32).astype(ml_dtypes.bfloat16)
    lse = rng.standard_normal((3, 16)).astype(np.float32)
    lse[1] = -np.inf
    return out, lse


def test_compare_passes_the_emulator_itself_and_one_ulp_off():
    out, lse = _outputs()
    assert selftest.compare(out, lse, out, lse) == Comparison(0.0, 0.0, "")
    nudged = (out.view(np.uint16) + 1).view(ml_dtypes.bfloat16)  # one bf16 ulp everywhere
    assert selftest.compare(nudged, lse + 5e-4, out, lse).passed


@pytest.mark.parametrize("spoil, words", [
    (lambda o, l: (o.astype(np.float32) * 1.5, l), "outputs off the emulator"),
    (lambda o, l: (np.where(np.arange(512) == 7, np.nan, o.astype(np.float32)), l), "outputs off the emulator"),
    (lambda o, l: (o, l + 5e-3), "LSE off the emulator by 5.0"),
    (lambda o, l: (o, np.where(np.isinf(l), 0, l)), "-inf (empty sequence) on one side only at 16 of 48"),
    (lambda o, l: (o, np.full_like(l, np.nan)), "LSE off the emulator by inf"),
])
def test_compare_fails_what_is_off(spoil, words):
    out, lse = _outputs()
    got = selftest.compare(*spoil(out, lse), out, lse)
    assert not got.passed and words in got.failure, got


def test_verdicts_round_trip_through_json_with_infinite_errors():
    v = selftest.Verdict("k", "sm_90", "ab" * 32, "mxfp4", "bf16", False, float("inf"), 1e-4, "CompileError: x")
    text = json.dumps(v.to_json())  # standard JSON: inf is null
    assert "Infinity" not in text
    assert selftest.Verdict.from_json(json.loads(text)) == v


# ----------------------------------------------------------------------------- the verdict cache


def test_a_pass_is_stored_and_reused(monkeypatch, checks):
    fake_runtime(monkeypatch, "sm_90")
    dec = decode.Decoder("mxfp4", 1 / 24)
    assert dec.kernel_symbol == SM90.symbol and checks.runs == [SM90]
    (entry,) = stored(checks.dir)
    assert entry["passed"] and entry["symbol"] == SM90.symbol and entry["arch"] == "sm_90"
    assert entry["code_hash"] == selftest.code_hash(SM90, "sm_90") and entry["version"] == selftest.VERSION
    decode.Decoder("mxfp4", 1 / 24)  # the same process: no second check
    selftest.forget()  # a new process: the stored verdict, not a run
    assert decode.Decoder("mxfp4", 1 / 24).kernel_symbol == SM90.symbol
    assert checks.runs == [SM90] and selftest.verdict_of(SM90, "sm_90").cached


def test_a_new_code_object_is_checked_again(monkeypatch, checks):
    fake_runtime(monkeypatch, "sm_90")
    decode.Decoder("mxfp4", 1 / 24)
    before = selftest.code_hash(SM90, "sm_90")
    checks.compiler["version"] = "hiprtc 2.0"  # the same source, another compiler: another code object
    assert selftest.code_hash(SM90, "sm_90") != before
    selftest.forget()
    decode.Decoder("mxfp4", 1 / 24)
    assert checks.runs == [SM90, SM90] and len(stored(checks.dir)) == 2


def test_use_cache_false_runs_again_and_replaces_the_verdict(monkeypatch, checks):
    fake_runtime(monkeypatch, "sm_90")
    assert selftest.check_kernel(SM90).passed
    checks.result = FAIL
    assert not selftest.check_kernel(SM90, use_cache=False).passed  # stored pass, fresh run: the run wins
    assert selftest.check_kernel(SM90).cached and not selftest.check_kernel(SM90).passed
    assert len(checks.runs) == 2


@pytest.mark.parametrize("spoil", [lambda text: "{not json", lambda text: text.replace(f'"version": {selftest.VERSION}', '"version": 1'),
                                   lambda text: text.replace('"code_hash": "', '"code_hash": "00')])
def test_a_spoiled_or_foreign_verdict_file_is_run_again(monkeypatch, checks, spoil):
    fake_runtime(monkeypatch, "sm_90")
    selftest.check_kernel(SM90)
    (path,) = checks.dir.glob("*.json")
    path.write_text(spoil(path.read_text()))
    assert not selftest.check_kernel(SM90).cached and len(checks.runs) == 2
    assert stored(checks.dir)[0]["code_hash"] == selftest.code_hash(SM90, "sm_90")  # rewritten


def test_without_the_kernel_cache_nothing_is_stored(monkeypatch, checks):
    fake_runtime(monkeypatch, "sm_90")
    monkeypatch.setenv("HIPMLA_CACHE", "0")
    assert selftest.verdict_dir() is None
    decode.Decoder("mxfp4", 1 / 24)
    selftest.forget()
    decode.Decoder("mxfp4", 1 / 24)
    assert len(checks.runs) == 2 and not checks.dir.exists()


# ----------------------------------------------------------------------------- the decoder's fallback


def test_a_failing_kernel_falls_back_to_the_portable_kernel_with_one_warning(monkeypatch, checks, caplog):
    gpu = fake_runtime(monkeypatch, "sm_90")
    checks.result = FAIL
    with pytest.warns(KernelSelfTestWarning) as caught:
        dec = decode.Decoder("mxfp4", 1 / 24)
    assert dec.kernel_symbol == PORTABLE.symbol and dec._fast is None and dec.tile_tokens == 64
    (w,) = caught
    text = str(w.message)
    assert SM90.symbol in text and "sm_90" in text and FAIL.failure in text and PORTABLE.symbol in text
    assert w.filename == __file__  # pointed at the caller's Decoder(...) line
    records = [r for r in caplog.records if r.name == "hipmla" and r.levelno == logging.WARNING]
    assert len(records) == 1 and SM90.symbol in records[0].getMessage()
    dec.run(**args(2))
    assert gpu.launches[-1].symbol == PORTABLE.symbol
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second decoder of the process: no second warning
        assert decode.Decoder("mxfp4", 1 / 24).kernel_symbol == PORTABLE.symbol
    assert checks.runs == [SM90]


def test_a_stored_failure_falls_back_without_running_again(monkeypatch, checks):
    fake_runtime(monkeypatch, "sm_90")
    checks.result = FAIL
    with pytest.warns(KernelSelfTestWarning):
        decode.Decoder("mxfp4", 1 / 24)
    selftest.forget()
    with pytest.warns(KernelSelfTestWarning, match=r"\(stored verdict\)"):
        assert decode.Decoder("mxfp4", 1 / 24).kernel_symbol == PORTABLE.symbol
    assert checks.runs == [SM90]


def test_a_kernel_that_does_not_build_falls_back_and_is_tried_again_next_process(monkeypatch, checks):
    fake_runtime(monkeypatch, "sm_90")
    checks.result = runtime.CompileError("hiprtc could not compile 'x' for sm_90", "error: expected ';'")
    with pytest.warns(KernelSelfTestWarning, match=r"CompileError: hiprtc could not compile .* expected ';'"):
        assert decode.Decoder("mxfp4", 1 / 24).kernel_symbol == PORTABLE.symbol
    assert stored(checks.dir) == []  # no verdict on its numbers
    selftest.forget()
    with pytest.warns(KernelSelfTestWarning):
        decode.Decoder("mxfp4", 1 / 24)
    assert len(checks.runs) == 2


@pytest.mark.parametrize("arch, kv_format, portable", [
    ("gfx950", "mxfp4", "hipmla_decode_split_mxfp4_qbf16"),  # the fast kernel's bf16 Q stays
    ("gfx942:sramecc+:xnack-", "fp8", "hipmla_decode_split_fp8_qbf16"),
])
def test_amd_fast_kernels_are_checked_too(monkeypatch, checks, arch, kv_format, portable):
    gpu = fake_runtime(monkeypatch, arch)
    checks.result = FAIL
    with pytest.warns(KernelSelfTestWarning, match="hipmla_decode_split_gfx9"):
        dec = decode.Decoder(kv_format, 1 / 24)
    assert [s.tile_tokens for s in checks.runs] == [kernels.FAST_TILE_TOKENS[arch.split(":")[0]]]
    assert dec.kernel_symbol == portable and dec._fast is None and dec.tile_tokens == 64
    dec.run(**args(2, kv_format=kv_format))
    assert gpu.launches[-1].symbol == portable


def test_a_passing_fast_kernel_serves(monkeypatch, checks):
    fake_runtime(monkeypatch, "gfx950")
    dec = decode.Decoder("mxfp4", 1 / 24)
    assert dec._fast is not None and dec._split is dec._fast and dec.kernel_symbol == dec._fast.symbol


def test_the_portable_kernel_is_never_checked(monkeypatch, checks):
    fake_runtime(monkeypatch, "gfx942")
    decode.Decoder("mxfp4", 1 / 24, q_precision="fp8")  # gfx942 runs quantized Q on the portable kernel
    fake_runtime(monkeypatch, "gfx90a")
    decode.Decoder("bf16", 1 / 24)
    assert checks.runs == []


def test_the_opt_outs(monkeypatch, checks):
    fake_runtime(monkeypatch, "sm_90")
    monkeypatch.setenv("HIPMLA_SELFTEST", "0")
    assert decode.Decoder("mxfp4", 1 / 24).kernel_symbol == SM90.symbol and checks.runs == []
    monkeypatch.setenv("HIPMLA_SELFTEST", " 1 ")
    assert decode.Decoder("mxfp4", 1 / 24, selftest=False).kernel_symbol == SM90.symbol and checks.runs == []
    monkeypatch.setenv("HIPMLA_SELFTEST", "0")
    decode.Decoder("mxfp4", 1 / 24, selftest=True)  # the keyword wins over the variable
    assert checks.runs == [SM90]
    with pytest.raises(TypeError, match="selftest: expected True, False or None"):
        decode.Decoder("mxfp4", 1 / 24, selftest="no")


def test_the_kernel_keyword_is_checked(monkeypatch, checks):
    fake_runtime(monkeypatch, "sm_90")
    with pytest.raises(ValueError, match="reads a bf16 cache with bf16 Q, this decoder a mxfp4 cache"):
        decode.Decoder("mxfp4", 1 / 24, kernel=kernels.sm90_split_kernel("bf16"))
    with pytest.raises(ValueError, match="with bf16 Q, this decoder a mxfp4 cache with fp8 Q"):
        decode.Decoder("mxfp4", 1 / 24, q_precision="fp8", kernel=SM90)
    with pytest.raises(TypeError, match="kernel: expected a hipmla.kernels.KernelSpec"):
        decode.Decoder("mxfp4", 1 / 24, kernel="hipmla_decode_split_sm90_mxfp4_qbf16")
    fake_runtime(monkeypatch, "gfx950")
    with pytest.raises(ValueError, match="builds for sm_90, not gfx950"):
        decode.Decoder("mxfp4", 1 / 24, q_precision="bf16", kernel=SM90)
    assert checks.runs == []


def test_the_broken_build_is_another_code_object_of_the_same_symbol(checks):
    bad = selftest.broken(SM90)
    assert bad.symbol == SM90.symbol and "-DHIPMLA_SELFTEST_BREAK=1" in bad.options("sm_90")
    assert selftest.code_hash(bad, "sm_90") != selftest.code_hash(SM90, "sm_90")
    assert "#ifdef HIPMLA_SELFTEST_BREAK" in kernels.translation_unit(kernels.SM90_SOURCE)
    with pytest.raises(ValueError, match="only decode/split_sm90.hip and decode/split_sm90_rows64.hip have the "
                                         "HIPMLA_SELFTEST_BREAK build"):
        selftest.broken(PORTABLE)


# ----------------------------------------------------------------------------- the real runner, on the fake


def test_the_runner_passes_a_device_that_computes_what_the_emulator_does(monkeypatch, verdicts):
    fake_runtime(monkeypatch, "sm_90")
    seen = []

    def decode_as_emulated(self, q, kv, layout, qo_indptr=None):
        seen.append((self.kernel_symbol, self.tile_tokens, layout.page_size, q.shape[1],
                     None if qo_indptr is None else np.diff(qo_indptr).max()))
        return self.emulate(q, kv, layout, qo_indptr=qo_indptr)

    monkeypatch.setattr(decode.Decoder, "decode", decode_as_emulated)
    verdict = selftest.check_kernel(SM90)
    assert verdict.passed and verdict.worst_error == 0 and verdict.lse_error == 0, verdict
    assert "0/1/33/100/300/700 tokens, pages of 16" in verdict.message
    # The kernel's own 32-token softmax steps; 16 heads, then 8 heads x 4 query tokens (two a row).
    assert seen == [(SM90.symbol, 32, 16, 16, None), (SM90.symbol, 32, 16, 8, 4)]


def test_the_runner_runs_both_cases_of_the_64_row_kernel(monkeypatch, verdicts):
    """64 heads, then 16 heads x 4 query tokens."""
    fake_runtime(monkeypatch, "sm_90")
    rows64 = kernels.sm90_rows64_kernel("mxfp4")
    seen = []

    def decode_as_emulated(self, q, kv, layout, qo_indptr=None):
        seen.append((q.shape[1], None if qo_indptr is None else np.diff(qo_indptr).max()))
        return self.emulate(q, kv, layout, qo_indptr=qo_indptr)

    monkeypatch.setattr(decode.Decoder, "decode", decode_as_emulated)
    assert selftest.check_kernel(rows64).passed and seen == [(64, None), (16, 4)]


@pytest.mark.parametrize("spec, case", [(SM90, "8 heads x 4 query tokens"),
                                        (kernels.sm90_rows64_kernel("mxfp4"), "16 heads x 4 query tokens")])
def test_a_wrong_answer_in_the_case_of_query_tokens_alone_fails_the_kernel(monkeypatch, verdicts, spec, case):
    """The second case (rows of several query tokens) is checked on its own and named."""
    fake_runtime(monkeypatch, "sm_90")

    def wrong_with_query_tokens(self, q, kv, layout, qo_indptr=None):
        out, lse = self.emulate(q, kv, layout, qo_indptr=qo_indptr)
        return (out if qo_indptr is None else out * 2), lse

    monkeypatch.setattr(decode.Decoder, "decode", wrong_with_query_tokens)
    verdict = selftest.check_kernel(spec, use_cache=False)
    assert not verdict.passed and f"{case}: " in verdict.message


def test_the_runner_fails_the_fakes_zeros(monkeypatch, verdicts):
    fake_runtime(monkeypatch, "sm_90")  # its device arrays read back as zeros
    verdict = selftest.check_kernel(kernels.sm90_split_kernel("fp8"))
    assert not verdict.passed and verdict.cached is False
    assert "outputs off the emulator" in verdict.message and "LSE" in verdict.message
    assert stored(verdicts.dir)[0]["passed"] is False  # a wrong answer is a verdict: stored


# ----------------------------------------------------------------------------- the CLI


@pytest.mark.parametrize("arch, decoder", [
    ("sm_90", [f"hipmla_decode_split_sm90_bf16_q{q}" for q in ("bf16", "fp8", "mxfp4")]
     + ["hipmla_decode_split_sm90_fp8_qbf16", "hipmla_decode_split_sm90_rows64_fp8_qbf16",
        "hipmla_decode_split_sm90_fp8_qfp8", "hipmla_decode_split_sm90_fp8_qmxfp4"]
     + ["hipmla_decode_split_sm90_mxfp4_qbf16", "hipmla_decode_split_sm90_rows64_mxfp4_qbf16",
        "hipmla_decode_split_sm90_mxfp4_qfp8", "hipmla_decode_split_sm90_mxfp4_qmxfp4"]),
    ("gfx950", [f"hipmla_decode_split_gfx950_mxfp4_q{q}" for q in ("bf16", "fp8", "mxfp4")]),
    ("gfx942", [f"hipmla_decode_split_gfx942_{kv}_qbf16" for kv in KV_FORMATS]),
    ("gfx90a", []),
])
def test_device_plan_is_the_decoders_kernels_then_the_portable_ones(arch, decoder):
    plan = selftest.device_plan(arch, KV_FORMATS)
    assert [s.symbol for s, role in plan if role == "decoder"] == decoder
    assert [s.symbol for s, role in plan if role == "portable"] == \
        [f"hipmla_decode_split_{kv}_qbf16" for kv in KV_FORMATS]  # "auto" is bf16 everywhere


def test_cli_without_a_gpu_says_so_and_exits_2(monkeypatch, capsys):
    def no_device():
        raise runtime.RuntimeUnavailable("no HIP runtime found: libamdhip64.so is not installed. Install ROCm")

    monkeypatch.setattr(runtime, "device_count", no_device)
    monkeypatch.delenv("HIPMLA_PLATFORM", raising=False)
    with pytest.raises(SystemExit) as e:
        cli.main(["selftest"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("hipmla selftest: no GPU reachable through hip-python (no HIP runtime found: "
                          "libamdhip64.so is not installed)") and "nothing to run" in err


def test_cli_without_a_gpu_from_the_shell_has_no_traceback():
    from conftest import gpu_available

    if gpu_available():
        pytest.skip("a GPU is reachable here")
    r = subprocess.run([sys.executable, "-m", "hipmla", "selftest"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "no GPU reachable" in r.stderr, r.stderr


def test_cli_prints_a_table_writes_json_and_reuses_verdicts(monkeypatch, checks, capsys, tmp_path):
    fake_runtime(monkeypatch, "sm_90")
    monkeypatch.setattr(runtime, "device_count", lambda: 1)
    report = tmp_path / "selftest.json"
    assert cli.main(["selftest", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    lines = [l for l in out.splitlines() if l.startswith(("decoder", "portable"))]
    qs = ("bf16", "fp8", "mxfp4")
    decoders = [f"hipmla_decode_split_sm90_{kv}_q{q}" for kv in KV_FORMATS for q in qs]
    decoders.insert(7, "hipmla_decode_split_sm90_rows64_mxfp4_qbf16")  # mxfp4 with bf16 Q, 64+ heads
    decoders.insert(4, "hipmla_decode_split_sm90_rows64_fp8_qbf16")  # fp8 with bf16 Q, 64+ heads
    assert [l.split()[:2] for l in lines] == [["decoder", d] for d in decoders] + \
        [["portable", f"hipmla_decode_split_{kv}_qbf16"] for kv in KV_FORMATS]
    assert all(l.split()[2] == "sm_90" and l.split()[4] == "pass" and l.endswith("no") for l in lines)
    assert "14 passed, 0 failed" in out and str(checks.dir) in out
    data = json.loads(report.read_text())
    assert data["arch"] == "sm_90" and [v["role"] for v in data["verdicts"]] == ["decoder"] * 11 + ["portable"] * 3
    assert cli.main(["selftest", "--format", "mxfp4"]) == 0
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith(("decoder", "portable"))]
    assert len(lines) == 5 and all(l.endswith("yes") for l in lines) and len(checks.runs) == 14
    checks.result = FAIL
    assert cli.main(["selftest", "--format", "mxfp4", "--no-cache"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and FAIL.failure in out and "0 passed, 5 failed" in out and len(checks.runs) == 19


# ----------------------------------------------------------------------------- on the GPU


@pytest.fixture
def gpu_verdicts(monkeypatch, tmp_path):
    """Verdicts of this test only (the compile cache stays where it is: no recompiles)."""
    monkeypatch.setattr(selftest, "verdict_dir", lambda: tmp_path)
    selftest.forget()
    yield tmp_path
    selftest.forget()


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", KV_FORMATS)
def test_gpu_the_decoders_kernel_and_the_portable_one_pass(gpu_verdicts, kv_format):
    arch = runtime.device_info(0).arch
    q = decode.resolve_q_precision("auto", arch, kv_format)
    spec = kernels.decoder_kernel(arch, kv_format, q)
    if arch == "sm_90":
        assert spec.source == kernels.SM90_SOURCE
    for kernel in (spec, kernels.split_kernel(kv_format, q)):
        verdict = selftest.check_kernel(kernel, use_cache=False)
        assert verdict.passed, f"{kernel.symbol}: {verdict.message}"
    with decode.Decoder(kv_format, 1 / 24, selftest=True) as dec:
        assert dec.kernel_symbol == spec.symbol  # no fallback on this device


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", KV_FORMATS)
def test_gpu_the_broken_sm90_build_fails_its_check(gpu_verdicts, kv_format):
    if runtime.device_info(0).arch != "sm_90":
        pytest.skip("the broken build is of the sm_90 kernel")
    verdict = selftest.check_kernel(selftest.broken(kernels.sm90_split_kernel(kv_format)), use_cache=False)
    assert not verdict.passed
    assert "outputs off the emulator" in verdict.message, verdict.message  # wrong numbers, not a build error
    assert 0.2 < verdict.worst_error < 1.0 and verdict.lse_error <= selftest.EMU_LSE_ATOL  # x 1.5, LSE untouched


@pytest.mark.gpu
def test_gpu_a_decoder_on_the_broken_build_falls_back_and_decodes_right(gpu_verdicts, monkeypatch):
    from hipmla.inputs import random_cache
    from hipmla.paging import random_page_table
    from hipmla.reference import mla_decode_reference
    from test_decode_gpu import assert_close_to_reference

    if runtime.device_info(0).arch != "sm_90":
        pytest.skip("the broken build is of the sm_90 kernel")
    bad = selftest.broken(SM90)
    with pytest.warns(KernelSelfTestWarning, match=rf"{SM90.symbol} failed .*outputs off the emulator"):
        dec = decode.Decoder("mxfp4", 1 / 24, kernel=bad)
    assert dec.kernel_symbol == PORTABLE.symbol and not selftest.verdict_of(bad, "sm_90").passed
    rng = np.random.default_rng(2027)
    lens = np.array([0, 5, 64, 129, 1000, 2500, 31])
    layout = random_page_table(lens, 16, rng, spare_pages=9, shared=2)
    kv = random_cache((int(layout.kv_indices.max()) + 1) * 16, "mxfp4", rng, scale_stride=24)
    q = rng.standard_normal((lens.size, 16, 576), dtype=np.float32).astype(ml_dtypes.bfloat16)
    out, lse = dec.decode(q, kv, layout)
    got = selftest.compare(out, lse, *dec.emulate(q, kv, layout))
    assert got.passed, got.failure
    assert_close_to_reference(out, lse, *mla_decode_reference(q, kv, layout, 1 / 24, magnitude=True), "fallback")
    dec.close()
    runs = []
    monkeypatch.setattr(selftest, "run_case", lambda *a: runs.append(a))
    selftest.forget()  # as a new process would: the stored failure, no second run
    with pytest.warns(KernelSelfTestWarning, match=r"\(stored verdict\)"):
        with decode.Decoder("mxfp4", 1 / 24, kernel=bad) as again:
            assert again.kernel_symbol == PORTABLE.symbol
    assert runs == []
