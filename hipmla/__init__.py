"""hipmla: MLA decode attention for AMD Instinct GPUs, torch-free.

Layers, bottom up: ``formats`` (KV-cache byte layouts) -> ``reference`` (exact math) ->
``paging`` (token -> cache row) -> ``schedule`` (the device's split into work items) ->
``emulate`` (numpy model of the kernels' numerics) ->
``runtime`` (the one package that talks to hip-python) -> ``kernels`` (HIP sources and
their parameter struct) -> ``buffers`` (device buffer arguments: addresses, CUDA Array
Interface, DLPack; their checks and keys) -> ``decode`` (the decoder API) -> ``cli``.

Importing hipmla never needs ROCm or a GPU; the runtime loads HIP at first use.
"""

from hipmla.decode import Decoder
from hipmla.formats import KVCache, mxfp4_dequantize, mxfp4_quantize, quantize_kv
from hipmla.paging import KvLayout
from hipmla.reference import merge_states, mla_decode_reference

__version__ = "0.1.0"

__all__ = [
    "Decoder",
    "KVCache",
    "KvLayout",
    "merge_states",
    "mla_decode_reference",
    "mxfp4_dequantize",
    "mxfp4_quantize",
    "quantize_kv",
]
