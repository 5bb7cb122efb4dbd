// Every Llama decoder layer of a decode step in one call and one parallel region: the same
// arithmetic, in the same order, that llama.py's Layer runs between Python lines (rms_norm, the
// Q4_1 matrices, rotary_, paged_decode, SiLU, the residual adds), so the result is bit for bit
// the same.
//
// Why one region. At one sequence a layer is 4 matrices of 0.3-1.8 MB and a few small loops.
// Run as ops, each matrix and the attention was its own parallel region, and the small ops
// between them ATen calls: together they cost about as much as the matrices. Here the threads
// that at::parallel_for starts stay for the whole step and meet at a spin barrier between
// phases (as llama.cpp's threads do between the nodes of its graph), per layer:
//   norm + quantise (rows) | qkv (output rows) | RoPE + K/V into the cache (rows) |
//   attention (heads) | quantise (rows) | o (output rows) | residual + norm + quantise (rows) |
//   gate_up (output rows) | SiLU * up + quantise (rows) | down (output rows) | residual (rows)
// Every element is computed by one thread in an order that does not depend on the split, so the
// number of threads changes nothing in the result.

#include "blocks_avx2.h"
#include "step_kernels.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <thread>
#include <utility>

namespace {

using c10::BFloat16;
using pdserve::blocks::kBlock;
using pdserve::blocks::kInterleave;
using pdserve::blocks::Q4_1x8;
using pdserve::blocks::multiply_interleaved_range;
using pdserve::step::PagedLayer;
using pdserve::step::add_rows;
using pdserve::step::attend_items;
using pdserve::step::silu_times_up;

// The threads of one parallel region, meeting between phases. at::parallel_for(0, parts, 1)
// usually calls the body once per part, each on its own thread; a smaller team (or a call from
// inside another region, run inline) gives a call several parts. So every call joins with its
// range of parts, and the barrier waits for calls, not parts.
class Team {
 public:
  explicit Team(int64_t parts) : parts_(parts) {}

  int64_t parts() const { return parts_; }

  void join(int64_t first, int64_t last) {
    members_.fetch_add(1);
    covered_.fetch_add(last - first);
    int spins = 0;
    while (covered_.load() < parts_) relax(spins);
  }

  // Returns once every member has reached it; what each wrote before is then visible to all.
  // `sense`: the member's own flag, flipped at each barrier.
  void sync(bool& sense) {
    sense = !sense;
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == members_.load()) {
      arrived_.store(0, std::memory_order_relaxed);
      released_.store(sense, std::memory_order_release);
      return;
    }
    int spins = 0;
    while (released_.load(std::memory_order_acquire) != sense) relax(spins);
  }

 private:
  // Spins briefly (a phase lasts microseconds), then yields: on a busy machine the member being
  // waited for may have lost its core, and spinning would keep it off.
  static void relax(int& spins) {
    if (++spins < 2048) {
      _mm_pause();
    } else {
      std::this_thread::yield();
    }
  }

  const int64_t parts_;
  std::atomic<int64_t> members_{0}, covered_{0}, arrived_{0};
  std::atomic<bool> released_{false};
};

// Part `part` of `parts` of [0, total), its bounds multiples of `align` (but the last).
std::pair<int64_t, int64_t> share(int64_t total, int64_t part, int64_t parts, int64_t align) {
  const int64_t pieces = (total + align - 1) / align;
  return {std::min(total, pieces * part / parts * align),
          std::min(total, pieces * (part + 1) / parts * align)};
}

// Rows quantised for the q4 kernel (blocks_avx2.h), and the layer's matrices times them.
struct Quantised : pdserve::blocks::QuantisedRows {

  // Groups [first, last) of 8 output rows of (the quantised x) @ W.T, W Q4_1 interleaved by 8
  // rows ([n / 8, k / 32 * 160]), into out [rows, n].
  template <typename T>
  void times(const at::Tensor& weights, int64_t rows, T* out, int64_t first, int64_t last) const {
    const int64_t k = weights.size(1) / Q4_1x8::kBytes * kBlock;
    multiply_interleaved_range<Q4_1x8>(codes.data(), scales.data(), sums.data(), rows, k,
                               weights.data_ptr<uint8_t>(), weights.size(0) * kInterleave, out,
                               first, last);
  }
};

