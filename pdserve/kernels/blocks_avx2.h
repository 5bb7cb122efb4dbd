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
// Q8_0 (the output head) is read as the file stores it, one stream of bytes per output row.
// Q4_1 (every layer's matrices) is read interleaved: the same blocks, the bytes of 8 output rows
// rearranged so that one integer instruction serves all 8 (see Q4_1 interleaved below).
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

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return _cvtsh_ss(bits);
}

// Q8_0's block: its 32 codes, and their integer dot product with 32 int8 activations as eight
// int32 partial sums.
struct Q8_0 {
  static constexpr int64_t kBytes = 34;  // fp16 scale, 32 signed bytes of codes
  static __m256i codes(const uint8_t* block) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
  }
  // maddubs multiplies unsigned by signed bytes: |c| times a with c's sign moved onto it gives
  // the same products. Codes and activations lie in -127..127, so no pair sum saturates int16.
  static __m256i dot(__m256i c, __m256i a, __m256i ones) {
    const __m256i product = _mm256_maddubs_epi16(_mm256_sign_epi8(c, c), _mm256_sign_epi8(a, c));
    return _mm256_madd_epi16(product, ones);
  }
};

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

inline float horizontal_sum(__m256 v) {
  __m128 low = _mm256_castps256_ps128(v);
  low = _mm_add_ps(low, _mm256_extractf128_ps(v, 1));
  low = _mm_add_ps(low, _mm_movehl_ps(low, low));
  low = _mm_add_ss(low, _mm_shuffle_ps(low, low, 1));
  return _mm_cvtss_f32(low);
}

// ---- Q8_0, one row of blocks after another -------------------------------------------------

// Codes and scales of block b of `count` consecutive rows, the same block `ahead` rows on
// prefetched (see tile).
template <typename F>
inline void load_block(const uint8_t* rows, int64_t row_bytes, int64_t b, int count, int ahead,
                       __m256i* c, float* sw) {
  for (int t = 0; t < count; ++t) {
    const uint8_t* block = rows + t * row_bytes + b * F::kBytes;
    _mm_prefetch(reinterpret_cast<const char*>(block + ahead * row_bytes), _MM_HINT_T0);
    c[t] = F::codes(block);
    sw[t] = half_at(block);
  }
}

// acc + (the integer dot product of codes c and activations a) * scale, lane by lane.
template <typename F>
inline __m256 add_block(__m256 acc, __m256i c, __m256i a, float scale, __m256i ones) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(F::dot(c, a, ones)), _mm256_set1_ps(scale), acc);
}

// Rows R of x (quantised) times output rows T of W, over every block. R and T are constants
// so that the R * T accumulators stay in registers: held in memory, every multiply-add would
// wait on a store and a load, which made a batch-1 pass twice as slow as torch's kernel once
// the weights no longer sat in the cache. Each accumulator adds its blocks in order 0, 1, ...
// whatever R and T are, so a row's result does not depend on its tile.
// Each block's bytes of the next stripe (T rows on) are prefetched: the hardware's prefetchers
// alone left a batch-1 pass 1.4x slower than with it (SmolLM2's 53 MB of layers, one thread).
// A prefetch past the end of the weights is only a hint, and never faults.
template <typename F, int R, int T, typename Out>
void tile(const int8_t* q, const float* d, int64_t k, const uint8_t* weights, int64_t row_bytes,
          Out* out, int64_t n) {
  const int64_t blocks = k / kBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i c[T];
    float sw[T];
    load_block<F>(weights, row_bytes, b, T, T, c, sw);
    for (int r = 0; r < R; ++r) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * k + b * kBlock));
      const float da = d[r * blocks + b];
      for (int t = 0; t < T; ++t) acc[r][t] = add_block<F>(acc[r][t], c[t], a, sw[t] * da, ones);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) out[r * n + t] = static_cast<Out>(horizontal_sum(acc[r][t]));
}

