// Every Llama decoder layer of a wide decode step in one call: the same ATen and native calls,
// in the same order, that llama.py's Layer makes between Python lines when its matrices run a
// wide pass (quantized.py: from BF16_WIDE_ROWS rows of bfloat16, a dense bf16 copy of each
// matrix, reordered for oneDNN), so the result is bit for bit the same.
//
// Why. decode_layer.cpp runs a step's layers on the q4 kernel, which a wide step does not use.
// From Python, a wide step was about 25 ATen calls and 10 parallel regions per layer, each with
// the interpreter between them; at 16 rows they cost about a fifth of the step. Here, per layer:
//   norm (rows) | qkv | RoPE + K/V into the cache + attention (rows) | o |
//   residual + norm (rows) | gate_up | SiLU * up (rows) | down | residual (rows, with the next
//   layer's norm)
// The matrices are oneDNN's (mkldnn::_linear_pointwise, as onednn.py's ReorderedBF16 calls it),
// each parallel on its own; every other phase is one at::parallel_for over the rows. A row's
// RoPE, its K and V and its attention need only that row (and its own sequence's blocks), so
// they share one region.

#include "step_kernels.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <vector>

namespace {

using c10::BFloat16;
using pdserve::step::PagedLayer;

// x [rows, in] @ weight.T by oneDNN, weight reordered by mkldnn::_reorder_linear_weight.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& weight) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            c10::string_view, c10::List<std::optional<at::Scalar>>,
                            std::optional<c10::string_view>)>();
  return op.call(x, weight, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(), "");
}

void check_width(const at::Tensor& out, int64_t width, const char* name) {
  TORCH_CHECK(out.dim() == 2 && out.size(1) == width && out.is_contiguous(), "decode_layers_wide: ",
              name, "'s matrix gives ", out.size(-1), " columns, not ", width);
}

struct Shapes {
  int64_t rows, width, heads, kv_heads, head_dim;
  int64_t q_width() const { return heads * head_dim; }
  int64_t qkv_width() const { return (heads + 2 * kv_heads) * head_dim; }
};

// Rows [0, rows) split between the threads, one range each.
template <typename Body>
void for_rows(int64_t rows, const Body& body) {
  at::parallel_for(0, rows, 1, body);
}

// One layer: x [rows, width] in, normed = its input norm (made by the caller, as the previous
// layer's last phase makes it), returns the layer's output and leaves its norm by the next
// layer's weight in `normed` (none after the last).
template <typename T>
at::Tensor layer(const Shapes& s, const at::Tensor& x, at::Tensor& normed, const at::Tensor* next_norm,
                 const at::Tensor& post_norm, double eps, const at::Tensor& qkv_w,
                 const at::Tensor& o_w, const at::Tensor& gate_up_w, const at::Tensor& down_w,
                 const T* cos, const T* sin, const PagedLayer<T>& cache) {
  at::Tensor qkv = onednn_linear(normed, qkv_w);
  check_width(qkv, s.qkv_width(), "qkv");
  at::Tensor attended = at::empty({s.rows, s.q_width()}, x.options());
  T* q = qkv.data_ptr<T>();
  for_rows(s.rows, [&](int64_t first, int64_t last) {
    pdserve::step::rotate_and_store(q, s.heads, s.kv_heads, s.head_dim, cos, sin, cache, first,
                                    last);
    pdserve::step::attend_items(q, s.heads, s.kv_heads, s.head_dim, cache,
                                attended.data_ptr<T>(), first * s.kv_heads, last * s.kv_heads);
  });
  at::Tensor mid = onednn_linear(attended, o_w);
  check_width(mid, s.width, "o");
  at::Tensor post = at::empty_like(x);
  const T *xs = x.data_ptr<T>(), *post_w = post_norm.data_ptr<T>();
  T *ms = mid.data_ptr<T>(), *ps = post.data_ptr<T>();
  for_rows(s.rows, [&](int64_t first, int64_t last) {
    pdserve::step::add_rows(xs + first * s.width, ms + first * s.width, ms + first * s.width,
                            (last - first) * s.width);
    for (int64_t i = first; i < last; ++i)
      pdserve::step::rms_norm_row(ms + i * s.width, post_w, ps + i * s.width, s.width, eps);
  });
  at::Tensor both = onednn_linear(post, gate_up_w);
  TORCH_CHECK(both.dim() == 2 && both.size(1) % 2 == 0 && both.is_contiguous(),
              "decode_layers_wide: gate_up's matrix must give gate's and up's columns");
  const int64_t hidden = both.size(1) / 2;
  at::Tensor gated = at::empty({s.rows, hidden}, x.options());
  for_rows(s.rows, [&](int64_t first, int64_t last) {
    pdserve::step::silu_times_up(both.data_ptr<T>(), hidden, first, last, gated.data_ptr<T>());
  });
  at::Tensor out = onednn_linear(gated, down_w);
  check_width(out, s.width, "down");
  T* os = out.data_ptr<T>();
  for_rows(s.rows, [&](int64_t first, int64_t last) {
    pdserve::step::add_rows(ms + first * s.width, os + first * s.width, os + first * s.width,
                            (last - first) * s.width);
    if (next_norm == nullptr) return;
    for (int64_t i = first; i < last; ++i)
      pdserve::step::rms_norm_row(os + i * s.width, next_norm->data_ptr<T>(),
                                  normed.data_ptr<T>() + i * s.width, s.width, eps);
  });
  return out;
}

