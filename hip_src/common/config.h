// Shapes and codes shared by every hipmla kernel; hipmla/kernels.py mirrors them.
#pragma once

namespace hipmla {

constexpr int HEADS = 16;         // query heads; a compile-time constant so loops unroll over it
constexpr int D_QK = 576;         // 512 latent + 64 rope
constexpr int D_V = 512;          // V is the first D_V columns of a KV row
constexpr int TILE_TOKENS = 64;   // online-softmax tile: the running max moves once per tile
constexpr int BLOCK_THREADS = 256;
constexpr int MX_BLOCK = 32;      // elements per E8M0 scale
// Most kv tokens a sequence may have: every kernel counts an item's tokens, tiles and loop
// bounds in int32, and with 2^30 no such sum (n + a tile, a tile index times its size) can
// wrap. Longer sequences are refused on the host and flagged (ERR_BOUNDS) on the device.
constexpr int MAX_SEQ_TOKENS = 1 << 30;

// Values of the -D defines HIPMLA_KV_FORMAT and HIPMLA_Q_PRECISION.
constexpr int FORMAT_BF16 = 0;
constexpr int FORMAT_FP8 = 1;
constexpr int FORMAT_MXFP4 = 2;

}  // namespace hipmla