struct Shapes {
  int64_t rows, width, heads, kv_heads, head_dim, hidden;
  int64_t q_width() const { return heads * head_dim; }
  int64_t kv_width() const { return kv_heads * head_dim; }
  int64_t qkv_width() const { return q_width() + 2 * kv_width(); }
};

struct Weights {
  const at::Tensor &input_norm, &post_norm, &qkv, &o, &gate_up, &down;
  double eps;
};

// What every layer of a step writes between its phases, allocated once for the step: the
// layers run one after another, and each phase's barrier keeps them from overlapping.
template <typename T>
struct Scratch {
  explicit Scratch(const Shapes& s)
      : normed(s.rows * s.width), projected(s.rows * s.qkv_width()),
        attended(s.rows * s.q_width()), mid(s.rows * s.width), both(s.rows * 2 * s.hidden),
        gated(s.rows * s.hidden) {
    quantised.size_for(s.rows, std::max({s.width, s.q_width(), s.hidden}));
  }

  std::vector<T> normed, projected, attended, mid, both, gated;
  Quantised quantised;
};

// One layer's step over a step's scratch; run() is each thread's part of it.
template <typename T>
class LayerStep {
 public:
  LayerStep(const Shapes& shape, const Weights& w, const T* x, const T* cos, const T* sin,
            const PagedLayer<T>& cache, T* out, Scratch<T>& scratch)
      : s_(shape), w_(w), x_(x), cos_(cos), sin_(sin), cache_(cache), out_(out),
        normed_(scratch.normed), projected_(scratch.projected), attended_(scratch.attended),
        mid_(scratch.mid), both_(scratch.both), gated_(scratch.gated),
        quantised_(scratch.quantised) {}

  // The layer for parts [first, last) of team's, which this thread has joined. Its last phase
  // needs no barrier after it: each thread adds its own rows, and the next layer's first phase
  // reads only the same thread's rows.
  void run(Team& team, int64_t first, int64_t last, bool& sense) {
    const auto phase = [&](auto&& work) {
      for (int64_t part = first; part < last; ++part) work(part, team.parts());
      team.sync(sense);
    };
    phase([&](int64_t p, int64_t n) { norm_rows(x_, w_.input_norm, rows(p, n)); });
    phase([&](int64_t p, int64_t n) { multiply(w_.qkv, projected_.data(), p, n); });
    phase([&](int64_t p, int64_t n) { rotate_and_store(rows(p, n)); });
    phase([&](int64_t p, int64_t n) { attend(share(s_.rows * s_.kv_heads, p, n, 1)); });
    phase([&](int64_t p, int64_t n) { quantise(attended_.data(), s_.q_width(), rows(p, n)); });
    phase([&](int64_t p, int64_t n) { multiply(w_.o, mid_.data(), p, n); });
    phase([&](int64_t p, int64_t n) { residual_and_norm(rows(p, n)); });
    phase([&](int64_t p, int64_t n) { multiply(w_.gate_up, both_.data(), p, n); });
    phase([&](int64_t p, int64_t n) { gate(rows(p, n)); });
    phase([&](int64_t p, int64_t n) { multiply(w_.down, out_, p, n); });
    for (int64_t part = first; part < last; ++part) {
      const auto [r0, r1] = rows(part, team.parts());
      add_rows(mid_.data() + r0 * s_.width, out_ + r0 * s_.width, out_ + r0 * s_.width,
               (r1 - r0) * s_.width);
    }
  }

 private:
  using Span = std::pair<int64_t, int64_t>;

  Span rows(int64_t part, int64_t parts) const { return share(s_.rows, part, parts, 1); }

  // The groups of 8 output rows of `weights`, in pieces of two (16 rows) per thread.
  void multiply(const at::Tensor& weights, T* out, int64_t part, int64_t parts) const {
    const auto [g0, g1] = share(weights.size(0), part, parts, 2);
    if (g0 < g1) quantised_.times(weights, s_.rows, out, g0, g1);
  }

  void quantise(const T* x, int64_t k, Span r) { quantised_.rows_of(x, k, r.first, r.second); }

