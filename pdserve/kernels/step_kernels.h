// The per-token work of a decode step besides the matrices, one row, head or sequence at a
// time: step_ops.cpp registers them as ops, decode_layer.cpp runs them inside its own parallel
// region. Every row (and every sequence) is computed alone, in an order set by its own length,
// so its result does not depend on the batch beside it. Scores and softmax are float32.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace pdserve::step {

using c10::BFloat16;

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const BFloat16* p) {
  // bf16 is the top half of a float32: widen each 16-bit lane and shift it into place.
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

template <typename T>
inline float dot(const float* q, const T* k, int64_t dim) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= dim; i += 16) {  // two accumulators: the adds do not wait on each other
    a0 = _mm256_add_ps(a0, _mm256_mul_ps(load8(q + i), load8(k + i)));
    a1 = _mm256_add_ps(a1, _mm256_mul_ps(load8(q + i + 8), load8(k + i + 8)));
  }
  for (; i < dim; i += 8) a0 = _mm256_add_ps(a0, _mm256_mul_ps(load8(q + i), load8(k + i)));
  return sum8(_mm256_add_ps(a0, a1));
}

template <typename T>
inline float widen(T x) { return static_cast<float>(x); }

template <typename T>
inline T narrow(float x) { return static_cast<T>(x); }  // round to nearest even for bf16

// ---- RMSNorm ----------------------------------------------------------------------------------

// One row of x: x * rsqrt(mean(x^2) + eps) * weight.
template <typename T>
void rms_norm_row(const T* row, const T* w, T* out, int64_t width, double eps) {
  float squares = 0.f;
  for (int64_t i = 0; i < width; ++i) squares += widen(row[i]) * widen(row[i]);
  const float scale = 1.f / std::sqrt(squares / static_cast<float>(width) + (float)eps);
  // As the module computes it: normalised in float32, rounded to the dtype, then weighted.
  for (int64_t i = 0; i < width; ++i)
    out[i] = narrow<T>(widen(w[i]) * widen(narrow<T>(widen(row[i]) * scale)));
}

// ---- RoPE -------------------------------------------------------------------------------------

// One head of one token, v [dim], rotated in place against cos and sin_signed [dim]: each half
// against the other, v * cos + roll(v, dim/2) * sin_signed, as rope.py's Rotary. kept: dim floats
// of scratch.
template <typename T>
void rotate_head(T* v, const T* c, const T* s, int64_t dim, float* kept) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < dim; ++i) kept[i] = widen(v[i]);
  // Rounded where torch rounds: x * cos is a tensor of the dtype, then one addcmul. The partner
  // of i is i + half in the first half and i - half in the second (no % per element).
  const auto rotate = [&](int64_t i, int64_t partner) {
    const float scaled = widen(narrow<T>(kept[i] * widen(c[i])));
    v[i] = narrow<T>(scaled + kept[partner] * widen(s[i]));
  };
  for (int64_t i = 0; i < half; ++i) rotate(i, i + half);
  for (int64_t i = half; i < dim; ++i) rotate(i, i - half);
}

// ---- Paged decode attention -------------------------------------------------------------------

