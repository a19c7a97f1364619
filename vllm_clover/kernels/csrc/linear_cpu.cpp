// float32 linear layers for vLLM's CPU build: y [M, N] = x [M, K] @ W[N, K]^T (+ bias), with W
// packed once at load into column blocks of 16, [ceil(N/16), K, 16] (block j holds columns
// 16j..16j+15, contiguous over k).
//
// Why: at the row counts of decoding and of verifying a token tree (1 to ~40 rows), oneDNN's
// float32 matmul, vLLM's choice for float32 weights on CPU (model_executor/layers/utils.py,
// dispatch_cpu_unquantized_gemm), is far from both the memory and the compute bound, on
// AVX-512 and on AVX2 CPUs (timings against it: docs/cpu-linear.md). Here each weight vector
// is loaded once per register tile of rows, up to 14 on AVX-512 and 8 on AVX2 (more rows on
// AVX2: several tiles of 6 taking turns on each chunk of k), and used in one FMA per row, with
// the next vectors prefetched. Built for AVX-512 or for AVX2 + FMA
// (vllm_clover/kernels/linear_cpu.py picks the flags).
//
// Weights in bfloat16 (pack_bf16 / linear_bf16w; the drafter's products, option draft_dtype):
// the same layout and tiles with 2-byte weights widened to float in registers (a bf16 is a
// float's top half), so a pass streams half the bytes; x, the products and the sums stay float.
//
// Numerics: every output element is one FMA chain over k = 0..K-1 in order, started at 0,
// whatever M, the row's position in the batch or the tile shape; a row's result is therefore
// bit-identical in a 1-row decode step and inside a many-row verify or prefill step. That is
// the property speculative decoding's greedy losslessness needs from the target's matmuls.
// Do not build with -ffast-math (it would allow re-associating the chains).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include <immintrin.h>

