// AMX tiles (Intel Xeon from Sapphire Rapids on) for the products with bfloat16 tokens: block-FP8 weights (the tile
// path of fp8_linear and moe_experts_fp8), bfloat16 experts (moe_experts), the indexer's pool scores
// (indexer.cpp's score_pools_tiles: the pooled keys as the rows, the query's heads as the tokens), the MLA's
// per-head products (sparse_mla.cpp's head_products: the weights prepacked as B tiles, the tokens as the rows) and
// its sparse attention (sparse_mla.cpp's attend_tiles: scores and update as products of 2 x 2 tile blocks).
//
// The avx512 build's bfloat16 pairs (gemv.h) multiply a widened row tile with 16 tokens one column pair and one
// vdpbf16ps at a time: 16 weights x 16 tokens per instruction. On an Intel Xeon with AMX that runs about one
// instruction a cycle, so at 16 tokens fp8_linear multiplied ~3 G weights a second on a core that reads 15 GB/s
// from memory (benchmarks/README.md). One tdpbf16ps multiplies a 16-row x 32-column tile of the same widened rows
// with 16 tokens (16 x 16 x 32 products, ~16 cycles), so the products no longer bound the tile path, whatever the
// token count up to a group's 16: the tile path then runs from far fewer tokens than the pairs' 13 (gemv.h's
// pairs_direct_max). What bounds it instead is getting the widened rows into the tiles: a tile load waits for the
// vector stores that just wrote its rows (~79 cycles a product against ~22), and each row's E4M3 bytes arrive 128
// at a time per column block (benchmarks/README.md, Design record; the runs: "What bounds the FP8 kernels" in its
// history, git show 5988aee:benchmarks/README.md); a cheaper conversion (GFNI) barely moved it.
//
// The operands are the pairs path's, unchanged: A = the row tile (16 rows of E4M3 values * 2^-8 as bfloat16 in
// unpack order, e4m3_unpacked), B = the token pairs across the lanes (token_pairs_across_lanes: per pair of
// positions a 64-byte row of 16 tokens, which is the VNNI layout tdpbf16ps takes), C = 16 rows x 16 tokens of
// float32, stored once per column block and added to the running sums times the block's scale, as the pairs path
// does. tdpbf16ps rounds as vdpbf16ps does (exact products, float32 sums, inputs and results below 2^-126 flushed
// to zero); only the order of the sums differs.
//
// bfloat16 weights need no conversion: their rows are the A tiles as they lie in memory, against the tokens' column
// pairs in order (amx_rows_by_pairs; moe.cpp's experts_bf16_amx).
//
// The tiles need the CPU's AMX-TILE and AMX-BF16 and the kernel's leave to use their state (Linux's
// arch_prctl(ARCH_REQ_XCOMP_PERM), asked for once). amx_tiles() says whether the kernels use them; the op of the
// same name turns them off (VLLM_GLM53_CPU_AMX=0, and the tests, which check both paths on such a CPU). Each use
// configures the tiles (oneDNN's GEMMs configure their own on the same threads in between) and releases them.
#pragma once

#include <atomic>

#include "vec.h"

#if GLM53_AVX512 && !defined(GLM53_EMULATED_AVX512)
#include <sys/syscall.h>
#include <unistd.h>
#define GLM53_HAS_AMX 1
#define GLM53_AMX __attribute__((target("amx-tile,amx-bf16")))
#else
#define GLM53_HAS_AMX 0  // avx2, portable, and the emulated avx512 build (tests)
#endif

