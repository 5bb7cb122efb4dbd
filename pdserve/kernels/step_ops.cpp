// The per-token work of a decode step besides the matrices, each in one call (step_ops.py).
//
// A batch-1 decode step of SmolLM2 ran about 3,000 small ATen calls (norms, RoPE, the KV gather,
// widening and attention) that together cost more than its q4 matrices. Here each of them is one
// call per layer, with one loop over the rows:
//   rms_norm             x * rsqrt(mean(x^2) + eps) * weight, rounded as the torch module rounds
//   rotary_              RoPE applied in place to q and k, from the step's cos and signed sin
//   paged_decode         writes the step's K and V into the paged cache at their slots, then
//                        attends each sequence's query heads over its own blocks, read in the
//                        cache's dtype (no gather, no float32 copy of the context)
// Every row (and every sequence) is computed alone, in an order set by its own length, so its
// result does not depend on the batch beside it. Scores and softmax are float32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

namespace {

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

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t width, int64_t stride,
                   double eps) {
  at::parallel_for(0, rows, 16, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const T* row = x + r * stride;
      float squares = 0.f;
      for (int64_t i = 0; i < width; ++i) squares += widen(row[i]) * widen(row[i]);
      const float scale = 1.f / std::sqrt(squares / static_cast<float>(width) + (float)eps);
      T* o = out + r * width;
      // As the module computes it: normalised in float32, rounded to the dtype, then weighted.
      for (int64_t i = 0; i < width; ++i)
        o[i] = narrow<T>(widen(w[i]) * widen(narrow<T>(widen(row[i]) * scale)));
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be [rows, width], rows dense");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be [width] in x's dtype");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == at::kFloat) {
    rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), x.size(0),
                  x.size(1), x.stride(0), eps);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "rms_norm: float32 or bfloat16 only");
    rms_norm_rows(x.data_ptr<BFloat16>(), weight.data_ptr<BFloat16>(), out.data_ptr<BFloat16>(),
                  x.size(0), x.size(1), x.stride(0), eps);
  }
  return out;
}

// ---- RoPE -------------------------------------------------------------------------------------

// x [tokens, heads, dim] (dim contiguous), cos and sin_signed [tokens, 1, dim] contiguous: each
// half rotated against the other, x * cos + roll(x, dim/2) * sin_signed, as rope.py's Rotary.
template <typename T>
void rotate_rows(at::Tensor& x, const T* cos, const T* sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  T* base = x.data_ptr<T>();
  at::parallel_for(0, tokens * heads, 64, [&](int64_t first, int64_t last) {
    std::vector<float> kept(dim);
    for (int64_t item = first; item < last; ++item) {
      const int64_t t = item / heads, h = item % heads;
      T* v = base + t * token_stride + h * head_stride;
      const T* c = cos + t * dim;
      const T* s = sin + t * dim;
      for (int64_t i = 0; i < dim; ++i) kept[i] = widen(v[i]);
      for (int64_t i = 0; i < dim; ++i) {
        // Rounded where torch rounds: x * cos is a tensor of the dtype, then one addcmul.
        const float scaled = widen(narrow<T>(kept[i] * widen(c[i])));
        v[i] = narrow<T>(scaled + kept[(i + half) % dim] * widen(s[i]));
      }
    }
  });
}

void rotate_one(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rotary_: q and k must be [tokens, heads, dim] with dim dense and even");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() &&
                  cos.numel() == x.size(0) * x.size(2) && sin.numel() == cos.numel() &&
                  cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary_: cos and sin must be [tokens, 1, dim] in q's dtype");
  if (x.scalar_type() == at::kFloat) {
    rotate_rows(x, cos.data_ptr<float>(), sin.data_ptr<float>());
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "rotary_: float32 or bfloat16 only");
    rotate_rows(x, cos.data_ptr<BFloat16>(), sin.data_ptr<BFloat16>());
  }
}

void rotary_(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  rotate_one(q, cos, sin);
  rotate_one(k, cos, sin);
}

// ---- Paged decode attention -------------------------------------------------------------------