namespace {

constexpr int64_t kBlock = 16;      // columns per packed block (one zmm, or two ymm, of floats)
constexpr int64_t kColTile = 8;     // column blocks per parallel work item
constexpr int64_t kRowPanel = 240;  // rows per pass over the weights (x panel stays in L2)

#if defined(__AVX512F__)
// AVX-512: one zmm per packed block, 32 registers.
using Vec = __m512;
constexpr int kVecs = 1;  // vectors per packed block
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vbroadcast(float v) { return _mm512_set1_ps(v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
// Rows per register tile. 14 x 2 column blocks (28 accumulators + 2 weight vectors) fits the 32
// zmm registers with room to spare, and 13-14 rows in one tile cost ~12% less than as two tiles
// of 7 (docs/results/*-fp32-14-rows.md). One column block of up to 30 rows is no
// faster than two tiles at 16-36 rows: at these row counts the FMAs do not overlap the weight
// stream, so the cost per row is the compute (docs/cpu-linear.md).
constexpr int kMaxRows = 14;
constexpr int kTileRows = 14;  // rows per tile when a panel needs several (more than kMaxRows)
constexpr int64_t kPrefetch = 24;  // k steps ahead for software prefetch of weight lines
constexpr int64_t kPrefetchBf16 = 48;  // the same bytes ahead for bfloat16 weights
constexpr bool kChunkTiles = false;  // see kChunk; AVX-512 runs one pass over k (chunks untested there)
// Column vectors (= blocks) per register tile for MR rows: MR * CV accumulators + CV weight
// vectors stay within the 32 zmm registers.
constexpr int cols_for_rows(int mr) {
  return mr <= 2 ? 8 : mr <= 4 ? 6 : mr <= 6 ? 4 : mr <= 8 ? 3 : 2;  // 14 x 2 + 2 = 30
}
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 + FMA: two ymm per packed block (the packed layout is the same on both ISAs) and 16
// registers; tiles are counted in vectors: up to 8 rows x 2 vectors; more rows make several
// row tiles of at most 6, run over k in chunks.
using Vec = __m256;
constexpr int kVecs = 2;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vbroadcast(float v) { return _mm256_set1_ps(v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
// Up to 8 rows: one tile of 2 vectors (at 7-8 rows the compiler keeps some operands in memory);
// more rows: several tiles of at most 6 rows x 2 vectors over k chunks. This is 8-26% faster at
// 7-14 rows than one tile of up to 14 rows x 1 vector (half a packed block), level at 1-6, and
// three tiles of 5-6 beat two of 8 at 15-16 rows (docs/cpu-linear.md "AVX2 tiles of 7-14 rows").
constexpr int kMaxRows = 8;
constexpr int kTileRows = 6;
constexpr int64_t kPrefetch = 96;  // k steps ahead for software prefetch of weight lines
// bfloat16 weights (the drafter's products, 1-3 rows): 96 k steps as well; 192 (the same bytes
// ahead) is ~4% slower at one row.
constexpr int64_t kPrefetchBf16 = 96;
constexpr bool kChunkTiles = true;
// Column vectors per register tile for MR rows: up to 6 rows, MR * CV accumulators + CV weight
// vectors + 1 broadcast within 16 (1 row: each weight is used once, so it is loaded into the
// FMA); 7-8 rows x 2 spill to L1, and are still faster than two tiles (above).
constexpr int cols_for_rows(int mr) {
  return mr <= 1 ? 8 : mr <= 2 ? 4 : mr <= 3 ? 3 : 2;
}
#else
#error "linear_cpu.cpp needs AVX-512F, or AVX2 with FMA (vllm_clover/kernels/linear_cpu.py passes the flags)"
#endif
constexpr int kVecFloats = kBlock / kVecs;
// k steps per chunk (where kChunkTiles) when several row tiles read the same weight lines: in
// one pass over k each tile would stream the lines from memory while doing only its share of
// their FMAs, and the next tile read them again after the stream has moved on. In chunks, the
// next tile finds the chunk's lines in L1/L2.
constexpr int64_t kChunk = 128;

// One packed column vector of weights as floats: float weights as they are, bfloat16 ones
// (stored as their uint16 bits) shifted into a float's top half.
inline Vec wload(const float* p) { return vload(p); }
inline Vec wload(const uint16_t* p) {
#if defined(__AVX512F__)
  const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
#else
  const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
#endif
}

// Address of packed column vector v (block v / kVecs, its (v % kVecs)-th part) at step k.
template <typename W>
inline const W* wvec(const W* wp, int64_t K, int64_t v, int64_t k) {
  return wp + ((v / kVecs) * K + k) * kBlock + (v % kVecs) * kVecFloats;
}

// One register tile: MR rows of x times CV packed column vectors, starting at vector v0, over
// k in [k0, k1). The accumulators start at 0 when k0 == 0, else they resume the partial sums
// this tile stored in y for [0, k0): each output stays one in-order FMA chain over k.
// W: float or uint16_t (bfloat16 bits).
template <int MR, int CV, typename W>
inline void tile(const float* x, int64_t K, const W* wp, int64_t v0, float* y, int64_t N, int64_t k0,
                 int64_t k1) {
  constexpr int64_t prefetch = sizeof(W) == sizeof(float) ? kPrefetch : kPrefetchBf16;
  Vec acc[MR][CV];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < CV; ++c) {
      const int64_t n = (v0 + c) * kVecFloats;
      if (k0 == 0) {
        acc[r][c] = vzero();
      } else if (n + kVecFloats <= N) {
        acc[r][c] = vload(y + r * N + n);
      } else {  // the last, partial vector: its stored columns, zeros past N
        alignas(64) float tail[kVecFloats] = {};
        if (n < N) std::copy(y + r * N + n, y + r * N + N, tail);
        acc[r][c] = vload(tail);
      }
    }
  for (int64_t k = k0; k < k1; ++k) {
    Vec w[CV];
#pragma GCC unroll 16
    for (int c = 0; c < CV; ++c) {
      w[c] = wload(wvec(wp, K, v0 + c, k));
      _mm_prefetch(reinterpret_cast<const char*>(wvec(wp, K, v0 + c, k + prefetch)), _MM_HINT_T0);
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const Vec xb = vbroadcast(x[r * K + k]);
#pragma GCC unroll 16
      for (int c = 0; c < CV; ++c) acc[r][c] = vfma(xb, w[c], acc[r][c]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < CV; ++c) {
      const int64_t n = (v0 + c) * kVecFloats;
      if (n + kVecFloats <= N) {
        vstore(y + r * N + n, acc[r][c]);
      } else if (n < N) {  // the last, partial vector (the packed block is zero-padded)
        alignas(64) float tail[kVecFloats];
        vstore(tail, acc[r][c]);
        std::copy(tail, tail + (N - n), y + r * N + n);
      }
    }
}

// The last rem (< CV) column vectors of a row tile, as one register tile of that width.
template <int MR, int R, typename W>
void tile_rest(int64_t rem, const float* x, int64_t K, const W* wp, int64_t v0, float* y, int64_t N, int64_t k0,
               int64_t k1) {
  if (rem == R) {
    tile<MR, R>(x, K, wp, v0, y, N, k0, k1);
  } else if constexpr (R > 1) {
    tile_rest<MR, R - 1>(rem, x, K, wp, v0, y, N, k0, k1);
  }
}

// Column vectors [v0, v1) for one tile of MR rows, in steps of cols_for_rows(MR).
template <int MR, typename W>
void tile_rows(const float* x, int64_t K, const W* wp, float* y, int64_t N, int64_t v0, int64_t v1, int64_t k0,
               int64_t k1) {
  constexpr int CV = cols_for_rows(MR);
  int64_t v = v0;
  for (; v + CV <= v1; v += CV) tile<MR, CV>(x, K, wp, v, y, N, k0, k1);
  if constexpr (CV > 1) {
    if (v < v1) tile_rest<MR, CV - 1>(v1 - v, x, K, wp, v, y, N, k0, k1);
  }
}

template <int MR, typename W>
void dispatch_rows(int64_t mr, const float* x, int64_t K, const W* wp, float* y, int64_t N, int64_t v0,
                   int64_t v1, int64_t k0, int64_t k1) {
  if (mr == MR) {
    tile_rows<MR>(x, K, wp, y, N, v0, v1, k0, k1);
  } else if constexpr (MR > 1) {
    dispatch_rows<MR - 1>(mr, x, K, wp, y, N, v0, v1, k0, k1);
  }
}

void check_packed(const char* op, const torch::Tensor& packed, at::ScalarType dtype, int64_t n, int64_t k) {
  TORCH_CHECK(packed.scalar_type() == dtype && packed.dim() == 3 && packed.is_contiguous(), op,
              ": packed weight must be a contiguous ", c10::toString(dtype), " [ceil(N/16), K, 16] tensor");
  TORCH_CHECK(packed.size(0) == (n + kBlock - 1) / kBlock && packed.size(1) == k && packed.size(2) == kBlock,
              op, ": packed weight ", packed.sizes(), " does not match N=", n, ", K=", k);
}

// W [N, K] (contiguous, element type T) -> [ceil(N/16), K, 16], zero-padded past column N.
template <typename T>
void pack_blocks(const T* src, int64_t n, int64_t k, T* dst) {
  const int64_t nb = (n + kBlock - 1) / kBlock;
  at::parallel_for(0, nb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j)
      for (int64_t c = 0; c < kBlock && j * kBlock + c < n; ++c)
        for (int64_t i = 0; i < k; ++i) dst[(j * k + i) * kBlock + c] = src[(j * kBlock + c) * k + i];
  });
}

// y [M, N] = x [M, K] @ W^T (+ bias) over the packed weight's elements wp (float or bf16 bits).
template <typename W>
torch::Tensor linear_impl(const char* op, const torch::Tensor& x, const torch::Tensor& packed, const W* wp,
                          int64_t n, const c10::optional<torch::Tensor>& bias) {
  const auto xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1);
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->dim() == 1 && bias->size(0) == n), op, ": bias must be [N]");
  auto y = torch::empty({m, n}, xc.options());
  if (m == 0) return y;
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Column tiles of at most kColTile blocks, as many per thread (on 2 threads 576 columns
  // = 36 blocks make 6 tiles of 6, not 5 tiles of 8 split 3:2).
  const int64_t nb = packed.size(0), threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t rounds = (nb + threads * kColTile - 1) / (threads * kColTile);
  const int64_t width = std::max<int64_t>(1, (nb + threads * rounds - 1) / (threads * rounds));
  const int64_t col_tiles = (nb + width - 1) / width;
  for (int64_t p0 = 0; p0 < m; p0 += kRowPanel) {
    const int64_t rows = std::min(kRowPanel, m - p0);
    const int64_t tiles = rows <= kMaxRows ? 1 : (rows + kTileRows - 1) / kTileRows;
    const int64_t mr0 = (rows + tiles - 1) / tiles;  // even tiles
    // One pass over k while the panel is one row tile; else (where kChunkTiles) k in chunks,
    // every row tile taking its turn on a chunk while its weight lines are in L1/L2.
    const int64_t kc = kChunkTiles && tiles > 1 ? kChunk : k;
    at::parallel_for(0, col_tiles, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t j0 = t * width, j1 = std::min(nb, j0 + width);
        for (int64_t k0 = 0; k0 < k; k0 += kc) {
          const int64_t k1 = std::min(k, k0 + kc);
          for (int64_t r = p0; r < p0 + rows; r += mr0) {
            const int64_t mr = std::min(mr0, p0 + rows - r);
            dispatch_rows<kMaxRows>(mr, xp + r * k, k, wp, yp + r * n, n, j0 * kVecs, j1 * kVecs, k0, k1);
          }
        }
      }
    });
  }
  if (has_bias) y.add_(bias->to(at::kFloat));
  return y;
}