// Output rows [begin, end) for every row of x: T output rows at a time (a T-row stripe of W
// stays in L1 while every group of R rows of x passes over it), the stripe's last rows and
// x's last rows by smaller tiles.
template <typename F, int R, int T, typename Out>
void stripe(const int8_t* q, const float* d, int64_t rows, int64_t k, const uint8_t* weights,
            int64_t row_bytes, int64_t begin, int64_t end, Out* out, int64_t n) {
  const int64_t blocks = k / kBlock;
  int64_t j = begin;
  for (; j + T <= end; j += T) {
    const uint8_t* w = weights + j * row_bytes;
    int64_t r = 0;
    for (; r + R <= rows; r += R)
      tile<F, R, T>(q + r * k, d + r * blocks, k, w, row_bytes, out + r * n + j, n);
    for (; r < rows; ++r) tile<F, 1, T>(q + r * k, d + r * blocks, k, w, row_bytes, out + r * n + j, n);
  }
  for (; j < end; ++j)
    for (int64_t r = 0; r < rows; ++r)
      tile<F, 1, 1>(q + r * k, d + r * blocks, k, weights + j * row_bytes, row_bytes, out + r * n + j, n);
}

// Five rows of x or more, output rows [begin, end): a tile's codes are unpacked once per block
// for all the rows, which outweighs accumulators held in memory (rows * Tile of them). Tile:
// output rows per tile, so Tile independent accumulators per row of x, each block of x loaded
// once for them.
template <typename F, int Tile, typename T>
void many_rows(const int8_t* q, const float* d, int64_t rows, int64_t k, const uint8_t* weights,
               int64_t n, T* out, int64_t begin, int64_t end) {
  const int64_t blocks = k / kBlock, row_bytes = blocks * F::kBytes;
  const __m256i ones = _mm256_set1_epi16(1);
  std::vector<__m256> acc(rows * Tile);
  for (int64_t j0 = begin; j0 < end; j0 += Tile) {
    const int tile = static_cast<int>(std::min<int64_t>(Tile, end - j0));
    std::fill(acc.begin(), acc.end(), _mm256_setzero_ps());
    for (int64_t b = 0; b < blocks; ++b) {
      __m256i c[Tile];
      float sw[Tile];
      load_block<F>(weights + j0 * row_bytes, row_bytes, b, tile, Tile, c, sw);
      for (int64_t r = 0; r < rows; ++r) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * k + b * kBlock));
        const float da = d[r * blocks + b];
        for (int t = 0; t < tile; ++t)
          acc[r * Tile + t] = add_block<F>(acc[r * Tile + t], c[t], a, sw[t] * da, ones);
      }
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int t = 0; t < tile; ++t)
        out[r * n + j0 + t] = static_cast<T>(horizontal_sum(acc[r * Tile + t]));
  }
}

// Output rows [begin, end) of x @ W.T for every row of x (x quantised: q, d), into out
// [rows, n]. Each element is the same whatever range it falls in, so any split of the output
// rows between threads gives the same result.
template <typename F, typename Out>
void multiply_range(const int8_t* q, const float* d, int64_t rows, int64_t k,
                    const uint8_t* weights, int64_t n, Out* out, int64_t begin, int64_t end) {
  if (rows > 4) return many_rows<F, 4>(q, d, rows, k, weights, n, out, begin, end);
  // Up to 4 rows of x, all in one tile of registers (16 on AVX2: R * T accumulators, T codes).
  const int64_t row_bytes = k / kBlock * F::kBytes;
  switch (rows) {
    case 1: return stripe<F, 1, 4>(q, d, rows, k, weights, row_bytes, begin, end, out, n);
    case 2: return stripe<F, 2, 4>(q, d, rows, k, weights, row_bytes, begin, end, out, n);
    case 3: return stripe<F, 3, 3>(q, d, rows, k, weights, row_bytes, begin, end, out, n);
    default: return stripe<F, 4, 3>(q, d, rows, k, weights, row_bytes, begin, end, out, n);
  }
}

