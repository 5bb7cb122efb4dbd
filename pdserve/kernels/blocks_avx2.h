// llama.cpp's Q4_1 and Q8_0 blocks times activations, on AVX2 and F16C: the kernel that
// blocks_avx2.cpp registers as ops and decode_layer.cpp runs inside its own parallel region.
//
// llama.cpp's scheme: each row of x is quantised per block of 32 to int8 (scale max|x| / 127),
// and each block's dot product with a block of weight codes is an integer one (maddubs + madd),
// scaled once per block. Per 32 weights of a row:
//   block_q4_1  20 bytes: the scale and the minimum as fp16, then 16 bytes of which byte i holds
//               weight i (low nibble) and weight i + 16 (high nibble); W = code * scale + minimum.
//               A block contributes scale_w * scale_x * sum(code * q) + minimum * scale_x * sum(q).
//   block_q8_0  34 bytes: the scale as fp16, then 32 signed bytes; W = code * scale.
//
// Both are read interleaved: the same blocks, the bytes of 8 output rows rearranged so that one
// integer instruction serves all 8 (below).
// Every output element sums its blocks in one fixed order, whatever the number of rows in the
// call or the threads that share it: a row's result does not depend on its batch.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace pdserve::blocks {

constexpr int64_t kBlock = 32;

// Rows of x [rows, k] to int8 per block of 32, as llama.cpp rounds them: codes q [rows, k],
// each block's scale d and its scale times the sum of its codes s ([rows, k / 32]; Q4_1's
// minimum term).
template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t k, int8_t* q, float* d, float* s) {
  const int64_t blocks = k / kBlock;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const T* v = x + r * k + b * kBlock;
      float amax = 0.f;
      for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(static_cast<float>(v[i])));
      const float scale = amax / 127.f;
      const float inverse = scale > 0.f ? 1.f / scale : 0.f;
      int sum = 0;
      int8_t* out = q + r * k + b * kBlock;
      for (int i = 0; i < kBlock; ++i) {
        const int code = static_cast<int>(std::nearbyint(static_cast<float>(v[i]) * inverse));
        out[i] = static_cast<int8_t>(code);
        sum += code;
      }
      d[r * blocks + b] = scale;
      s[r * blocks + b] = scale * static_cast<float>(sum);
    }
  }
}

// Rows of x quantised as the kernel takes them (quantize_rows), in buffers sized once for the
// widest matrix a caller multiplies.
struct QuantisedRows {
  std::vector<int8_t> codes;
  std::vector<float> scales, sums;

  void size_for(int64_t rows, int64_t widest) {
    codes.resize(rows * widest);
    scales.resize(rows * widest / kBlock);
    sums.resize(rows * widest / kBlock);
  }

  // Rows [first, last) of x [rows, k] (rows dense), for a matrix of k columns.
  template <typename T>
  void rows_of(const T* x, int64_t k, int64_t first, int64_t last) {
    const int64_t blocks = k / kBlock;
    quantize_rows(x + first * k, last - first, k, codes.data() + first * k,
                  scales.data() + first * blocks, sums.data() + first * blocks);
  }
};

// ---- Blocks interleaved by 8 output rows ----------------------------------------------------
//
// Read row by row, each block of each output row costs an integer dot product reduced to eight
// partial sums, converted to float and scaled on its own (plus Q4_1's minimum term): most of a
// 64-row step's time went to that per-block bookkeeping (8-12 instructions per 32 weights).
// Interleaved, the 32-bit lane t of one vector belongs to output row t of a group of 8: four
// codes of each of the 8 rows sit side by side, an activation's four bytes are broadcast to
// every lane, and maddubs + madd give all 8 rows' sums at once. The bookkeeping is then paid
// once per 8 output rows (on the AVX2 EPYC, 2 threads, SmolLM2's whole decode step: 1.70x
// faster at 16 rows of x, 1.90x at 64, 1.29x at one; docs/measurements.md).
//
// Per group of 8 output rows and block b, F::kBytes bytes: the 8 rows' scales as fp16 (row t at
// 2t), Q4_1's 8 minimums as fp16, then the codes (see each format). Each block's sum is an exact
// integer; it is scaled and added to its row's float sum in block order, and the minimum's term
// likewise, so a row's result does not depend on how many rows share a call.
constexpr int64_t kInterleave = 8;

inline __m256i broadcast4(const int8_t* p) {
  int32_t four;
  std::memcpy(&four, p, sizeof four);
  return _mm256_set1_epi32(four);
}