// Refuses a paged cache, slots, blocks or lengths that would read or write outside the cache,
// for `batch` sequences of `heads` query heads of `dim` in `dtype`, before anything is written.
inline void check_cache(int64_t batch, int64_t heads, int64_t dim, at::ScalarType dtype,
                        const at::Tensor& key_cache, const at::Tensor& value_cache,
                        const at::Tensor& new_slots, const at::Tensor& blocks,
                        const at::Tensor& lengths, int64_t block_size) {
  TORCH_CHECK(key_cache.dim() == 3 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  value_cache.sizes() == key_cache.sizes(),
              "paged_decode: the caches must be dense [kv_heads, slots, dim]");
  const int64_t kv_heads = key_cache.size(0), slot_count = key_cache.size(1);
  TORCH_CHECK(dim % 8 == 0 && key_cache.size(2) == dim && heads % kv_heads == 0,
              "paged_decode: shapes of q, k, v and the cache do not agree (dim % 8 == 0)");
  TORCH_CHECK(key_cache.scalar_type() == dtype && value_cache.scalar_type() == dtype,
              "paged_decode: k, v and the caches must share a dtype");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "paged_decode: float32 or bfloat16");
  TORCH_CHECK(new_slots.scalar_type() == at::kLong && new_slots.is_contiguous(),
              "paged_decode: one int64 slot per new row of k and v");
  const int64_t* slots = new_slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < new_slots.numel(); ++r)
    TORCH_CHECK(slots[r] >= 0 && slots[r] < slot_count, "paged_decode: slot out of range");
  TORCH_CHECK(blocks.scalar_type() == at::kLong && blocks.dim() == 2 && blocks.is_contiguous() &&
                  blocks.size(0) == batch && lengths.scalar_type() == at::kLong &&
                  lengths.is_contiguous() && lengths.numel() == batch,
              "paged_decode: blocks [batch, width] and lengths [batch], int64");
  const int64_t* length = lengths.data_ptr<int64_t>();
  const int64_t* table = blocks.data_ptr<int64_t>();
  const int64_t width = blocks.size(1);
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(length[b] >= 1 && length[b] <= width * block_size,
                "paged_decode: a sequence's length does not fit its blocks");
    for (int64_t i = 0; i < (length[b] + block_size - 1) / block_size; ++i)
      TORCH_CHECK(table[b * width + i] >= 0 && (table[b * width + i] + 1) * block_size <= slot_count,
                  "paged_decode: block out of range");
  }
}

// check_cache, and q [batch, heads, dim], k and v [rows, kv_heads, dim] with one slot per row.
inline void check_paged(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& key_cache, const at::Tensor& value_cache,
                        const at::Tensor& new_slots, const at::Tensor& blocks,
                        const at::Tensor& lengths, int64_t block_size) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "paged_decode: q must be [batch, heads, dim]");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.stride(2) == 1 && v.stride(2) == 1,
              "paged_decode: k and v must be [rows, kv_heads, dim]");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == q.size(2) && key_cache.dim() == 3 &&
                  k.size(1) == key_cache.size(0),
              "paged_decode: shapes of q, k, v and the cache do not agree (dim % 8 == 0)");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(),
              "paged_decode: q, k, v and the caches must share a dtype");
  TORCH_CHECK(new_slots.numel() == k.size(0), "paged_decode: one int64 slot per new row of k and v");
  check_cache(q.size(0), q.size(1), q.size(2), k.scalar_type(), key_cache, value_cache, new_slots,
              blocks, lengths, block_size);
}

// Writes `rows` new rows of K or V, each `heads` heads of `dim` (the heads `head_stride` apart,
// the rows `row_stride`), to their slots (checked by check_cache) of the layer's cache
// [kv_heads, slots, dim].
template <typename T>
void write_slots(const T* src, int64_t rows, int64_t row_stride, int64_t heads,
                 int64_t head_stride, int64_t dim, T* cache, const int64_t* slots,
                 int64_t slot_count) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < heads; ++h) {
      const T* from = src + r * row_stride + h * head_stride;
      std::copy(from, from + dim, cache + (h * slot_count + slots[r]) * dim);
    }
  }
}

// exp for x <= 0 (scores minus their maximum), 8 lanes: 2^n * p(r) with x = n ln2 + r, |r| <=
// ln2 / 2, p a degree-7 Taylor polynomial (relative error below 2e-8 there).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693145752f)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(1.42860677e-6f)));
  __m256 p = _mm256_set1_ps(1.f / 5040);
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(c));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                          _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// Calls visit(t, offset) for the tokens t < length of a sequence in order, offset being where
// token t's row of `dim` starts in a layer's cache (its block's slot times dim). Block by block,
// not t / block_size per token: that division cost as much as a token's dot product.
template <typename Visit>
inline void for_each_token(const int64_t* blocks, int64_t length, int64_t block_size, int64_t dim,
                           Visit visit) {
  for (int64_t first = 0, b = 0; first < length; first += block_size, ++b) {
    const int64_t last = std::min(first + block_size, length), base = blocks[b] * block_size - first;
    for (int64_t t = first; t < last; ++t) visit(t, (base + t) * dim);
  }
}

