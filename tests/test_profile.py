"""rocprofv3 wrapper: the command it composes and the summary it prints (ROCm not needed)."""

import sys
from pathlib import Path

import pytest

from hipmla import profile


def test_command_profiles_one_shape_through_bench(tmp_path):
    cmd = profile.rocprof_command("64x8k", "fp8", tmp_path, iters=7)
    assert cmd[0] == "rocprofv3"
    assert "--kernel-trace" in cmd and "--stats" in cmd
    assert cmd[cmd.index("-d") + 1] == str(tmp_path)
    tail = cmd[cmd.index("--") + 1:]
    assert tail[:3] == [sys.executable, "-m", "hipmla"]
    assert tail[3] == "bench"
    assert tail[tail.index("--format") + 1] == "fp8"
    assert tail[tail.index("--shapes") + 1] == "64x8k"
    assert tail[tail.index("--iters") + 1] == "7"


def test_summary_lists_hipmla_kernels_first(tmp_path: Path):
    csv = tmp_path / "kernel_stats.csv"
    csv.write_text(
        "Name,Calls,TotalDurationNs,AverageNs,Percentage\n"
        "__amd_rocclr_fillBufferAligned,20,40000,2000,10\n"
        "hipmla_decode_split_mxfp4_qbf16,20,300000,15000,80\n"
        "hipmla_decode_split_gfx950_mxfp4_qfp8,20,60000,3000,10\n"
    )
    lines = profile.summarize(csv).splitlines()
    assert lines[1].startswith("hipmla_decode_split_gfx950_mxfp4_qfp8")
    assert lines[2].startswith("hipmla_decode_split_mxfp4_qbf16")
    assert "15.0" in lines[2] and "300.0" in lines[2]
    assert lines[3].startswith("__amd_rocclr")


def test_without_rocprof_it_says_so(capsys, monkeypatch):
    monkeypatch.setattr(profile.shutil, "which", lambda name: None)
    assert profile.main(["--shape", "4x1k"]) == 2
    assert "rocprofv3 not found" in capsys.readouterr().err


@pytest.mark.parametrize("argv, names", [
    (["--shape", "bogus"], ["--shape", "'bogus'", "64x8k"]),
    (["--shape", "4x1k,4x8k"], ["--shape"]),
    (["--iters", "0"], ["--iters", "'0'"]),
    (["--iters", "lots"], ["--iters", "'lots'"]),
    (["--format", "int4"], ["--format", "'int4'"]),
])
def test_bad_arguments_name_the_argument(argv, names, capsys):
    with pytest.raises(SystemExit) as e:
        profile.main(argv + ["--dry-run"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    for name in names:
        assert name in err


def test_dry_run_takes_every_benchmark_shape(capsys):
    from hipmla.inputs import benchmark_shapes

    for shape in benchmark_shapes():
        assert profile.main(["--shape", shape.name, "--dry-run"]) == 0
        assert f"--shapes {shape.name}" in capsys.readouterr().out
