"""``python -m hipmla``: the check command on the host emulator (and on a faked GPU),
argument errors, --version, progress and logging."""

import io
import logging
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

import hipmla
from hipmla import cli, emulate, runtime


def rows_of(out: str, *shapes: str) -> list[str]:
    return [l for l in out.splitlines() if l.strip().startswith(shapes)]


def test_check_prints_a_row_per_shape_and_passes(capsys):
    rc = cli.main(["check", "--device", "host", "--format", "all", "--sample", "2",
                   "--shapes", "4x1k,32x1k"])
    out = capsys.readouterr().out
    rows = rows_of(out, "4x1k", "32x1k")
    assert rc == 0
    assert len(rows) == 6  # 2 shapes x 3 formats
    assert "6 passed, 0 failed" in out
    for row in rows:
        max_abs = float(row.split()[5])
        assert 0 < max_abs < 0.05  # bf16 Q: errors are small but never exactly zero
        lse_err = float(row.split()[8])
        assert 0 < lse_err < cli.LSE_TOL["bf16"]
        assert row.split()[2] == "bf16" and row.endswith(" ok")


def test_check_on_the_host_says_auto_is_bf16(capsys):
    assert cli.main(["check", "--device", "host", "--format", "mxfp4", "--sample", "1",
                     "--shapes", "4x1k"]) == 0
    out = capsys.readouterr().out
    assert "q precision auto -> mxfp4 cache: bf16 Q (auto means bf16 on the host emulator)" in out
    assert rows_of(out, "4x1k")[0].split()[2] == "bf16"


def test_check_q_precision_override(capsys):
    assert cli.main(["check", "--device", "host", "--format", "fp8", "--sample", "1",
                     "--shapes", "4x1k", "--q-precision", "mxfp4"]) == 0
    out = capsys.readouterr().out
    assert "(as asked)" in out and f"|lse-ref| <= {cli.LSE_TOL['mxfp4']}" in out
    assert rows_of(out, "4x1k")[0].split()[2] == "mxfp4"


def test_check_builds_only_the_sampled_sequences(monkeypatch, capsys):
    built = []
    real = cli.make_sampled_inputs

    def spy(seq_lens, seqs, kv_format, **kw):
        inputs = real(seq_lens, seqs, kv_format, **kw)
        built.append((len(seq_lens), list(seqs), inputs.kv.rows, list(inputs.seq_lens)))
        return inputs

    monkeypatch.setattr(cli, "make_sampled_inputs", spy)
    assert cli.main(["check", "--device", "host", "--format", "bf16", "--sample", "2",
                     "--shapes", "256x8k"]) == 0
    # 2 of 256 sequences, each at the shape's full 8k length: 16k rows, not 2M.
    assert built == [(256, [0, 255], 2 * 8192, [8192, 8192])]


def _plant(monkeypatch, lse_shift=0.0, out_nan=False):
    real = emulate.emulate_decode

    def planted(*args, **kwargs):
        out, lse = real(*args, **kwargs)
        if out_nan:
            out = out.copy()
            out[0, 0, 0] = np.nan
        return out, lse + np.float32(lse_shift)

    monkeypatch.setattr(emulate, "emulate_decode", planted)


def test_check_fails_on_lse_error_beyond_its_bound(monkeypatch, capsys):
    _plant(monkeypatch, lse_shift=2 * cli.LSE_TOL["bf16"])  # the output itself stays right
    rc = cli.main(["check", "--device", "host", "--format", "mxfp4", "--sample", "2", "--shapes", "4x1k"])
    out = capsys.readouterr().out
    row = rows_of(out, "4x1k")[0]
    assert rc == 1
    assert row.endswith("FAIL(lse)") and float(row.split()[7]) == 0  # frac_bad 0: only the LSE is off
    assert "0 passed, 1 failed" in out


def test_check_just_inside_the_lse_bound_passes(monkeypatch, capsys):
    _plant(monkeypatch, lse_shift=cli.LSE_TOL["bf16"] / 2)
    assert cli.main(["check", "--device", "host", "--format", "bf16", "--sample", "1", "--shapes", "4x1k"]) == 0


def test_check_fails_on_nan_output(monkeypatch, capsys):
    _plant(monkeypatch, out_nan=True)
    rc = cli.main(["check", "--device", "host", "--format", "bf16", "--sample", "1", "--shapes", "4x1k"])
    out = capsys.readouterr().out
    assert rc == 1 and rows_of(out, "4x1k")[0].endswith("FAIL(out)")