// exp(scores[t] - top) in place for t < length; returns their sum (8 lanes, then the tail).
inline float exponentiate(float* scores, int64_t length, float top) {
  int64_t t = 0;
  __m256 total8 = _mm256_setzero_ps();
  for (; t + 8 <= length; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), _mm256_set1_ps(top)));
    _mm256_storeu_ps(scores + t, e);
    total8 = _mm256_add_ps(total8, e);
  }
  float total = sum8(total8);
  for (; t < length; ++t) {
    float tail[8] = {scores[t] - top};
    _mm256_storeu_ps(tail, exp8(_mm256_loadu_ps(tail)));
    scores[t] = tail[0];
    total += tail[0];
  }
  return total;
}

// One query head of one sequence: softmax(q . k_t / sqrt(dim)) . v_t over its `length` tokens,
// for any head width (dim % 8 == 0) and block size: the loop attend_group_fixed's shapes do
// without.
template <typename T>
void attend_head(const float* q, const T* keys, const T* values, const int64_t* blocks,
                 int64_t length, int64_t block_size, int64_t dim, float* scores, float* out) {
  const float scale = 1.f / std::sqrt(static_cast<float>(dim));
  float top = -INFINITY;
  for_each_token(blocks, length, block_size, dim, [&](int64_t t, int64_t at) {
    scores[t] = dot(q, keys + at, dim) * scale;
    top = std::max(top, scores[t]);
  });
  const float total = exponentiate(scores, length, top);
  std::vector<__m256> acc(dim / 8, _mm256_setzero_ps());
  for_each_token(blocks, length, block_size, dim, [&](int64_t t, int64_t at) {
    const __m256 w = _mm256_set1_ps(scores[t]);
    for (int64_t i = 0; i < dim / 8; ++i)
      acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(w, load8(values + at + i * 8)));
  });
  const __m256 inverse = _mm256_set1_ps(1.f / total);
  for (int64_t i = 0; i < dim / 8; ++i) _mm256_storeu_ps(out + i * 8, _mm256_mul_ps(acc[i], inverse));
}

// The 8 sums of 8 vectors' lanes, [sum(p[0]), ..., sum(p[7])], by one fixed tree of adds.
inline __m256 sums8(const __m256* p) {
  const __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(p[0], p[1]), _mm256_hadd_ps(p[2], p[3]));
  const __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(p[4], p[5]), _mm256_hadd_ps(p[6], p[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20),
                       _mm256_permute2f128_ps(low, high, 0x31));
}

// The scores of tokens t0..t0+7 for each of `Group` heads, from their 8 partial vectors each:
// summed (sums8), scaled, stored at scores[h * stride + t0], and folded into the running maxima.
// Past `length` a score is -inf, which the maximum ignores and exp turns to 0.
template <int Group>
inline void keep_scores(const __m256 (&partial)[Group][8], __m256 scale, int64_t length,
                        int64_t t0, float* scores, int64_t stride, __m256 (&top)[Group]) {
  const int valid = static_cast<int>(std::min<int64_t>(8, length - t0));
  const __m256 kept = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
      _mm256_set1_epi32(valid), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
  for (int h = 0; h < Group; ++h) {
    const __m256 s = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY),
                                      _mm256_mul_ps(sums8(partial[h]), scale), kept);
    _mm256_storeu_ps(scores + h * stride + t0, s);
    top[h] = _mm256_max_ps(top[h], s);
  }
}

// Each head's scores turned in place into exp(score - max), and 1 / their sum in inverse[h].
template <int Group>
inline void softmax_numerators(const __m256 (&top)[Group], float* scores, int64_t stride,
                               int64_t length, __m256 (&inverse)[Group]) {
  for (int h = 0; h < Group; ++h) {
    float lanes[8];
    _mm256_storeu_ps(lanes, top[h]);
    const float most = *std::max_element(lanes, lanes + 8);
    inverse[h] = _mm256_set1_ps(1.f / exponentiate(scores + h * stride, length, most));
  }
}

