"""Would a kernel of our own beat torch's int4 kernel at decode sizes? A probe, not served code.

The engine issue's one-stream goal (ITL at most llama-server's) is out of reach while the q4
layers run on `torch._weight_int4pack_mm_for_cpu`: on this AVX2 CPU its floor alone is above
llama.cpp's whole step. llama.cpp multiplies Q4_1 weights by activations quantised to 8 bits,
one block of 32 at a time, with integer dot products. This builds that scheme as a small AVX2
extension (torch.utils.cpp_extension, g++ at run time) and times it against torch's kernel on
SmolLM2-135M's layer shapes, at the batch sizes a decode step has. Weights are random Q4_1
blocks; both kernels compute the same products, and each result is checked against a float32
matmul of the dequantised weights.

Nothing here is used by pdserve: if the probe shows a gain, serving it is the next step (built
by the README's install, exercised by CI).

  .venv/bin/python bench/q4_kernel_probe.py --threads 1 2 --batches 1 16
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

from common import spread, write_results

RESULTS = Path(__file__).resolve().parent / "results"
GROUP = 32
# SmolLM2-135M: d_model 576, d_ff 1536, 9 heads and 3 KV heads of 64; fused as pdserve fuses them.
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS = 30

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <vector>

// x [rows, k] float32 -> per block of 32: int8 codes, scale d = max|x| / 127, and d * sum(codes).
static void quantize_rows(const float* x, int64_t rows, int64_t k, int8_t* q, float* d, float* s) {
  const int64_t blocks = k / 32;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* v = x + r * k + b * 32;
      float amax = 0.f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float scale = amax / 127.f;
      const float inv = scale > 0.f ? 1.f / scale : 0.f;
      int sum = 0;
      int8_t* out = q + r * k + b * 32;
      for (int i = 0; i < 32; ++i) {
        const int c = (int)std::nearbyint(v[i] * inv);
        out[i] = (int8_t)c;
        sum += c;
      }
      d[r * blocks + b] = scale;
      s[r * blocks + b] = scale * (float)sum;
    }
  }
}

static inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

// codes uint8 [n, k / 2]: per block of 32, byte j holds weight j (low nibble) and j + 16 (high);
// scale, minimum float32 [n, k / 32]; weight = code * scale + minimum. -> x @ weight.T
torch::Tensor q4_1_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scale,
                          torch::Tensor minimum) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous(), "x: contiguous float32");
  const int64_t rows = x.size(0), k = x.size(1), n = codes.size(0), blocks = k / 32;
  TORCH_CHECK(k % 32 == 0 && codes.size(1) == k / 2, "shapes");
  std::vector<int8_t> q(rows * k);
  std::vector<float> d(rows * blocks), s(rows * blocks);
  quantize_rows(x.data_ptr<float>(), rows, k, q.data(), d.data(), s.data());
  auto out = torch::empty({rows, n}, x.options());
  float* o = out.data_ptr<float>();
  const uint8_t* w = codes.data_ptr<uint8_t>();
  const float* ws = scale.data_ptr<float>();
  const float* wm = minimum.data_ptr<float>();
  // Four output rows at a time: four independent accumulators per activation row (one would
  // make every block wait for the last one's multiply-add), and each activation block loaded
  // once for the four.
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    const __m256i low_mask = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    std::vector<__m256> acc(rows * 4);
    std::vector<float> offset(rows * 4);
    for (int64_t j0 = begin; j0 < end; j0 += 4) {
      const int tile = (int)std::min<int64_t>(4, end - j0);
      for (int64_t i = 0; i < rows * 4; ++i) { acc[i] = _mm256_setzero_ps(); offset[i] = 0.f; }
      for (int64_t b = 0; b < blocks; ++b) {
        __m256i c[4];
        float sw[4], mw[4];
        for (int t = 0; t < tile; ++t) {
          const int64_t j = j0 + t;
          const __m128i packed = _mm_loadu_si128((const __m128i*)(w + j * (k / 2) + b * 16));
          c[t] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low_mask);
          sw[t] = ws[j * blocks + b];
          mw[t] = wm[j * blocks + b];
        }
        for (int64_t r = 0; r < rows; ++r) {
          const __m256i a = _mm256_loadu_si256((const __m256i*)(q.data() + r * k + b * 32));
          const float da = d[r * blocks + b], sa = s[r * blocks + b];
          for (int t = 0; t < tile; ++t) {
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(c[t], a), ones);
            acc[r * 4 + t] = _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(p), _mm256_set1_ps(sw[t] * da), acc[r * 4 + t]);
            offset[r * 4 + t] += mw[t] * sa;
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int t = 0; t < tile; ++t) o[r * n + j0 + t] = hsum(acc[r * 4 + t]) + offset[r * 4 + t];
    }
  });
  return out;
}
"""