  void norm_rows(const T* x, const at::Tensor& weight, Span r) {
    for (int64_t i = r.first; i < r.second; ++i)
      pdserve::step::rms_norm_row(x + i * s_.width, weight.data_ptr<T>(),
                                  normed_.data() + i * s_.width, s_.width, w_.eps);
    quantise(normed_.data(), s_.width, r);
  }

  void rotate_and_store(Span r) {
    pdserve::step::rotate_and_store(projected_.data(), s_.heads, s_.kv_heads, s_.head_dim, cos_,
                                    sin_, cache_, r.first, r.second);
  }

  void attend(Span items) {
    attend_items(projected_.data(), s_.heads, s_.kv_heads, s_.head_dim, cache_, attended_.data(),
                 items.first, items.second);
  }

  // mid = x + o's output (in mid_), then its norm, quantised for gate_up.
  void residual_and_norm(Span r) {
    const int64_t at = r.first * s_.width, count = (r.second - r.first) * s_.width;
    add_rows(x_ + at, mid_.data() + at, mid_.data() + at, count);
    norm_rows(mid_.data(), w_.post_norm, r);
  }

  // SiLU(gate) * up, quantised for down.
  void gate(Span r) {
    if (r.first == r.second) return;
    silu_times_up(both_.data(), s_.hidden, r.first, r.second, gated_.data());
    quantise(gated_.data(), s_.hidden, r);
  }

  const Shapes s_;
  const Weights w_;
  const T *x_, *cos_, *sin_;
  const PagedLayer<T>& cache_;
  T* out_;
  std::vector<T>&normed_, &projected_, &attended_, &mid_, &both_, &gated_;
  Quantised& quantised_;
};

void check_matrix(const at::Tensor& m, int64_t rows, int64_t columns, const char* name) {
  TORCH_CHECK(m.dim() == 2 && m.scalar_type() == at::kByte && m.is_contiguous() &&
                  columns % kBlock == 0 && rows % kInterleave == 0 &&
                  m.size(0) == rows / kInterleave &&
                  m.size(1) == columns / kBlock * Q4_1x8::kBytes,
              "decode_layers: ", name, " must be Q4_1 blocks interleaved by 8 rows [", rows,
              " / 8, ", columns, " / 32 * 160]");
}

// Every layer of the step in one region: layer i reads buffer i % 2 and writes the other.
template <typename T>
at::Tensor run_layers(const at::Tensor& x, const Shapes& shape, const std::vector<Weights>& weights,
                      const at::Tensor& cos, const at::Tensor& sin,
                      const std::vector<PagedLayer<T>>& caches) {
  const at::Tensor buffers[2] = {x.clone(), at::empty_like(x)};
  Scratch<T> scratch(shape);
  std::vector<LayerStep<T>> layers;
  layers.reserve(weights.size());
  for (size_t i = 0; i < weights.size(); ++i)
    layers.emplace_back(shape, weights[i], buffers[i % 2].data_ptr<T>(), cos.data_ptr<T>(),
                        sin.data_ptr<T>(), caches[i], buffers[(i + 1) % 2].data_ptr<T>(),
                        scratch);
  Team team(at::get_num_threads());
  at::parallel_for(0, team.parts(), 1, [&](int64_t first, int64_t last) {
    team.join(first, last);
    bool sense = false;
    for (LayerStep<T>& layer : layers) layer.run(team, first, last, sense);
  });
  return buffers[weights.size() % 2];
}