// The `Group` query heads that share one KV head of one sequence, q and out [Group][dim], for a
// head of Vecs x 8 lanes and blocks of a multiple of 8 tokens. scores: Group x (length rounded up
// to 8) floats.
//   - Each row of K and V is loaded and widened once for the group (SmolLM2: 3 query heads per
//     KV head): widening bf16 was most of a token's cost.
//   - The sizes are constants, so the query's and the output's accumulators stay in registers.
//   - Scores are summed 8 tokens at a time (sums8), not one horizontal sum per token. The last 8
//     may run past `length` (never past its block, which holds a multiple of 8): those lanes
//     are computed and dropped; no lane's sum reads another's.
// A token's score and a lane's output are summed in one order wherever the token sits and
// whatever the batch, so a sequence gets the same bits in any batch.
template <typename T, int Vecs, int Group>
void attend_group_fixed(const float* q, const T* keys, const T* values, const int64_t* blocks,
                        int64_t length, int64_t block_size, float* scores, float* out) {
  constexpr int64_t dim = Vecs * 8;
  const int64_t stride = (length + 7) / 8 * 8;  // a head's scores
  const __m256 scale = _mm256_set1_ps(1.f / std::sqrt(static_cast<float>(dim)));
  __m256 top[Group];
  for (int h = 0; h < Group; ++h) top[h] = _mm256_set1_ps(-INFINITY);
  for (int64_t first = 0, b = 0; first < length; first += block_size, ++b) {
    const T* block = keys + blocks[b] * block_size * dim;
    for (int64_t t0 = first; t0 < std::min(first + block_size, length); t0 += 8) {
      __m256 partial[Group][8];
      for (int j = 0; j < 8; ++j) {
        const T* k = block + (t0 - first + j) * dim;
        __m256 kk[Vecs];
        for (int i = 0; i < Vecs; ++i) kk[i] = load8(k + i * 8);
        for (int h = 0; h < Group; ++h) {
          __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
          for (int i = 0; i < Vecs; i += 2) {
            a0 = _mm256_fmadd_ps(load8(q + h * dim + i * 8), kk[i], a0);
            a1 = _mm256_fmadd_ps(load8(q + h * dim + i * 8 + 8), kk[i + 1], a1);
          }
          partial[h][j] = _mm256_add_ps(a0, a1);
        }
      }
      keep_scores<Group>(partial, scale, length, t0, scores, stride, top);
    }
  }
  __m256 inverse[Group];
  softmax_numerators<Group>(top, scores, stride, length, inverse);
  // Block by block, two vectors of every head's output per pass over the block's tokens:
  // Group x 2 accumulators and the two of V fit AVX2's 16 registers, where all of a head's
  // would not, and a block's rows of V (2 KB for SmolLM2) stay in L1 for its passes, where a
  // pass over all tokens read them from L2 each time.
  __m256 acc[Group][Vecs];
  for (int h = 0; h < Group; ++h)
    for (int i = 0; i < Vecs; ++i) acc[h][i] = _mm256_setzero_ps();
  for (int64_t first = 0, b = 0; first < length; first += block_size, ++b) {
    const T* block = values + blocks[b] * block_size * dim;
    const int64_t rows = std::min(block_size, length - first);
    for (int i = 0; i < Vecs; i += 2) {
      __m256 sum[Group][2];
      for (int h = 0; h < Group; ++h) sum[h][0] = acc[h][i], sum[h][1] = acc[h][i + 1];
      for (int64_t j = 0; j < rows; ++j) {
        const __m256 v0 = load8(block + j * dim + i * 8), v1 = load8(block + j * dim + i * 8 + 8);
        for (int h = 0; h < Group; ++h) {
          const __m256 w = _mm256_set1_ps(scores[h * stride + first + j]);
          sum[h][0] = _mm256_fmadd_ps(w, v0, sum[h][0]);
          sum[h][1] = _mm256_fmadd_ps(w, v1, sum[h][1]);
        }
      }
      for (int h = 0; h < Group; ++h) acc[h][i] = sum[h][0], acc[h][i + 1] = sum[h][1];
    }
  }
  for (int h = 0; h < Group; ++h)
    for (int i = 0; i < Vecs; ++i)
      _mm256_storeu_ps(out + h * dim + i * 8, _mm256_mul_ps(acc[h][i], inverse[h]));
}

}  // namespace pdserve::step