// ---- Q4_1 interleaved by 8 output rows -------------------------------------------------------
//
// Read row by row, each block of each output row costs an integer dot product reduced to eight
// partial sums, converted to float and scaled on its own, plus the minimum's term: most of a
// 64-row step's time went to that per-block bookkeeping (8-12 instructions per 32 weights).
// Interleaved, the 32-bit lane t of one vector belongs to output row t of a group of 8: four
// codes of each of the 8 rows sit side by side, an activation's four bytes are broadcast to
// every lane, and maddubs + madd give all 8 rows' sums at once. The bookkeeping is then paid
// once per 8 output rows (on the AVX2 EPYC, one thread, SmolLM2's 30 layers: 2.0x faster at 16
// and 64 rows of x, 2.7x at one).
//
// Per group of 8 output rows and block b, kInterleavedBytes bytes:
//   0-15    the 8 rows' scales as fp16 (row t at 2t)
//   16-31   the 8 rows' minimums as fp16
//   32-159  four vectors V0-V3 of 32 bytes: byte 4t + j of V_i holds row t's code 8i + j in its
//           low nibble and code 8i + 4 + j in its high one.
// Each block's sum is an exact integer (the 8 chunks of 4 codes add in int16 without overflow:
// 8 * 2 * 15 * 127 < 32768); it is scaled and added to its row's float sum in block order, and
// the minimum's term likewise, so a row's result does not depend on how many rows share a call.
constexpr int64_t kInterleave = 8;
constexpr int64_t kInterleavedBytes = kInterleave * 20;

inline __m256i broadcast4(const int8_t* p) {
  int32_t four;
  std::memcpy(&four, p, sizeof four);
  return _mm256_set1_epi32(four);
}

// Rows R of x (quantised: q, d, s) times one group of 8 output rows, into out[r * n + t].
template <int R, typename Out>
void interleaved_tile(const int8_t* q, const float* d, const float* s, int64_t k,
                      const uint8_t* group, Out* out, int64_t n) {
  const int64_t blocks = k / kBlock;
  const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(0x0F);
  __m256 acc[R], offset[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), offset[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = group + b * kInterleavedBytes;
    __m256i sum[R];
    for (int r = 0; r < R; ++r) sum[r] = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 + 32 * i));
      const __m256i low = _mm256_and_si256(v, nibble);
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
      for (int r = 0; r < R; ++r) {
        const int8_t* a = q + r * k + b * kBlock + 8 * i;
        sum[r] = _mm256_add_epi16(sum[r], _mm256_maddubs_epi16(low, broadcast4(a)));
        sum[r] = _mm256_add_epi16(sum[r], _mm256_maddubs_epi16(high, broadcast4(a + 4)));
      }
    }
    const __m256 sw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
    const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16)));
    for (int r = 0; r < R; ++r) {
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum[r], ones));
      acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(sw, _mm256_set1_ps(d[r * blocks + b])), acc[r]);
      offset[r] = _mm256_add_ps(offset[r], _mm256_mul_ps(mw, _mm256_set1_ps(s[r * blocks + b])));
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float sums[kInterleave];
    _mm256_store_ps(sums, _mm256_add_ps(acc[r], offset[r]));
    for (int t = 0; t < kInterleave; ++t) out[r * n + t] = static_cast<Out>(sums[t]);
  }
}

// Groups [begin, end) of 8 output rows of x @ W.T for every row of x, W interleaved ([n / 8,
// blocks * kInterleavedBytes]), into out [rows, n]. A group's bytes stay in L1 while every
// four rows of x pass over them.
template <typename Out>
void multiply_interleaved_range(const int8_t* q, const float* d, const float* s, int64_t rows,
                                int64_t k, const uint8_t* weights, int64_t n, Out* out,
                                int64_t begin, int64_t end) {
  const int64_t blocks = k / kBlock, group_bytes = blocks * kInterleavedBytes;
  for (int64_t g = begin; g < end; ++g) {
    const uint8_t* group = weights + g * group_bytes;
    Out* column = out + g * kInterleave;
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4)
      interleaved_tile<4>(q + r * k, d + r * blocks, s + r * blocks, k, group, column + r * n, n);
    for (; r < rows; ++r)
      interleaved_tile<1>(q + r * k, d + r * blocks, s + r * blocks, k, group, column + r * n, n);
  }
}

}  // namespace pdserve::blocks
