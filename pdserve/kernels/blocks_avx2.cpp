// x @ W.T for W held as llama.cpp's quantised blocks, as the ops pdserve::q4_1_linear and
// pdserve::q8_0_linear (the kernel and its block formats: blocks_avx2.h).
#include "blocks_avx2.h"

#include <torch/library.h>

namespace {

using namespace pdserve::blocks;

template <typename F, typename T>
at::Tensor linear_as(const at::Tensor& x, const at::Tensor& weights) {
  const int64_t rows = x.size(0), k = x.size(1), n = weights.size(0), blocks = k / kBlock;
  std::vector<int8_t> q(rows * k);
  std::vector<float> d(rows * blocks), s(rows * blocks);
  quantize_rows(x.data_ptr<T>(), rows, k, q.data(), d.data(), s.data());
  at::Tensor out = at::empty({rows, n}, x.options());
  multiply<F>(q.data(), d.data(), s.data(), rows, k, weights.data_ptr<uint8_t>(), n,
              out.data_ptr<T>());
  return out;
}

template <typename F>
at::Tensor block_linear(const at::Tensor& x, const at::Tensor& weights, const char* format) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: a contiguous matrix");
  TORCH_CHECK(weights.dim() == 2 && weights.scalar_type() == at::kByte && weights.is_contiguous(),
              "weights: a contiguous uint8 matrix of ", format, " blocks");
  const int64_t k = x.size(1);
  TORCH_CHECK(k % kBlock == 0 && weights.size(1) == k / kBlock * F::kBytes,
              "weights: [rows, columns / 32 * ", F::kBytes, "] for x's columns");
  if (x.scalar_type() == at::kBFloat16) return linear_as<F, at::BFloat16>(x, weights);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x: bfloat16 or float32");
  return linear_as<F, float>(x, weights);
}

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& weights) {
  return block_linear<Q4_1>(x, weights, "Q4_1");
}

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& weights) {
  return block_linear<Q8_0>(x, weights, "Q8_0");
}

}  // namespace

TORCH_LIBRARY(pdserve, m) {
  m.def("q4_1_linear(Tensor x, Tensor weights) -> Tensor");
  m.impl("q4_1_linear", c10::DispatchKey::CPU, TORCH_FN(q4_1_linear));
  m.def("q8_0_linear(Tensor x, Tensor weights) -> Tensor");
  m.impl("q8_0_linear", c10::DispatchKey::CPU, TORCH_FN(q8_0_linear));
}