namespace glm53 {

// Whether this CPU and OS let the kernels use AMX bfloat16 tiles (asks the OS for the tile state once).
inline bool amx_supported() {
#if GLM53_HAS_AMX
  static const bool ok = [] {
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16")) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;  // <asm/prctl.h>, the XTILEDATA state component
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

inline std::atomic<bool>& amx_switch() {
  static std::atomic<bool> on{amx_supported()};
  return on;
}

// Whether the kernels multiply on AMX tiles now.
inline bool amx_tiles() { return amx_switch().load(std::memory_order_relaxed); }

// Turns the tiles on (where amx_supported()) or off; returns amx_tiles().
inline bool set_amx_tiles(bool on) {
  amx_switch().store(on && amx_supported(), std::memory_order_relaxed);
  return amx_tiles();
}

#if GLM53_HAS_AMX
// Tiles 0 and 1 (and 6 and 7, for amx_block_2x2): C, 16 rows x 16 float32; tiles 2 and 3: A, 16 rows x 32
// bfloat16; tiles 4 and 5: B, 16 pairs x 16 tokens. Two of each, so consecutive products use different tiles (tile
// registers are not renamed: a load into a tile waits for the product reading it). A constant in memory: GCC 12's
// _tile_loadconfig tells the compiler it reads only the first 8 bytes of its operand, so a configuration built on the
// stack lost its other stores (and the first tile instruction faulted).
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
inline constexpr TileConfig kTileConfig = {1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64},
                                           {16, 16, 16, 16, 16, 16, 16, 16}};

GLM53_AMX inline void amx_configure() { _tile_loadconfig(&kTileConfig); }
GLM53_AMX inline void amx_release() { _tile_release(); }

// (GCC's tile intrinsics paste their tile numbers into the instruction's text: literals only, hence the branches.)
template <int C>
[[gnu::always_inline]] GLM53_AMX inline void amx_zero() {
  if constexpr (C == 0) _tile_zero(0);
  else _tile_zero(1);
}

// C += 16 bfloat16 rows (``row_bytes`` apart, 32 values each from ``rows``) times 16 tokens' pairs of those 32
// positions (``x``: 16 rows of 16 pairs, token_pairs_across_lanes' layout), on the A and B tiles of parity P.
template <int C, int P>
[[gnu::always_inline]] GLM53_AMX inline void amx_product(const c10::BFloat16* rows, int64_t row_bytes,
                                                         const uint32_t* x) {
  constexpr int64_t kPairRow = kLanes * sizeof(uint32_t);
  if constexpr (P == 0) {
    _tile_loadd(2, rows, row_bytes);
    _tile_loadd(4, x, kPairRow);
    if constexpr (C == 0) _tile_dpbf16ps(0, 2, 4);
    else _tile_dpbf16ps(1, 2, 4);
  } else {
    _tile_loadd(3, rows, row_bytes);
    _tile_loadd(5, x, kPairRow);
    if constexpr (C == 0) _tile_dpbf16ps(0, 3, 5);
    else _tile_dpbf16ps(1, 3, 5);
  }
}

template <int C>
[[gnu::always_inline]] GLM53_AMX inline void amx_store(float (*c)[kLanes]) {
  if constexpr (C == 0) _tile_stored(0, c, kLanes * sizeof(float));
  else _tile_stored(1, c, kLanes * sizeof(float));
}

// c0 = rows0 . x and, with rows1, c1 = rows1 . x over len columns (a multiple of 32): 16 bfloat16 rows each,
// ``row_bytes`` apart, loaded into the A tiles as they lie in memory (a bfloat16 weight needs no conversion), x
// 16 tokens' column pairs in order (B: token_pairs_in_order's layout). Two row sets (an expert's gate and up rows)
// share each load of the tokens. The tiles must be configured (amx_configure).
GLM53_AMX inline void amx_rows_by_pairs(const c10::BFloat16* rows0, const c10::BFloat16* rows1, int64_t row_bytes,
                                        const uint32_t* x, int64_t len, float (*c0)[kLanes], float (*c1)[kLanes]) {
  constexpr int64_t kPairRow = kLanes * sizeof(uint32_t);
  _tile_zero(0);
  if (rows1 != nullptr) {
    _tile_zero(1);
    for (int64_t p = 0; p < len; p += 32) {
      _tile_loadd(4, x + p / 2 * kLanes, kPairRow);
      _tile_loadd(2, rows0 + p, row_bytes);
      _tile_loadd(3, rows1 + p, row_bytes);
      _tile_dpbf16ps(0, 2, 4);
      _tile_dpbf16ps(1, 3, 4);
    }
    _tile_stored(1, c1, kLanes * sizeof(float));
  } else {
    for (int64_t p = 0; p < len; p += 32) {
      _tile_loadd(4, x + p / 2 * kLanes, kPairRow);
      _tile_loadd(2, rows0 + p, row_bytes);
      _tile_dpbf16ps(0, 2, 4);
    }
  }
  _tile_stored(0, c0, kLanes * sizeof(float));
}

// c0 = rows . x0 and c1 = rows . x1 over len columns (a multiple of 32): one set of 16 bfloat16 rows as in
// amx_rows_by_pairs, two blocks of 16 tokens' column pairs (x0, x1: token_pairs_in_order's layout) sharing each load
// of the rows, the two sums in separate C tiles. The tiles must be configured (amx_configure).
GLM53_AMX inline void amx_rows_by_two_pairs(const c10::BFloat16* rows, int64_t row_bytes, const uint32_t* x0,
                                            const uint32_t* x1, int64_t len, float (*c0)[kLanes],
                                            float (*c1)[kLanes]) {
  constexpr int64_t kPairRow = kLanes * sizeof(uint32_t);
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t p = 0; p < len; p += 32) {
    _tile_loadd(2, rows + p, row_bytes);
    _tile_loadd(4, x0 + p / 2 * kLanes, kPairRow);
    _tile_loadd(5, x1 + p / 2 * kLanes, kPairRow);
    _tile_dpbf16ps(0, 2, 4);
    _tile_dpbf16ps(1, 2, 5);
  }
  _tile_stored(0, c0, kLanes * sizeof(float));
  _tile_stored(1, c1, kLanes * sizeof(float));
}

// A 2 x 2 block of products: c[i][j] (16 rows x 16 float32, ``c_bytes`` apart) = a_i . b_j over ``steps`` products
// (kAdd: += onto the sums in c, kept in memory between calls), where a_i is 16 rows of 32 bfloat16 values (``a_bytes``
// apart, the next step's 32 values after them) and b_j 16 rows of 16 pairs (``b_bytes`` apart, the next step's 16 rows
// after them). Each A load feeds two products, each B load two. The tiles must be configured (amx_configure).
template <bool kAdd>
GLM53_AMX inline void amx_block_2x2(const c10::BFloat16* a0, const c10::BFloat16* a1, int64_t a_bytes,
                                    const uint32_t* b0, const uint32_t* b1, int64_t b_bytes, int64_t steps, float* c00,
                                    float* c01, float* c10, float* c11, int64_t c_bytes) {
  const int64_t b_step = 16 * b_bytes / static_cast<int64_t>(sizeof(uint32_t));
  if constexpr (kAdd) {
    _tile_loadd(0, c00, c_bytes);
    _tile_loadd(1, c01, c_bytes);
    _tile_loadd(6, c10, c_bytes);
    _tile_loadd(7, c11, c_bytes);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(6);
    _tile_zero(7);
  }
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, b0 + s * b_step, b_bytes);
    _tile_loadd(5, b1 + s * b_step, b_bytes);
    _tile_loadd(2, a0 + s * 32, a_bytes);
    _tile_loadd(3, a1 + s * 32, a_bytes);
    _tile_dpbf16ps(0, 2, 4);
    _tile_dpbf16ps(1, 2, 5);
    _tile_dpbf16ps(6, 3, 4);
    _tile_dpbf16ps(7, 3, 5);
  }
  _tile_stored(0, c00, c_bytes);
  _tile_stored(1, c01, c_bytes);
  _tile_stored(6, c10, c_bytes);
  _tile_stored(7, c11, c_bytes);
}
#endif

}  // namespace glm53