def test_lse_bounds_are_defined_for_every_q_precision():
    assert set(cli.LSE_TOL) == set(cli.REFERENCE_TOL) == {"bf16", "fp8", "mxfp4"}
    # bf16 Q: the analytic bound (2^-9, bf16 rounding of P) plus f32 score rounding.
    assert 2 ** -9 <= cli.LSE_TOL["bf16"] < 2.5e-3 < cli.LSE_TOL["fp8"] < cli.LSE_TOL["mxfp4"]


# ----------------------------------------------------------------------------- on a (faked) GPU


def fake_gpu(monkeypatch, arch: str, seen: list):
    """A backend on ``arch`` that runs the emulator and records what it was given."""
    host = cli._host_backend()

    def run(inputs, seqs, q_precision):
        seen.append((inputs.kv.format, inputs.kv.fp8_variant, q_precision, inputs.batch))
        return host.run(inputs, seqs, q_precision)

    monkeypatch.setattr(cli, "_backend", lambda device: cli.Backend(f"{arch}:0", run, arch=arch))


def test_check_uses_what_auto_picks_on_gfx950(monkeypatch, capsys):
    seen = []
    fake_gpu(monkeypatch, "gfx950", seen)
    assert cli.main(["check", "--format", "all", "--sample", "2", "--shapes", "4x1k"]) == 0
    out = capsys.readouterr().out
    assert "bf16 cache: bf16 Q, fp8 cache: bf16 Q, mxfp4 cache: bf16 Q" in out
    assert "what Decoder(q_precision='auto') picks on gfx950" in out
    q_col = {r.split()[1]: r.split()[2] for r in rows_of(out, "4x1k")}
    assert q_col == {"bf16": "bf16", "fp8": "bf16", "mxfp4": "bf16"}
    assert ("mxfp4", "e4m3fn", "bf16", 2) in seen  # the sub-batch: 2 sequences


def test_check_on_gfx942_builds_fnuz_fp8_caches(monkeypatch, capsys):
    seen = []
    fake_gpu(monkeypatch, "gfx942:sramecc+:xnack-", seen)
    assert cli.main(["check", "--format", "fp8", "--sample", "1", "--shapes", "4x1k"]) == 0
    assert seen == [("fp8", "e4m3fnuz", "bf16", 1)]


class FakeRuntime:
    def __init__(self, count: int):
        self.count = count

    def device_count(self):
        if isinstance(self.count, Exception):
            raise self.count
        return self.count


@pytest.fixture
def fake_runtime(monkeypatch):
    def install(count):
        fake = FakeRuntime(count)
        monkeypatch.setattr(runtime, "device_count", fake.device_count)
        monkeypatch.setattr(runtime, "device_info", lambda index: SimpleNamespace(arch="gfx950"))
        import hipmla.decode

        monkeypatch.setattr(hipmla.decode, "gpu_check_backend",
                            lambda index: (f"gfx950:{index}", lambda *a: None))
        monkeypatch.delenv("HIPMLA_PLATFORM", raising=False)
        return fake

    return install


def test_backend_auto_falls_back_to_the_host_and_logs_why(fake_runtime, caplog):
    fake_runtime(runtime.RuntimeUnavailable("no HIP runtime found"))
    with caplog.at_level(logging.INFO, logger="hipmla"):
        backend = cli._backend("auto")
    assert backend.label == "host-emulator" and backend.arch is None
    assert any(r.name == "hipmla" and "no HIP runtime found" in r.getMessage() for r in caplog.records)


def test_backend_gpu_index(fake_runtime, capsys):
    fake_runtime(2)
    b = cli._backend("gpu:1")
    assert b.label == "gfx950:1" and b.arch == "gfx950"
    assert b.q_precision("auto", "mxfp4") == "bf16" and b.q_precision("fp8", "mxfp4") == "fp8"
    with pytest.raises(SystemExit) as e:
        cli._backend("gpu:2")
    assert e.value.code == 2
    assert "--device gpu:2: expected a device index in [0, 2), got 2" in capsys.readouterr().err


def test_backend_gpu_without_a_gpu_is_an_error(fake_runtime, capsys):
    fake_runtime(0)
    with pytest.raises(SystemExit) as e:
        cli._backend("gpu")
    assert e.value.code == 2 and "--device gpu: no GPU reachable" in capsys.readouterr().err


