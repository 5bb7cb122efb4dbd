// llama.cpp's Q4_1 and Q8_0 blocks times activations, on AVX2 and F16C: the kernel that
// blocks_avx2.cpp registers as ops and decode_layer.cpp runs inside its own parallel region.
//
// The blocks are llama.cpp's, byte for byte, one stream of bytes per output row as the file
// stores it. Per 32 weights of a row:
//   block_q4_1  20 bytes: the scale and the minimum as fp16, then 16 bytes of which byte i holds
//               weight i (low nibble) and weight i + 16 (high nibble); W = code * scale + minimum.
//   block_q8_0  34 bytes: the scale as fp16, then 32 signed bytes; W = code * scale.
//
// llama.cpp's scheme: each row of x is quantised per block of 32 to int8 (scale max|x| / 127),
// and each block's dot product with a block of codes is an integer one (maddubs + madd),
// scaled once per block. A Q4_1 block contributes
//   scale_w * scale_x * sum(code * q) + minimum * scale_x * sum(q),
// a Q8_0 block the first term only.
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

// What the kernel needs of a block format: its size, its 32 codes as bytes, its scale, its
// minimum (Q4_1 only), and the integer dot product of its codes with 32 int8 activations as
// eight int32 partial sums.
struct Q4_1 {
  static constexpr int64_t kBytes = 20;  // fp16 scale, fp16 minimum, 16 bytes of codes
  static constexpr bool kHasMinimum = true;
  // The low nibbles (weights 0-15), then the high (16-31), each as a byte 0..15.
  static __m256i codes(const uint8_t* block) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed),
                            _mm256_set1_epi8(0x0F));
  }
  static float minimum(const uint8_t* block) { return half_at(block + 2); }
  // Codes are unsigned, so they are maddubs' unsigned operand as they are.
  static __m256i dot(__m256i c, __m256i a, __m256i ones) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(c, a), ones);
  }
};

struct Q8_0 {
  static constexpr int64_t kBytes = 34;  // fp16 scale, 32 signed bytes of codes
  static constexpr bool kHasMinimum = false;
  static __m256i codes(const uint8_t* block) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
  }
  static float minimum(const uint8_t*) { return 0.f; }
  // maddubs multiplies unsigned by signed bytes: |c| times a with c's sign moved onto it gives
  // the same products. Codes and activations lie in -127..127, so no pair sum saturates int16.
  static __m256i dot(__m256i c, __m256i a, __m256i ones) {
    const __m256i product = _mm256_maddubs_epi16(_mm256_sign_epi8(c, c), _mm256_sign_epi8(a, c));
    return _mm256_madd_epi16(product, ones);
  }
};

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

// Codes, scales and minimums of block b of `count` consecutive rows, the same block `ahead`
// rows on prefetched (see tile).
template <typename F>
inline void load_block(const uint8_t* rows, int64_t row_bytes, int64_t b, int count, int ahead,
                       __m256i* c, float* sw, float* mw) {
  for (int t = 0; t < count; ++t) {
    const uint8_t* block = rows + t * row_bytes + b * F::kBytes;
    _mm_prefetch(reinterpret_cast<const char*>(block + ahead * row_bytes), _MM_HINT_T0);
    c[t] = F::codes(block);
    sw[t] = half_at(block);
    mw[t] = F::minimum(block);
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
void tile(const int8_t* q, const float* d, const float* s, int64_t k, const uint8_t* weights,
          int64_t row_bytes, Out* out, int64_t n) {
  const int64_t blocks = k / kBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][T];
  float offset[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps(), offset[r][t] = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i c[T];
    float sw[T], mw[T];
    load_block<F>(weights, row_bytes, b, T, T, c, sw, mw);
    for (int r = 0; r < R; ++r) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * k + b * kBlock));
      const float da = d[r * blocks + b], sa = s[r * blocks + b];
      for (int t = 0; t < T; ++t) {
        acc[r][t] = add_block<F>(acc[r][t], c[t], a, sw[t] * da, ones);
        if constexpr (F::kHasMinimum) offset[r][t] += mw[t] * sa;
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t)
      out[r * n + t] = static_cast<Out>(horizontal_sum(acc[r][t]) + offset[r][t]);
}

