"""``python -m hipmla``: the check command on the host emulator, and argument errors."""

import subprocess
import sys

import numpy as np
import pytest

from hipmla import cli


def test_check_prints_a_row_per_shape_and_passes(capsys):
    rc = cli.main(["check", "--device", "host", "--format", "all", "--sample", "2",
                   "--shapes", "4x1k,32x1k"])
    out = capsys.readouterr().out
    rows = [l for l in out.splitlines() if l.strip().startswith(("4x1k", "32x1k"))]
    assert rc == 0
    assert len(rows) == 6  # 2 shapes x 3 formats
    assert "6 passed, 0 failed" in out
    for row in rows:
        max_abs = float(row.split()[5])
        assert 0 < max_abs < 0.05  # bf16 Q: errors are small but never exactly zero


def test_check_rejects_unknown_shape():
    with pytest.raises(SystemExit, match="--shapes"):
        cli.main(["check", "--device", "host", "--shapes", "3x3k"])


def test_compare_counts_out_of_tolerance_elements():
    ref = np.array([[1.0, 2.0, -1.0, 0.0]], np.float32)
    out = ref + np.array([[0.0, 0.5, 0.0, 0.001]], np.float32)
    lse = np.array([1.0], np.float32)
    max_abs, max_rel, frac, lse_err = cli.compare(out, lse, ref, np.array([1.0]), tol=0.01)
    assert max_abs == pytest.approx(0.5)
    assert max_rel == pytest.approx(0.25)
    assert frac == pytest.approx(0.25)
    assert lse_err == 0


def test_sample_spreads_and_clips():
    assert list(cli.sample_seqs(4, None)) == [0, 1, 2, 3]
    assert list(cli.sample_seqs(4, 10)) == [0, 1, 2, 3]
    s = cli.sample_seqs(256, 4)
    assert s[0] == 0 and s[-1] == 255 and len(s) == 4


def test_module_entry_point_runs():
    r = subprocess.run([sys.executable, "-m", "hipmla", "check", "--device", "host", "--sample", "1",
                        "--shapes", "4x1k", "--format", "bf16"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "1 passed, 0 failed" in r.stdout
