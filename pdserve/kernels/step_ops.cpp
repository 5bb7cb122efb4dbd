// The per-token work of a decode step besides the matrices, each in one call (step_ops.py).
//
// A batch-1 decode step of SmolLM2 ran about 3,000 small ATen calls (norms, RoPE, the KV gather,
// widening and attention) that together cost more than its q4 matrices. Here each of them is one
// call per layer, with one loop over the rows (the loops themselves: step_kernels.h):
//   rms_norm             x * rsqrt(mean(x^2) + eps) * weight, rounded as the torch module rounds
//   rotary_              RoPE applied in place to q and k, from the step's cos and signed sin
//   paged_decode         writes the step's K and V into the paged cache at their slots, then
//                        attends each sequence's query heads over its own blocks, read in the
//                        cache's dtype (no gather, no float32 copy of the context)

#include "step_kernels.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

namespace {

using namespace pdserve::step;
using c10::BFloat16;

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t width, int64_t stride,
                   double eps) {
  at::parallel_for(0, rows, 16, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) rms_norm_row(x + r * stride, w, out + r * width, width, eps);
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

// x [tokens, heads, dim] (dim contiguous), cos and sin_signed [tokens, 1, dim] contiguous.
template <typename T>
void rotate_rows(at::Tensor& x, const T* cos, const T* sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  T* base = x.data_ptr<T>();
  at::parallel_for(0, tokens * heads, 64, [&](int64_t first, int64_t last) {
    std::vector<float> kept(dim);
    for (int64_t item = first; item < last; ++item) {
      const int64_t t = item / heads, h = item % heads;
      rotate_head(base + t * token_stride + h * head_stride, cos + t * dim, sin + t * dim, dim,
                  kept.data());
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

template <typename T>
at::Tensor paged_decode_as(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const PagedLayer<T>& cache) {
  cache.write(k, v);
  auto out = at::empty(q.sizes(), q.options());
  const T* qs = q.data_ptr<T>();
  T* os = out.data_ptr<T>();
  const int64_t kv_heads = cache.kv_heads(), group_size = cache.group * q.size(2);
  at::parallel_for(0, q.size(0) * kv_heads, 1, [&](int64_t first, int64_t last) {
    typename PagedLayer<T>::Buffers buffers;
    for (int64_t item = first; item < last; ++item) {
      const int64_t row = item / kv_heads, head = item % kv_heads * cache.group;
      cache.attend(item, qs + row * q.stride(0) + head * q.stride(1), q.stride(1),
                           os + item * group_size, buffers);
    }
  });
  return out;
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        at::Tensor key_cache, at::Tensor value_cache, const at::Tensor& new_slots,
                        const at::Tensor& blocks, const at::Tensor& lengths, int64_t block_size) {
  check_paged(q, k, v, key_cache, value_cache, new_slots, blocks, lengths, block_size);
  const int64_t heads = q.size(1);
  if (key_cache.scalar_type() == at::kFloat)
    return paged_decode_as(
        q, k, v, PagedLayer<float>(key_cache, value_cache, new_slots, blocks, lengths, heads, block_size));
  return paged_decode_as(
      q, k, v, PagedLayer<BFloat16>(key_cache, value_cache, new_slots, blocks, lengths, heads, block_size));
}

// Whether decode attention may run its AVX-512 kernel where the CPU has one (the default); returns
// the previous setting. For tests and benchmarks, which compare it with the AVX2 kernel.
bool set_wide_attention(bool wanted) { return wide_attention_wanted.exchange(wanted); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("set_wide_attention(bool wanted) -> bool", TORCH_FN(set_wide_attention));
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def(
      "paged_decode(Tensor q, Tensor k, Tensor v, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor new_slots, Tensor blocks, Tensor lengths, int block_size) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.impl("rotary_", c10::DispatchKey::CPU, TORCH_FN(rotary_));
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(paged_decode));
}
