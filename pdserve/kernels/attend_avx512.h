// attend_group_fixed (step_kernels.h) in AVX-512 registers, on CPUs that have them: the same
// bits in fewer instructions. The library is built for AVX2; these functions alone are compiled
// for AVX-512 and are called only where the CPU reports it (wide_attention_here).
//
// Why the bits are the same: a 16-lane register here holds the two 8-lane vectors i and i + 1
// that the AVX2 kernel keeps apart, and every lane gets the same multiply-adds in the same order.
//   - A token's score: the AVX2 kernel sums even vectors in a0 and odd ones in a1, then adds
//     a1 to a0. Here one register sums both (a0 low, a1 high) and its halves are added.
//   - A lane of the output: the sum over the tokens, in token order, as there. Only the number
//     of passes over a block differs: with 32 registers every head's output stays in registers
//     in one pass, where AVX2's 16 took two vectors per pass.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>

namespace pdserve::step {

// Tests and benchmarks turn this off to run the AVX2 kernel on the same machine
// (torch.ops.pdserve.set_wide_attention).
inline std::atomic<bool> wide_attention_wanted{true};

inline bool wide_attention_here() {
  static const bool supported = __builtin_cpu_supports("avx512f") &&
                                __builtin_cpu_supports("avx512bw") &&
                                __builtin_cpu_supports("avx512dq");
  return supported && wide_attention_wanted.load(std::memory_order_relaxed);
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl")

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Low half + high half: the AVX2 kernel's a0 + a1.
inline __m256 halves_added(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
}

// The scores of `Group` heads for the 8 tokens from row `first` of a block (rows of Pairs x 16
// lanes), before sums8 adds each token's lanes.
template <typename T, int Pairs, int Group>
inline void partial_scores512(const float* q, const T* rows, __m256 (&partial)[Group][8]) {
  constexpr int64_t dim = Pairs * 16;
  for (int j = 0; j < 8; ++j) {
    __m512 k[Pairs];
    for (int i = 0; i < Pairs; ++i) k[i] = load16(rows + j * dim + i * 16);
    for (int h = 0; h < Group; ++h) {
      __m512 a = _mm512_setzero_ps();
      for (int i = 0; i < Pairs; ++i) a = _mm512_fmadd_ps(load16(q + h * dim + i * 16), k[i], a);
      partial[h][j] = halves_added(a);
    }
  }
}

// out[h] += sum over the block's `rows` tokens of weight[h][t] * v_t, for Chunk pairs of lanes
// from `pair`: every head's sums in registers for one pass over the rows.
template <typename T, int Pairs, int Group, int Chunk>
inline void weighted_values512(const T* block, int64_t rows, int pair, const float* weights,
                               int64_t stride, __m512 (&acc)[Group][Pairs]) {
  constexpr int64_t dim = Pairs * 16;
  __m512 sum[Group][Chunk];
  for (int h = 0; h < Group; ++h)
    for (int c = 0; c < Chunk; ++c) sum[h][c] = acc[h][pair + c];
  for (int64_t j = 0; j < rows; ++j) {
    __m512 v[Chunk];
    for (int c = 0; c < Chunk; ++c) v[c] = load16(block + j * dim + (pair + c) * 16);
    for (int h = 0; h < Group; ++h) {
      const __m512 w = _mm512_set1_ps(weights[h * stride + j]);
      for (int c = 0; c < Chunk; ++c) sum[h][c] = _mm512_fmadd_ps(w, v[c], sum[h][c]);
    }
  }
  for (int h = 0; h < Group; ++h)
    for (int c = 0; c < Chunk; ++c) acc[h][pair + c] = sum[h][c];
}

// attend_group_fixed<T, Vecs, Group> for Vecs = 2 x Pairs, with the same arguments and bits.
template <typename T, int Pairs, int Group>
void attend_group512(const float* q, const T* keys, const T* values, const int64_t* blocks,
                     int64_t length, int64_t block_size, float* scores, float* out) {
  constexpr int64_t dim = Pairs * 16;
  const int64_t stride = (length + 7) / 8 * 8;
  const __m256 scale = _mm256_set1_ps(1.f / std::sqrt(static_cast<float>(dim)));
  __m256 top[Group];
  for (int h = 0; h < Group; ++h) top[h] = _mm256_set1_ps(-INFINITY);
  for (int64_t first = 0, b = 0; first < length; first += block_size, ++b) {
    const T* block = keys + blocks[b] * block_size * dim;
    for (int64_t t0 = first; t0 < std::min(first + block_size, length); t0 += 8) {
      __m256 partial[Group][8];
      partial_scores512<T, Pairs, Group>(q, block + (t0 - first) * dim, partial);
      keep_scores<Group>(partial, scale, length, t0, scores, stride, top);
    }
  }
  __m256 inverse[Group];
  softmax_numerators<Group>(top, scores, stride, length, inverse);
  // Every head's whole output in registers where it fits 16 of the 32 (SmolLM2: 3 x 4).
  constexpr int Chunk = Group * Pairs <= 16 ? Pairs : Pairs / 2;
  __m512 acc[Group][Pairs];
  for (int h = 0; h < Group; ++h)
    for (int i = 0; i < Pairs; ++i) acc[h][i] = _mm512_setzero_ps();
  for (int64_t first = 0, b = 0; first < length; first += block_size, ++b) {
    const T* block = values + blocks[b] * block_size * dim;
    const int64_t rows = std::min(block_size, length - first);
    for (int pair = 0; pair < Pairs; pair += Chunk)
      weighted_values512<T, Pairs, Group, Chunk>(block, rows, pair, scores + first, stride, acc);
  }
  for (int h = 0; h < Group; ++h)
    for (int i = 0; i < Pairs; ++i) {
      const __m512 inv = _mm512_broadcast_f32x8(inverse[h]);
      _mm512_storeu_ps(out + h * dim + i * 16, _mm512_mul_ps(acc[h][i], inv));
    }
}

#pragma GCC pop_options

}  // namespace pdserve::step
