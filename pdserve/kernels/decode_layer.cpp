// One Llama decoder layer of a decode step in one call: the same ops, in the same order, that
// llama.py's Layer runs between Python lines (rms_norm, the Q4_1 matrices, rotary_,
// paged_decode, SiLU, the residual adds), so the result is bit for bit the same. At one sequence
// the Python and dispatch between about fifteen calls per layer cost more than attention, the
// norms and RoPE together; here they are C++ calls through the dispatcher.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace {

using Linear = at::Tensor(const at::Tensor&, const at::Tensor&);
using Norm = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using Rotate = void(at::Tensor, at::Tensor, const at::Tensor&, const at::Tensor&);
using Attend = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor,
                          at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          int64_t);

template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// The library's own ops (blocks_avx2.cpp, step_ops.cpp), found once.
struct Ops {
  c10::TypedOperatorHandle<Linear> linear = op<Linear>("pdserve::q4_1_linear");
  c10::TypedOperatorHandle<Norm> norm = op<Norm>("pdserve::rms_norm");
  c10::TypedOperatorHandle<Rotate> rotate = op<Rotate>("pdserve::rotary_");
  c10::TypedOperatorHandle<Attend> attend = op<Attend>("pdserve::paged_decode");
};

const Ops& ops() {
  static const Ops found;
  return found;
}

// x [rows, width]; the weights are Q4_1 block matrices; q, k, v stacked in qkv, gate and up in
// gate_up. cos and sin_signed as rotary_ takes them; the caches, slots, blocks and lengths as
// paged_decode takes them. Returns the layer's output [rows, width].
at::Tensor decode_layer(const at::Tensor& x, const at::Tensor& input_norm,
                        const at::Tensor& post_norm, double eps, const at::Tensor& qkv,
                        const at::Tensor& o, const at::Tensor& gate_up, const at::Tensor& down,
                        int64_t heads, int64_t kv_heads, int64_t head_dim, const at::Tensor& cos,
                        const at::Tensor& sin_signed, at::Tensor key_cache,
                        at::Tensor value_cache, const at::Tensor& new_slots,
                        const at::Tensor& blocks, const at::Tensor& lengths,
                        int64_t block_size) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "decode_layer: x must be a dense [rows, width]");
  const Ops& f = ops();
  const int64_t rows = x.size(0), q_width = heads * head_dim, kv_width = kv_heads * head_dim;
  const at::Tensor projected = f.linear.call(f.norm.call(x, input_norm, eps), qkv);
  TORCH_CHECK(projected.size(1) == q_width + 2 * kv_width,
              "decode_layer: qkv's rows must be q's, k's and v's");
  at::Tensor q = projected.narrow(1, 0, q_width).view({rows, heads, head_dim});
  at::Tensor k = projected.narrow(1, q_width, kv_width).view({rows, kv_heads, head_dim});
  at::Tensor v = projected.narrow(1, q_width + kv_width, kv_width).view({rows, kv_heads, head_dim});
  f.rotate.call(q, k, cos, sin_signed);
  const at::Tensor attended = f.attend.call(q, k, v, key_cache, value_cache, new_slots, blocks,
                                            lengths, block_size);
  const at::Tensor mid = x + f.linear.call(attended.reshape({rows, q_width}), o);
  const at::Tensor both = f.linear.call(f.norm.call(mid, post_norm, eps), gate_up);
  TORCH_CHECK(both.size(1) % 2 == 0, "decode_layer: gate_up's rows must be gate's and up's");
  const int64_t hidden = both.size(1) / 2;
  const at::Tensor gated = at::silu(both.narrow(1, 0, hidden)) * both.narrow(1, hidden, hidden);
  return mid + f.linear.call(gated, down);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def(
      "decode_layer(Tensor x, Tensor input_norm, Tensor post_norm, float eps, Tensor qkv, "
      "Tensor o, Tensor gate_up, Tensor down, int heads, int kv_heads, int head_dim, Tensor cos, "
      "Tensor sin_signed, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor new_slots, "
      "Tensor blocks, Tensor lengths, int block_size) -> Tensor");
  m.impl("decode_layer", c10::DispatchKey::CPU, TORCH_FN(decode_layer));
}
