// x @ W.T for W held as llama.cpp's quantised blocks interleaved by 8 output rows, as the ops
// pdserve::q4_1_linear and pdserve::q8_0_linear; the kernel and its layouts: blocks_avx2.h.
#include "blocks_avx2.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

namespace {

using namespace pdserve::blocks;

void check_operands(const at::Tensor& x, const at::Tensor& weights, int64_t bytes_per_block,
                    const char* layout) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: a contiguous matrix");
  TORCH_CHECK(weights.dim() == 2 && weights.scalar_type() == at::kByte && weights.is_contiguous(),
              "weights: a contiguous uint8 matrix of ", layout);
  const int64_t k = x.size(1);
  TORCH_CHECK(k % kBlock == 0 && weights.size(1) == k / kBlock * bytes_per_block,
              "weights: each row must hold x's columns / 32 blocks of ", bytes_per_block,
              " bytes (", layout, ")");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "x: bfloat16 or float32");
}

// x @ W.T, W of format F interleaved by 8 rows ([n / 8, k / 32 * F::kBytes]), into [rows, n].
template <typename F, typename T>
at::Tensor interleaved_linear(const at::Tensor& x, const at::Tensor& weights) {
  const int64_t rows = x.size(0), k = x.size(1), groups = weights.size(0);
  const int64_t n = groups * kInterleave;
  QuantisedRows xq;
  xq.size_for(rows, k);
  xq.rows_of(x.data_ptr<T>(), k, 0, rows);
  at::Tensor out = at::empty({rows, n}, x.options());
  T* y = out.data_ptr<T>();
  at::parallel_for(0, groups, 2, [&](int64_t begin, int64_t end) {
    multiply_interleaved_range<F>(xq.codes.data(), xq.scales.data(), xq.sums.data(), rows, k,
                                  weights.data_ptr<uint8_t>(), n, y, begin, end);
  });
  return out;
}

template <typename F>
at::Tensor checked_linear(const at::Tensor& x, const at::Tensor& weights, const char* layout) {
  check_operands(x, weights, F::kBytes, layout);
  if (x.scalar_type() == at::kBFloat16) return interleaved_linear<F, at::BFloat16>(x, weights);
  return interleaved_linear<F, float>(x, weights);
}

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& weights) {
  return checked_linear<Q4_1x8>(x, weights, "Q4_1 blocks interleaved by 8 rows");
}

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& weights) {
  return checked_linear<Q8_0x8>(x, weights, "Q8_0 blocks interleaved by 8 rows");
}

}  // namespace

TORCH_LIBRARY(pdserve, m) {
  m.def("q4_1_linear(Tensor x, Tensor weights) -> Tensor");
  m.impl("q4_1_linear", c10::DispatchKey::CPU, TORCH_FN(q4_1_linear));
  m.def("q8_0_linear(Tensor x, Tensor weights) -> Tensor");
  m.impl("q8_0_linear", c10::DispatchKey::CPU, TORCH_FN(q8_0_linear));
}