// Writes each new row of K and V [rows, kv_heads, dim] to its slot of the layer's cache
// [kv_heads, slots, dim].
template <typename T>
void write_slots(const at::Tensor& fresh, T* cache, const int64_t* slots, int64_t slot_count) {
  const int64_t rows = fresh.size(0), heads = fresh.size(1), dim = fresh.size(2);
  const T* src = fresh.data_ptr<T>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(slots[r] >= 0 && slots[r] < slot_count, "paged_decode: slot out of range");
    for (int64_t h = 0; h < heads; ++h) {
      const T* from = src + r * fresh.stride(0) + h * fresh.stride(1);
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

// One query head of one sequence: softmax(q . k_t / sqrt(dim)) . v_t over its `length` tokens.
template <typename T>
void attend_head(const float* q, const T* keys, const T* values, const int64_t* blocks,
                 int64_t length, int64_t block_size, int64_t dim, float* scores, float* out) {
  const float scale = 1.f / std::sqrt(static_cast<float>(dim));
  float top = -INFINITY;
  for (int64_t t = 0; t < length; ++t) {
    const int64_t slot = blocks[t / block_size] * block_size + t % block_size;
    scores[t] = dot(q, keys + slot * dim, dim) * scale;
    top = std::max(top, scores[t]);
  }
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
  std::vector<__m256> acc(dim / 8, _mm256_setzero_ps());
  for (t = 0; t < length; ++t) {
    const int64_t slot = blocks[t / block_size] * block_size + t % block_size;
    const T* v = values + slot * dim;
    const __m256 w = _mm256_set1_ps(scores[t]);
    for (int64_t i = 0; i < dim / 8; ++i)
      acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(w, load8(v + i * 8)));
  }
  const __m256 inverse = _mm256_set1_ps(1.f / total);
  for (int64_t i = 0; i < dim / 8; ++i) _mm256_storeu_ps(out + i * 8, _mm256_mul_ps(acc[i], inverse));
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        at::Tensor key_cache, at::Tensor value_cache, const at::Tensor& new_slots,
                        const at::Tensor& blocks, const at::Tensor& lengths, int64_t block_size) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "paged_decode: q must be [batch, heads, dim]");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.stride(2) == 1 && v.stride(2) == 1,
              "paged_decode: k and v must be [rows, kv_heads, dim]");
  TORCH_CHECK(key_cache.dim() == 3 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  value_cache.sizes() == key_cache.sizes(),
              "paged_decode: the caches must be dense [kv_heads, slots, dim]");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = key_cache.size(0), slot_count = key_cache.size(1);
  TORCH_CHECK(dim % 8 == 0 && key_cache.size(2) == dim && k.size(1) == kv_heads &&
                  k.size(2) == dim && heads % kv_heads == 0,
              "paged_decode: shapes of q, k, v and the cache do not agree (dim % 8 == 0)");
  TORCH_CHECK(k.scalar_type() == key_cache.scalar_type() &&
                  v.scalar_type() == key_cache.scalar_type() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "paged_decode: k, v and the caches must share a dtype");
  TORCH_CHECK(new_slots.scalar_type() == at::kLong && new_slots.is_contiguous() &&
                  new_slots.numel() == k.size(0) && v.size(0) == k.size(0),
              "paged_decode: one int64 slot per new row of k and v");
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
  const bool wide = key_cache.scalar_type() == at::kFloat;
  TORCH_CHECK(wide || key_cache.scalar_type() == at::kBFloat16, "paged_decode: float32 or bfloat16");
  if (wide) {
    write_slots(k, key_cache.data_ptr<float>(), new_slots.data_ptr<int64_t>(), slot_count);
    write_slots(v, value_cache.data_ptr<float>(), new_slots.data_ptr<int64_t>(), slot_count);
  } else {
    write_slots(k, key_cache.data_ptr<BFloat16>(), new_slots.data_ptr<int64_t>(), slot_count);
    write_slots(v, value_cache.data_ptr<BFloat16>(), new_slots.data_ptr<int64_t>(), slot_count);
  }
  const at::Tensor q32 = q.to(at::kFloat).contiguous();
  auto out32 = at::empty({batch, heads, dim}, q.options().dtype(at::kFloat));
  const int64_t group = heads / kv_heads;
  const float* qs = q32.data_ptr<float>();
  float* os = out32.data_ptr<float>();
  at::parallel_for(0, batch * heads, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scores;
    for (int64_t item = first; item < last; ++item) {
      const int64_t b = item / heads, h = item % heads, kv = h / group;
      scores.resize(length[b]);
      const float* query = qs + item * dim;
      float* result = os + item * dim;
      if (wide) {
        const float* base_k = key_cache.data_ptr<float>() + kv * slot_count * dim;
        const float* base_v = value_cache.data_ptr<float>() + kv * slot_count * dim;
        attend_head(query, base_k, base_v, table + b * width, length[b], block_size, dim,
                    scores.data(), result);
      } else {
        const BFloat16* base_k = key_cache.data_ptr<BFloat16>() + kv * slot_count * dim;
        const BFloat16* base_v = value_cache.data_ptr<BFloat16>() + kv * slot_count * dim;
        attend_head(query, base_k, base_v, table + b * width, length[b], block_size, dim,
                    scores.data(), result);
      }
    }
  });
  return out32.to(q.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def(
      "paged_decode(Tensor q, Tensor k, Tensor v, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor new_slots, Tensor blocks, Tensor lengths, int block_size) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.impl("rotary_", c10::DispatchKey::CPU, TORCH_FN(rotary_));
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(paged_decode));
}