#include "attend_avx512.h"

namespace pdserve::step {

// Calls fn with the attend_group_fixed that takes `group` heads of width `dim` (its AVX-512 form
// where the CPU has it: the same bits), or returns false.
template <typename T, typename Fn>
bool with_group_kernel(int64_t group, int64_t dim, Fn fn) {
  const bool wide = wide_attention_here();
  const auto widths = [&]<int Group>() {
    if (dim == 64) return fn(wide ? attend_group512<T, 4, Group> : attend_group_fixed<T, 8, Group>), true;
    if (dim == 128) return fn(wide ? attend_group512<T, 8, Group> : attend_group_fixed<T, 16, Group>), true;
    return false;
  };
  switch (group) {
    case 1: return widths.template operator()<1>();
    case 2: return widths.template operator()<2>();
    case 3: return widths.template operator()<3>();
    case 4: return widths.template operator()<4>();
    default: return false;
  }
}

// `group` query heads sharing a KV head: attend_group_fixed where the shape is common (head width
// 64 or 128, 1-4 heads a group, blocks of a multiple of 8 tokens), else a head at a time.
// scores: at least group x (length + 7) floats.
template <typename T>
void attend_group(const float* q, const T* keys, const T* values, const int64_t* blocks,
                  int64_t length, int64_t block_size, int64_t group, int64_t dim, float* scores,
                  float* out) {
  if (block_size % 8 == 0 && with_group_kernel<T>(group, dim, [&](auto kernel) {
        kernel(q, keys, values, blocks, length, block_size, scores, out);
      }))
    return;
  for (int64_t h = 0; h < group; ++h)
    attend_head(q + h * dim, keys, values, blocks, length, block_size, dim, scores, out + h * dim);
}

// One layer's paged cache as attention reads it, for operands that check_paged accepted.
template <typename T>
struct PagedLayer {
  const at::Tensor &key_cache, &value_cache;
  const int64_t *slots, *table, *length;
  int64_t width, slot_count, block_size, heads, group, dim;

  PagedLayer(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& new_slots,
             const at::Tensor& blocks, const at::Tensor& lengths, int64_t query_heads,
             int64_t block_size_)
      : key_cache(keys), value_cache(values), slots(new_slots.data_ptr<int64_t>()),
        table(blocks.data_ptr<int64_t>()), length(lengths.data_ptr<int64_t>()),
        width(blocks.size(1)), slot_count(keys.size(1)), block_size(block_size_),
        heads(query_heads), group(query_heads / keys.size(0)), dim(keys.size(2)) {}

  // New K and V rows [first, last) of the step into their slots: k and v point at the first
  // row's, each row `row_stride` on, each head `dim` on.
  void write(const T* k, const T* v, int64_t first, int64_t last, int64_t row_stride) const {
    const int64_t rows = last - first;
    write_slots(k + first * row_stride, rows, row_stride, kv_heads(), dim, dim, key_cache.data_ptr<T>(),
                slots + first, slot_count);
    write_slots(v + first * row_stride, rows, row_stride, kv_heads(), dim, dim, value_cache.data_ptr<T>(),
                slots + first, slot_count);
  }

  // The same from k and v tensors [rows, kv_heads, dim] of any strides (dim dense).
  void write(const at::Tensor& k, const at::Tensor& v) const {
    write_slots(k.data_ptr<T>(), k.size(0), k.stride(0), k.size(1), k.stride(1), dim,
                key_cache.data_ptr<T>(), slots, slot_count);
    write_slots(v.data_ptr<T>(), v.size(0), v.stride(0), v.size(1), v.stride(1), dim,
                value_cache.data_ptr<T>(), slots, slot_count);
  }

  int64_t kv_heads() const { return heads / group; }

  // A thread's float32 buffers for attend, reused item after item.
  struct Buffers {
    std::vector<float> query, result, scores;
  };