void check_x(const char* op, const torch::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.device().is_cpu(), op,
              ": x must be a float32 [M, K] CPU tensor, got ", x.scalar_type(), " ", x.sizes());
}

}  // namespace

// W [N, K] float32 -> [ceil(N/16), K, 16], zero-padded past column N.
torch::Tensor pack_f32(const torch::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 2, "pack_f32: need a float32 [N, K] weight");
  const auto w = weight.contiguous();
  auto out = torch::zeros({(w.size(0) + kBlock - 1) / kBlock, w.size(1), kBlock}, w.options());
  pack_blocks(w.data_ptr<float>(), w.size(0), w.size(1), out.data_ptr<float>());
  return out;
}

// W [N, K] bfloat16 -> [ceil(N/16), K, 16] bfloat16, zero-padded past column N.
torch::Tensor pack_bf16(const torch::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2, "pack_bf16: need a bfloat16 [N, K] weight");
  const auto w = weight.contiguous();
  auto out = torch::zeros({(w.size(0) + kBlock - 1) / kBlock, w.size(1), kBlock}, w.options());
  pack_blocks(reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), w.size(0), w.size(1),
              reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  return out;
}

// x [M, K] float32 (any strides; copied if not contiguous), packed from pack_f32 of W [N, K],
// bias [N] or None -> y [M, N] float32.
torch::Tensor linear_f32(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                         const c10::optional<torch::Tensor>& bias) {
  check_x("linear_f32", x);
  check_packed("linear_f32", packed, at::kFloat, n, x.size(1));
  return linear_impl("linear_f32", x, packed, packed.data_ptr<float>(), n, bias);
}

// As linear_f32 over pack_bf16's weights: float32 x, products and sums; y [M, N] float32.
torch::Tensor linear_bf16w(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                           const c10::optional<torch::Tensor>& bias) {
  check_x("linear_bf16w", x);
  check_packed("linear_bf16w", packed, at::kBFloat16, n, x.size(1));
  return linear_impl("linear_bf16w", x, packed, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()),
                     n, bias);
}

TORCH_LIBRARY(vllm_clover_cpu, m) {
  m.def("linear_f32(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("pack_f32(Tensor weight) -> Tensor");
  m.def("linear_bf16w(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("pack_bf16(Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_clover_cpu, CPU, m) {
  m.impl("linear_f32", &linear_f32);
  m.impl("pack_f32", &pack_f32);
  m.impl("linear_bf16w", &linear_bf16w);
  m.impl("pack_bf16", &pack_bf16);
}

// Callers use the torch ops above (torch.ops.vllm_clover_cpu.*); the Python module only lets
// torch.utils.cpp_extension.load import the library, which registers them.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
