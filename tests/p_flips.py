"""The bound a kernel's output keeps against the emulator where its tensor cores (or its
CPU harness's stand-ins) sum the scores in another order than the emulator's f64 dot:
the self-test's comparison, but for a few outputs moved by a P rounded to the other bf16
neighbour (tests/test_sm90_rows64.py::test_the_p_flip_allowance_is_narrow)."""

from __future__ import annotations

import numpy as np

from hipmla import selftest

#: Outputs that may pass the self-test's bound in one ragged batch, each within one P flip.
P_FLIP_OUTPUTS = 16


def assert_within_p_flips(out, lse, emu_out, emu_lse, v_max: float, what: str) -> None:
    """The self-test's comparison (selftest.compare), but for at most P_FLIP_OUTPUTS
    outputs within what one P rounded to the other bf16 neighbour moves an output: the
    tensor cores sum Q.K in another order than the emulator's f64 dot (the 64-row kernel
    also adds two warpgroups' halves), so a P near a rounding boundary may round the other way; that
    moves o by at most 2^-7 p |v - o| / l <= 2^-6 max|V|, and the most in short sequences
    of large V (tests measured it: 2 outputs of 737,280, 0.125 at max|emu| 24)."""
    result = selftest.compare(out, lse, emu_out, emu_lse)
    if result.passed:
        return
    o, e = out.astype(np.float32), emu_out.astype(np.float32)
    scale = float(np.abs(e).max(initial=0)) or 1.0
    err = np.nan_to_num(np.abs(o - e), nan=np.inf)
    past = ~(err <= selftest.EMU_RTOL * np.abs(e) + selftest.EMU_ATOL * scale)
    assert "LSE" not in result.failure, f"{what}: {result.failure}"
    assert past.sum() <= P_FLIP_OUTPUTS, f"{what}: {result.failure}"
    assert (err[past] <= selftest.EMU_RTOL * np.abs(e[past]) + 2.0 ** -6 * v_max).all(), f"{what}: {result.failure}"