  // The query heads of KV head `item` (sequence item / kv_heads, KV head item % kv_heads), read
  // in T from q (the item's first head; its heads `head_stride` apart) and widened to float32
  // here, one item at a time: out [group, dim], rounded to T.
  void attend(int64_t item, const T* q, int64_t head_stride, T* out, Buffers& buf) const {
    const int64_t b = item / kv_heads(), kv = item % kv_heads();
    buf.query.resize(group * dim);
    buf.result.resize(group * dim);
    buf.scores.resize(group * (length[b] + 7));
    for (int64_t h = 0; h < group; ++h)
      for (int64_t c = 0; c < dim; ++c) buf.query[h * dim + c] = widen(q[h * head_stride + c]);
    attend_group(buf.query.data(), key_cache.data_ptr<T>() + kv * slot_count * dim,
                 value_cache.data_ptr<T>() + kv * slot_count * dim, table + b * width, length[b],
                 block_size, group, dim, buf.scores.data(), buf.result.data());
    for (int64_t c = 0; c < group * dim; ++c) out[c] = narrow<T>(buf.result[c]);
  }
};

// ---- A layer's rows between its matrices (decode_layer.cpp, decode_wide.cpp) ---------------

// x + y rounded to T, as torch adds two tensors of T.
template <typename T>
void add_rows(const T* x, const T* y, T* out, int64_t count) {
  for (int64_t i = 0; i < count; ++i) out[i] = narrow<T>(widen(x[i]) + widen(y[i]));
}

// Rows [first, last) of qkv [rows, (heads + 2 kv_heads) * dim] (q's heads, k's, v's): RoPE on
// q's and k's heads in place (cos and sin_signed [rows, dim]), then each row's K and V into its
// slot of the cache.
template <typename T>
void rotate_and_store(T* qkv, int64_t heads, int64_t kv_heads, int64_t dim, const T* cos,
                      const T* sin, const PagedLayer<T>& cache, int64_t first, int64_t last) {
  const int64_t stride = (heads + 2 * kv_heads) * dim;
  std::vector<float> kept(dim);
  for (int64_t i = first; i < last; ++i) {
    for (int64_t h = 0; h < heads + kv_heads; ++h)
      rotate_head(qkv + i * stride + h * dim, cos + i * dim, sin + i * dim, dim, kept.data());
  }
  const T* k = qkv + heads * dim;
  cache.write(k, k + kv_heads * dim, first, last, stride);
}

// KV heads [first, last) of the batch (sequence item / kv_heads), each with its query heads read
// from qkv as rotate_and_store leaves it, attended as paged_decode attends them, into out
// [rows, heads * dim].
template <typename T>
void attend_items(const T* qkv, int64_t heads, int64_t kv_heads, int64_t dim,
                  const PagedLayer<T>& cache, T* out, int64_t first, int64_t last) {
  const int64_t n = heads / kv_heads * dim;  // a KV head's queries, consecutive
  const int64_t stride = (heads + 2 * kv_heads) * dim;
  typename PagedLayer<T>::Buffers buffers;
  for (int64_t item = first; item < last; ++item) {
    const T* q = qkv + item / kv_heads * stride + item % kv_heads * n;
    cache.attend(item, q, dim, out + item * n, buffers);
  }
}

// Rows [first, last) of both [rows, 2 * hidden] (gate, then up): SiLU(gate) * up into gated
// [rows, hidden]. SiLU is torch's own (at::silu_out, run inline inside a parallel region), so
// that it rounds exactly as llama.py's F.silu does; the product rounds as torch multiplies.
template <typename T>
void silu_times_up(const T* both, int64_t hidden, int64_t first, int64_t last, T* gated) {
  if (first == last) return;
  const int64_t count = last - first;
  const auto options = at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value);
  T* out = gated + first * hidden;
  const at::Tensor gate = at::from_blob(const_cast<T*>(both) + first * 2 * hidden,
                                        {count, hidden}, {2 * hidden, 1}, options);
  at::Tensor silu = at::from_blob(out, {count, hidden}, options);
  at::silu_out(silu, gate);
  for (int64_t i = 0; i < count; ++i) {
    const T* up = both + (first + i) * 2 * hidden + hidden;
    for (int64_t c = 0; c < hidden; ++c)
      out[i * hidden + c] = narrow<T>(widen(out[i * hidden + c]) * widen(up[c]));
  }
}


}  // namespace pdserve::step