// Q4_1: after the scales and minimums, four vectors V0-V3 of 32 bytes: byte 4t + j of V_i holds
// row t's code 8i + j in its low nibble and code 8i + 4 + j in its high one. The 8 chunks of 4
// codes add in int16 without overflow (8 * 2 * 15 * 127 < 32768).
struct Q4_1x8 {
  static constexpr int64_t kBytes = kInterleave * 20;
  static constexpr bool kHasMinimum = true;

  // Each of rows R of x (a: the block's first activation of x's first row; rows k apart) times
  // the block's codes: lane t, row t's integer sum.
  template <int R>
  static void dots(const uint8_t* block, const int8_t* a, int64_t k, __m256i* sum) {
    const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256i pairs[R];
    for (int r = 0; r < R; ++r) pairs[r] = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 + 32 * i));
      const __m256i low = _mm256_and_si256(v, nibble);
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
      for (int r = 0; r < R; ++r) {
        const int8_t* x = a + r * k + 8 * i;
        pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(low, broadcast4(x)));
        pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(high, broadcast4(x + 4)));
      }
    }
    for (int r = 0; r < R; ++r) sum[r] = _mm256_madd_epi16(pairs[r], ones);
  }
};

// Q8_0: after the scales, eight vectors C0-C7 of 32 signed bytes: byte 4t + j of C_c holds row
// t's code 4c + j. maddubs takes |code| and the activation with the code's sign; a pair of
// products can reach 2 * 127 * 127, so each chunk widens to int32 before they add.
struct Q8_0x8 {
  static constexpr int64_t kBytes = kInterleave * 34;
  static constexpr bool kHasMinimum = false;

  template <int R>
  static void dots(const uint8_t* block, const int8_t* a, int64_t k, __m256i* sum) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < R; ++r) sum[r] = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16 + 32 * c));
      const __m256i magnitude = _mm256_sign_epi8(codes, codes);
      for (int r = 0; r < R; ++r) {
        const __m256i x = _mm256_sign_epi8(broadcast4(a + r * k + 4 * c), codes);
        sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, x), ones));
      }
    }
  }
};

// Rows R of x (quantised: q, d, s) times one group of 8 output rows, into out[r * n + t].
template <typename F, int R, typename Out>
void interleaved_tile(const int8_t* q, const float* d, const float* s, int64_t k,
                      const uint8_t* group, Out* out, int64_t n) {
  const int64_t blocks = k / kBlock;
  __m256 acc[R], offset[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), offset[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = group + b * F::kBytes;
    __m256i sum[R];
    F::template dots<R>(block, q + b * kBlock, k, sum);
    const __m256 sw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
    for (int r = 0; r < R; ++r) {
      const __m256 scale = _mm256_mul_ps(sw, _mm256_set1_ps(d[r * blocks + b]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]), scale, acc[r]);
    }
    if constexpr (F::kHasMinimum) {
      const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16)));
      for (int r = 0; r < R; ++r)
        offset[r] = _mm256_add_ps(offset[r], _mm256_mul_ps(mw, _mm256_set1_ps(s[r * blocks + b])));
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float sums[kInterleave];
    _mm256_store_ps(sums, F::kHasMinimum ? _mm256_add_ps(acc[r], offset[r]) : acc[r]);
    for (int t = 0; t < kInterleave; ++t) out[r * n + t] = static_cast<Out>(sums[t]);
  }
}

// Groups [begin, end) of 8 output rows of x @ W.T for every row of x, W interleaved ([n / 8,
// blocks * F::kBytes]), into out [rows, n]. A group's bytes stay in L1 while every four rows of
// x pass over them.
template <typename F, typename Out>
void multiply_interleaved_range(const int8_t* q, const float* d, const float* s, int64_t rows,
                                int64_t k, const uint8_t* weights, int64_t n, Out* out,
                                int64_t begin, int64_t end) {
  const int64_t blocks = k / kBlock, group_bytes = blocks * F::kBytes;
  for (int64_t g = begin; g < end; ++g) {
    const uint8_t* group = weights + g * group_bytes;
    Out* column = out + g * kInterleave;
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4)
      interleaved_tile<F, 4>(q + r * k, d + r * blocks, s + r * blocks, k, group, column + r * n, n);
    for (; r < rows; ++r)
      interleaved_tile<F, 1>(q + r * k, d + r * blocks, s + r * blocks, k, group, column + r * n, n);
  }
}

}  // namespace pdserve::blocks
