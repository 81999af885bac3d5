"""The peer: a plain torch bf16 decode (two batched matmuls and a softmax) on the same
inputs, timed as the decoder is (L2 flushed, CUDA events)."""

from __future__ import annotations

import numpy as np

from hipmla.bench.probes import Timer, torch_gpu, torch_median_us
from hipmla.inputs import BENCH_SM_SCALE


def torch_peer(q_np: np.ndarray, kv_bits: np.ndarray, lens: np.ndarray, timer: Timer, iters: int):
    """Median flushed time (us) of a plain torch bf16 decode, or None without torch/uniform lengths."""
    torch = torch_gpu()
    if torch is None or len(set(lens.tolist())) != 1:
        return None
    b, L = lens.shape[0], int(lens[0])
    dev = torch.device("cuda")
    q = torch.from_numpy(q_np.view(np.int16)).to(dev).view(torch.bfloat16)
    kv = torch.from_numpy(kv_bits[: b * L].view(np.int16)).to(dev).view(torch.bfloat16).view(b, L, 576)
    v = kv[..., :512]

    def run():
        s = torch.bmm(q, kv.transpose(1, 2)).float() * BENCH_SM_SCALE
        p = torch.softmax(s, dim=-1).to(torch.bfloat16)
        return torch.bmm(p, v)

    flush = torch.empty(timer.flush_buf.nbytes, dtype=torch.uint8, device=dev)
    return torch_median_us(torch, run, iters, before=flush.zero_)