def build():
    return load_inline(
        "pdserve_q4_probe",
        cpp_sources=SOURCE,
        functions=["q4_1_linear"],
        extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )


class Layer:
    """One random Q4_1 matrix, held both ways: GGUF-style blocks and torch's int4 packing."""

    def __init__(self, rows: int, columns: int, gen: torch.Generator) -> None:
        groups = columns // GROUP
        codes = torch.randint(0, 16, (rows, columns), generator=gen, dtype=torch.int32)
        self.scale = torch.rand(rows, groups, generator=gen) * 0.01 + 1e-3
        self.minimum = -8 * self.scale + torch.randn(rows, groups, generator=gen) * 1e-3
        blocks = codes.view(rows, groups, 2, 16).to(torch.uint8)  # halves: j and j + 16
        self.ours = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(rows, columns // 2)
        self.packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
        zeros = self.minimum + 8 * self.scale
        self.torch_sz = torch.stack([self.scale, zeros], -1).transpose(0, 1).contiguous()
        self.torch_sz = self.torch_sz.to(torch.bfloat16)
        weight = codes.float().view(rows, groups, GROUP) * self.scale[..., None]
        self.dense = (weight + self.minimum[..., None]).view(rows, columns)


def timed(fn, repeats: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(RESULTS / "q4_kernel_probe.json"))
    args = p.parse_args()
    start = time.perf_counter()
    ext = build()
    build_seconds = time.perf_counter() - start
    gen = torch.Generator().manual_seed(0)
    layers = {name: Layer(*shape, gen) for name, shape in SHAPES.items()}
    errors = {}
    for name, layer in layers.items():
        x = torch.randn(4, layer.dense.shape[1], generator=gen)
        want = x @ layer.dense.T
        got = ext.q4_1_linear(x, layer.ours, layer.scale, layer.minimum)
        theirs = torch._weight_int4pack_mm_for_cpu(
            x.bfloat16(), layer.packed, GROUP, layer.torch_sz
        ).float()
        scale = want.abs().max().item()
        errors[name] = {
            "ours_max_error_over_max": (got - want).abs().max().item() / scale,
            "torch_max_error_over_max": (theirs - want).abs().max().item() / scale,
        }

    def step(kernel: str, batch: int):
        inputs = {c: torch.randn(batch, c).bfloat16() for c in {s[1] for s in SHAPES.values()}}

        def run() -> None:  # one decode step's linears: every layer's four matrices, 30 times
            for _ in range(LAYERS):
                for layer in layers.values():
                    x = inputs[layer.dense.shape[1]]
                    if kernel == "ours":
                        ext.q4_1_linear(x.float(), layer.ours, layer.scale, layer.minimum)
                    else:
                        torch._weight_int4pack_mm_for_cpu(x, layer.packed, GROUP, layer.torch_sz)

        return run

    configs = [(k, t, b) for t in args.threads for b in args.batches for k in ("torch", "ours")]
    runs = {c: step(c[0], c[2]) for c in configs}
    times: dict[tuple, list[float]] = {c: [] for c in configs}
    for _ in range(args.repeats):  # interleaved: each repeat times every configuration once
        for c in configs:
            torch.set_num_threads(c[1])
            times[c].append(timed(runs[c], 3))
    rows = []
    for t in args.threads:
        for b in args.batches:
            theirs, ours = times[("torch", t, b)], times[("ours", t, b)]
            ratio = spread(a / o for a, o in zip(theirs, ours))
            rows.append(
                {
                    "threads": t,
                    "batch": b,
                    "torch_int4_ms": spread(theirs),
                    "ours_ms": spread(ours),
                    "torch_over_ours": ratio,
                }
            )
            print(
                f"threads {t} batch {b:>2}: torch int4 {statistics.median(theirs):6.1f} ms, "
                f"ours {statistics.median(ours):6.1f} ms, torch/ours {ratio['median']:.2f} "
                f"({ratio['min']:.2f}-{ratio['max']:.2f})"
            )
    print("errors against float32 of the dequantised weights:", errors)
    conditions = {
        "what": "30 layers x SmolLM2-135M's four fused q4 matrices (one decode step's linears, "
        "without the head), random Q4_1 blocks; median of 3 timings per repeat",
        "shapes": SHAPES,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "build_seconds": build_seconds,
        "ours": "AVX2: activations quantised per block of 32 to int8 (scale max/127), "
        "maddubs/madd integer dot products, float accumulation, 4 output rows per tile; "
        "parallel over output rows",
    }
    write_results(args.out, conditions, rows=rows, errors=errors)


if __name__ == "__main__":
    main()