def test_bad_platform_variable_is_an_error_not_a_fallback(fake_runtime, monkeypatch, capsys):
    fake_runtime(0)
    monkeypatch.setenv("HIPMLA_PLATFORM", "bogus")
    with pytest.raises(SystemExit) as e:
        cli._backend("auto")
    err = capsys.readouterr().err
    assert e.value.code == 2 and "HIPMLA_PLATFORM" in err and "'bogus'" in err
    assert cli._backend("host").arch is None  # the host emulator does not consult it


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("argv, names", [
    (["check", "--sample", "0"], ["--sample", "'0'"]),
    (["check", "--sample", "-3"], ["--sample", "'-3'"]),
    (["check", "--sample", "many"], ["--sample", "'many'"]),
    (["check", "--shapes", "nope"], ["--shapes", "'nope'", "4x1k"]),
    (["check", "--shapes", "4x1k,3x3k"], ["--shapes", "'3x3k'"]),
    (["check", "--shapes", ","], ["--shapes"]),
    (["check", "--device", "cpu"], ["--device", "'cpu'", "--device host"]),
    (["check", "--device", "gpu:x"], ["--device", "'gpu:x'"]),
    (["check", "--device", "gpu:-1"], ["--device", "'gpu:-1'"]),
    (["check", "--seed", "-1"], ["--seed", "'-1'"]),
    (["check", "--format", "int4"], ["--format", "'int4'"]),
    (["check", "--q-precision", "fp16"], ["--q-precision", "'fp16'"]),
    (["profile", "--shape", "bogus"], ["--shape", "'bogus'", "64x8k"]),
    (["profile", "--iters", "0"], ["--iters", "'0'"]),
    (["build", "--jobs", "0"], ["--jobs", "'0'"]),
    (["frobnicate"], ["'frobnicate'"]),
    (["check", "--q-len", "65"], ["--q-len", "[1, 64]", "'65'"]),
    (["bench", "--iters", "0"], ["--iters", "'0'"]),
    (["bench", "--shapes", "4x1k,nope"], ["--shapes", "'nope'", "256x8k"]),
    (["bench", "--page-size", "3"], ["--page-size", "got 3"]),
    (["bench", "--mtp", "--shapes", "4x1k", "--no-torch"], ["--mtp", "--shapes, --no-torch would be ignored"]),
    (["selftest", "--json", "/nonexistent-folder/v.json"], ["--json", "/nonexistent-folder/v.json"]),
])
def test_bad_arguments_name_the_argument(argv, names, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    for name in names:
        assert name in err, err


def test_bad_output_paths_and_platform_get_one_line_not_a_traceback(tmp_path):
    import os

    taken = tmp_path / "a-file"
    taken.write_text("")
    for argv, env, words in ((["build", "--arch", "gfx942", "--out", str(taken)], {}, "hipmla build: "),
                             (["model", "--arch", "gfx942", "--out", str(taken)], {}, "hipmla model: "),
                             (["bench"], {"HIPMLA_PLATFORM": "bogus"}, "HIPMLA_PLATFORM")):
        r = subprocess.run([sys.executable, "-m", "hipmla", *argv], capture_output=True, text=True,
                           timeout=300, env={**os.environ, **env})
        assert r.returncode == 2, (argv, r.stderr)
        assert "Traceback" not in r.stderr and words in r.stderr, (argv, r.stderr)


def test_a_closed_stdout_ends_the_command_quietly():
    r = subprocess.run(f"{sys.executable} -m hipmla check --format all --shapes 4x1k --sample 1 -q | head -c 10; "
                       f"exit ${{PIPESTATUS[0]}}", shell=True, executable="/bin/bash", capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 141 and "Traceback" not in r.stderr, r.stderr


def test_sample_seqs_rejects_non_positive():
    for bad in (0, -3, 1.5, True):
        with pytest.raises(ValueError, match="sample: expected an integer >= 1"):
            cli.sample_seqs(8, bad)


def test_no_traceback_on_bad_input_from_the_shell():
    for argv, env in ((["check", "--sample", "0"], {}), (["check", "--shapes", "4x1k"], {"HIPMLA_PLATFORM": "bogus"}),
                      (["profile", "--shape", "bogus"], {})):
        import os

        r = subprocess.run([sys.executable, "-m", "hipmla", *argv], capture_output=True, text=True,
                           timeout=120, env={**os.environ, **env})
        assert r.returncode == 2, (argv, r.stderr)
        assert "Traceback" not in r.stderr and r.stderr.strip(), (argv, r.stderr)


# ----------------------------------------------------------------------------- helpers


def test_compare_counts_out_of_tolerance_elements():
    ref = np.array([[1.0, 2.0, -1.0, 0.0]], np.float32)
    out = ref + np.array([[0.0, 0.5, 0.0, 0.001]], np.float32)
    lse = np.array([1.0], np.float32)
    max_abs, max_rel, frac, lse_err = cli.compare(out, lse, ref, np.array([1.0]), np.abs(ref), tol=0.01)
    assert max_abs == pytest.approx(0.5)
    assert max_rel == pytest.approx(0.25)
    assert frac == pytest.approx(0.25)
    assert lse_err == 0


def test_compare_counts_nan_as_bad_and_one_sided_empty_lse_as_infinite():
    ref = np.zeros((1, 4), np.float32)
    out = np.array([[0, np.nan, 0, 0]], np.float32)
    _, _, frac, lse_err = cli.compare(out, np.array([-np.inf, 1.0]), ref, np.array([-np.inf, -np.inf]), ref, tol=0.01)
    assert frac == pytest.approx(0.25) and lse_err == np.inf
    row = cli.CheckRow("4x1k", "bf16", "host", "bf16", 1, 0, 0, 0, float("nan"), 0, 1e-3)
    assert not row.ok and row.line().endswith("FAIL(lse)")


def test_sample_spreads_and_clips():
    assert list(cli.sample_seqs(4, None)) == [0, 1, 2, 3]
    assert list(cli.sample_seqs(4, 10)) == [0, 1, 2, 3]
    s = cli.sample_seqs(256, 4)
    assert s[0] == 0 and s[-1] == 255 and len(s) == 4


# ----------------------------------------------------------------------------- progress, logging


class Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


def run_quietly_on(monkeypatch, tty: bool) -> str:
    err = Stream(tty)
    monkeypatch.setattr(sys, "stderr", err)
    assert cli.main(["check", "--device", "host", "--format", "bf16", "--sample", "1",
                     "--shapes", "4x1k,32x1k"]) == 0
    return err.getvalue()


def test_progress_is_one_line_per_step_when_stderr_is_not_a_terminal(monkeypatch, capsys):
    err = run_quietly_on(monkeypatch, tty=False)
    assert "\r" not in err
    steps = [l for l in err.splitlines() if l.startswith("hipmla: [")]
    assert "hipmla: [1/2] 4x1k bf16: generating 1 sequence of 1024 tokens" in steps
    assert "hipmla: [2/2] 32x1k bf16: exact reference" in steps
    assert len(steps) == 6  # 3 steps per row


def test_progress_overwrites_one_status_line_on_a_terminal(monkeypatch, capsys):
    err = run_quietly_on(monkeypatch, tty=True)
    assert err.count("\r") >= 6 and "hipmla: [2/2] 32x1k bf16: exact reference" in err
    assert err.endswith("\r\x1b[K")  # the status line is cleared at the end


def test_quiet_drops_progress(monkeypatch, capsys):
    err = Stream(False)
    monkeypatch.setattr(sys, "stderr", err)
    assert cli.main(["check", "-q", "--device", "host", "--format", "bf16", "--sample", "1",
                     "--shapes", "4x1k"]) == 0
    assert "[1/1]" not in err.getvalue()
    cli.configure_logging()


def test_progress_goes_through_the_hipmla_logger(caplog):
    with caplog.at_level(logging.INFO, logger="hipmla"):
        cli.progress("[1/1] step")
    assert [(r.name, r.getMessage(), r.progress) for r in caplog.records] == [("hipmla", "[1/1] step", True)]


# ----------------------------------------------------------------------------- entry points


def test_version_flag_prints_the_package_version():
    r = subprocess.run([sys.executable, "-m", "hipmla", "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"hipmla {hipmla.__version__}"


def test_module_entry_point_runs():
    r = subprocess.run([sys.executable, "-m", "hipmla", "check", "--device", "host", "--sample", "1",
                        "--shapes", "4x1k", "--format", "bf16"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "1 passed, 0 failed" in r.stdout
    assert "\r" not in r.stderr  # stderr is a pipe here: one line per step


def test_check_takes_heads_and_query_tokens(capsys):
    rc = cli.main(["check", "--device", "host", "--format", "fp8", "--sample", "2", "--shapes", "4x1k",
                   "--heads", "64", "--q-len", "4"])
    out = capsys.readouterr().out
    assert rc == 0 and "64 heads, 4 query tokens per sequence" in out and "1 passed, 0 failed" in out
    (row,) = [r for r in out.splitlines() if r.startswith("4x1k h64q4")]
    assert row.endswith(" ok")


@pytest.mark.parametrize("argv", [["--heads", "48"], ["--q-len", "0"]])
def test_check_refuses_bad_heads_and_query_tokens(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["check", "--device", "host", *argv])
    assert e.value.code == 2 and argv[0] in capsys.readouterr().err