// x [rows, width] in bfloat16; per layer the norms' weights and its four matrices reordered for
// oneDNN (q, k, v stacked in qkv, gate and up in gate_up). cos, sin_signed and the cache
// operands as decode_layers takes them. Returns the last layer's output [rows, width].
at::Tensor decode_layers_wide(const at::Tensor& x, at::TensorList input_norms,
                              at::TensorList post_norms, double eps, at::TensorList qkv,
                              at::TensorList o, at::TensorList gate_up, at::TensorList down,
                              int64_t heads, int64_t kv_heads, int64_t head_dim,
                              const at::Tensor& cos, const at::Tensor& sin_signed, at::Tensor kv,
                              const at::Tensor& new_slots, const at::Tensor& blocks,
                              const at::Tensor& lengths, int64_t block_size) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "decode_layers_wide: x must be a dense [rows, width] in bfloat16");
  const int64_t count = static_cast<int64_t>(qkv.size());
  TORCH_CHECK(count > 0 && input_norms.size() == qkv.size() && post_norms.size() == qkv.size() &&
                  o.size() == qkv.size() && gate_up.size() == qkv.size() &&
                  down.size() == qkv.size(),
              "decode_layers_wide: one norm pair and four matrices per layer");
  TORCH_CHECK(kv.dim() == 5 && kv.size(0) == count && kv.size(1) == 2 && kv.size(2) == kv_heads,
              "decode_layers_wide: kv must be [layers, 2, kv_heads, slots, head_dim]");
  const Shapes s{x.size(0), x.size(1), heads, kv_heads, head_dim};
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim % 2 == 0,
              "decode_layers_wide: heads must be a multiple of kv_heads, head_dim even");
  TORCH_CHECK(cos.is_contiguous() && sin_signed.is_contiguous() &&
                  cos.numel() == s.rows * head_dim && sin_signed.numel() == cos.numel() &&
                  cos.scalar_type() == at::kBFloat16 && sin_signed.scalar_type() == at::kBFloat16,
              "decode_layers_wide: cos and sin must be [rows, 1, head_dim] in x's dtype");
  for (int64_t i = 0; i < count; ++i)
    for (const at::Tensor* norm : {&input_norms[i], &post_norms[i]})
      TORCH_CHECK(norm->is_contiguous() && norm->numel() == s.width &&
                      norm->scalar_type() == at::kBFloat16,
                  "decode_layers_wide: the norms' weights must be [width] in x's dtype");
  pdserve::step::check_cache(s.rows, heads, head_dim, at::kBFloat16, kv[0][0], kv[0][1],
                             new_slots, blocks, lengths, block_size);
  at::Tensor normed = at::empty_like(x);
  const BFloat16 *xs = x.data_ptr<BFloat16>(), *w = input_norms[0].data_ptr<BFloat16>();
  for_rows(s.rows, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i)
      pdserve::step::rms_norm_row(xs + i * s.width, w, normed.data_ptr<BFloat16>() + i * s.width,
                                  s.width, eps);
  });
  at::Tensor h = x;
  for (int64_t i = 0; i < count; ++i) {
    const at::Tensor keys = kv[i][0], values = kv[i][1];
    const PagedLayer<BFloat16> cache(keys, values, new_slots, blocks, lengths, heads, block_size);
    h = layer<BFloat16>(s, h, normed, i + 1 < count ? &input_norms[i + 1] : nullptr,
                        post_norms[i], eps, qkv[i], o[i], gate_up[i], down[i],
                        cos.data_ptr<BFloat16>(), sin_signed.data_ptr<BFloat16>(), cache);
  }
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def(
      "decode_layers_wide(Tensor x, Tensor[] input_norms, Tensor[] post_norms, float eps, "
      "Tensor[] qkv, Tensor[] o, Tensor[] gate_up, Tensor[] down, int heads, int kv_heads, "
      "int head_dim, Tensor cos, Tensor sin_signed, Tensor(a!) kv, Tensor new_slots, "
      "Tensor blocks, Tensor lengths, int block_size) -> Tensor");
  // The reordered matrices are oneDNN's own tensors, so a call dispatches on their key.
  m.impl("decode_layers_wide", c10::DispatchKey::CPU, TORCH_FN(decode_layers_wide));
  m.impl("decode_layers_wide", c10::DispatchKey::MkldnnCPU, TORCH_FN(decode_layers_wide));
}