// Output rows [begin, end) for every row of x: T output rows at a time (a T-row stripe of W
// stays in L1 while every group of R rows of x passes over it), the stripe's last rows and
// x's last rows by smaller tiles.
template <typename F, int R, int T, typename Out>
void stripe(const int8_t* q, const float* d, const float* s, int64_t rows, int64_t k,
            const uint8_t* weights, int64_t row_bytes, int64_t begin, int64_t end, Out* out,
            int64_t n) {
  const int64_t blocks = k / kBlock;
  int64_t j = begin;
  for (; j + T <= end; j += T) {
    const uint8_t* w = weights + j * row_bytes;
    int64_t r = 0;
    for (; r + R <= rows; r += R)
      tile<F, R, T>(q + r * k, d + r * blocks, s + r * blocks, k, w, row_bytes, out + r * n + j, n);
    for (; r < rows; ++r)
      tile<F, 1, T>(q + r * k, d + r * blocks, s + r * blocks, k, w, row_bytes, out + r * n + j, n);
  }
  for (; j < end; ++j)
    for (int64_t r = 0; r < rows; ++r)
      tile<F, 1, 1>(q + r * k, d + r * blocks, s + r * blocks, k, weights + j * row_bytes,
                    row_bytes, out + r * n + j, n);
}

// Five rows of x or more, output rows [begin, end): a tile's codes are unpacked once per block
// for all the rows, which outweighs accumulators held in memory (rows * Tile of them). Tile:
// output rows per tile, so Tile independent accumulators per row of x, each block of x loaded
// once for them.
template <typename F, int Tile, typename T>
void many_rows(const int8_t* q, const float* d, const float* s, int64_t rows, int64_t k,
               const uint8_t* weights, int64_t n, T* out, int64_t begin, int64_t end) {
  const int64_t blocks = k / kBlock, row_bytes = blocks * F::kBytes;
  const __m256i ones = _mm256_set1_epi16(1);
  std::vector<__m256> acc(rows * Tile);
  std::vector<float> offset(rows * Tile);
  for (int64_t j0 = begin; j0 < end; j0 += Tile) {
    const int tile = static_cast<int>(std::min<int64_t>(Tile, end - j0));
    std::fill(acc.begin(), acc.end(), _mm256_setzero_ps());
    std::fill(offset.begin(), offset.end(), 0.f);
    for (int64_t b = 0; b < blocks; ++b) {
      __m256i c[Tile];
      float sw[Tile], mw[Tile];
      load_block<F>(weights + j0 * row_bytes, row_bytes, b, tile, Tile, c, sw, mw);
      for (int64_t r = 0; r < rows; ++r) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * k + b * kBlock));
        const float da = d[r * blocks + b], sa = s[r * blocks + b];
        for (int t = 0; t < tile; ++t) {
          acc[r * Tile + t] = add_block<F>(acc[r * Tile + t], c[t], a, sw[t] * da, ones);
          if constexpr (F::kHasMinimum) offset[r * Tile + t] += mw[t] * sa;
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int t = 0; t < tile; ++t)
        out[r * n + j0 + t] =
            static_cast<T>(horizontal_sum(acc[r * Tile + t]) + offset[r * Tile + t]);
  }
}

// Output rows [begin, end) of x @ W.T for every row of x (x quantised: q, d, s), into out
// [rows, n]. Each element is the same whatever range it falls in, so any split of the output
// rows between threads gives the same result.
template <typename F, typename Out>
void multiply_range(const int8_t* q, const float* d, const float* s, int64_t rows, int64_t k,
                    const uint8_t* weights, int64_t n, Out* out, int64_t begin, int64_t end) {
  if (rows > 4) return many_rows<F, 4>(q, d, s, rows, k, weights, n, out, begin, end);
  // Up to 4 rows of x, all in one tile of registers (16 on AVX2: R * T accumulators, T codes).
  const int64_t row_bytes = k / kBlock * F::kBytes;
  switch (rows) {
    case 1: return stripe<F, 1, 4>(q, d, s, rows, k, weights, row_bytes, begin, end, out, n);
    case 2: return stripe<F, 2, 4>(q, d, s, rows, k, weights, row_bytes, begin, end, out, n);
    case 3: return stripe<F, 3, 3>(q, d, s, rows, k, weights, row_bytes, begin, end, out, n);
    default: return stripe<F, 4, 3>(q, d, s, rows, k, weights, row_bytes, begin, end, out, n);
  }
}

template <typename F, typename Out>
void multiply(const int8_t* q, const float* d, const float* s, int64_t rows, int64_t k,
              const uint8_t* weights, int64_t n, Out* out) {
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    multiply_range<F>(q, d, s, rows, k, weights, n, out, begin, end);
  });
}

}  // namespace pdserve::blocks