// x [rows, width]; per layer, the norms' weights and its Q4_1 matrices interleaved by 8 rows
// (q, k, v stacked in qkv, gate and up in gate_up). cos and sin_signed as rotary_ takes them; kv is the paged cache
// [layers, 2 (keys, values), kv_heads, slots, head_dim], and the slots, blocks and lengths are as
// paged_decode takes them. Returns the last layer's output [rows, width].
at::Tensor decode_layers(const at::Tensor& x, at::TensorList input_norms,
                         at::TensorList post_norms, double eps, at::TensorList qkv,
                         at::TensorList o, at::TensorList gate_up, at::TensorList down,
                         int64_t heads, int64_t kv_heads, int64_t head_dim, const at::Tensor& cos,
                         const at::Tensor& sin_signed, at::Tensor kv, const at::Tensor& new_slots,
                         const at::Tensor& blocks, const at::Tensor& lengths,
                         int64_t block_size) {
  // Everything is checked here, before the region: a thread that threw inside it would leave
  // the others waiting at a barrier.
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "decode_layers: x must be a dense [rows, width]");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "decode_layers: float32 or bfloat16");
  const int64_t count = static_cast<int64_t>(qkv.size());
  TORCH_CHECK(count > 0 && input_norms.size() == qkv.size() && post_norms.size() == qkv.size() &&
                  o.size() == qkv.size() && gate_up.size() == qkv.size() &&
                  down.size() == qkv.size(),
              "decode_layers: one norm pair and four matrices per layer");
  TORCH_CHECK(kv.dim() == 5 && kv.size(0) == count && kv.size(1) == 2 && kv.size(2) == kv_heads,
              "decode_layers: kv must be [layers, 2, kv_heads, slots, head_dim]");
  TORCH_CHECK(gate_up[0].dim() == 2 && gate_up[0].size(0) % 2 == 0,
              "decode_layers: gate_up's rows must be gate's and up's");
  const int64_t hidden = gate_up[0].size(0) * kInterleave / 2;
  const Shapes shape{x.size(0), x.size(1), heads, kv_heads, head_dim, hidden};
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim % 2 == 0,
              "decode_layers: heads must be a multiple of kv_heads, head_dim even");
  TORCH_CHECK(cos.is_contiguous() && sin_signed.is_contiguous() &&
                  cos.numel() == shape.rows * head_dim && sin_signed.numel() == cos.numel() &&
                  cos.scalar_type() == dtype && sin_signed.scalar_type() == dtype,
              "decode_layers: cos and sin must be [rows, 1, head_dim] in x's dtype");
  TORCH_CHECK(new_slots.numel() == shape.rows,
              "decode_layers: one int64 slot per new row of k and v");
  std::vector<at::Tensor> keys, values;  // each layer's, alive for its PagedLayer
  std::vector<Weights> weights;
  for (int64_t i = 0; i < count; ++i) {
    check_matrix(qkv[i], shape.qkv_width(), shape.width, "qkv");
    check_matrix(o[i], shape.width, shape.q_width(), "o");
    check_matrix(gate_up[i], 2 * shape.hidden, shape.width, "gate_up");
    check_matrix(down[i], shape.width, shape.hidden, "down");
    for (const at::Tensor* norm : {&input_norms[i], &post_norms[i]})
      TORCH_CHECK(norm->is_contiguous() && norm->numel() == shape.width &&
                      norm->scalar_type() == dtype,
                  "decode_layers: the norms' weights must be [width] in x's dtype");
    keys.push_back(kv.select(0, i).select(0, 0));
    values.push_back(kv.select(0, i).select(0, 1));
    weights.push_back(Weights{input_norms[i], post_norms[i], qkv[i], o[i], gate_up[i], down[i], eps});
  }
  // Every layer's cache is a slice of kv of the same shape: checking the first checks them all.
  pdserve::step::check_cache(shape.rows, heads, head_dim, dtype, keys[0], values[0], new_slots,
                             blocks, lengths, block_size);
  const auto caches = [&](auto element) {
    using T = decltype(element);
    std::vector<PagedLayer<T>> layers;
    for (int64_t i = 0; i < count; ++i)
      layers.emplace_back(keys[i], values[i], new_slots, blocks, lengths, heads, block_size);
    return layers;
  };
  if (dtype == at::kFloat)
    return run_layers(x, shape, weights, cos, sin_signed, caches(float{}));
  return run_layers(x, shape, weights, cos, sin_signed, caches(BFloat16{}));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def(
      "decode_layers(Tensor x, Tensor[] input_norms, Tensor[] post_norms, float eps, "
      "Tensor[] qkv, Tensor[] o, Tensor[] gate_up, Tensor[] down, int heads, int kv_heads, "
      "int head_dim, Tensor cos, Tensor sin_signed, Tensor(a!) kv, Tensor new_slots, "
      "Tensor blocks, Tensor lengths, int block_size) -> Tensor");
  m.impl("decode_layers", c10::DispatchKey::CPU, TORCH_FN(decode_layers));
}
