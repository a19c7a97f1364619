// Tree-masked attention for vLLM's CPU KV cache (CPU_ATTN, vec / vec16 ISAs), read in place.
//
// Why a kernel: the PyTorch path (vllm_clover/tree_verify.py) first gathers each request's
// whole paged K/V prefix into contiguous tensors, once per layer per step; at batch 1 that
// gather is most of what the tree rows cost per layer on a 2-core CPU. This reads the blocks
// where they are.
//
// Layouts (docs/tree-verification.md, checked at start-up by check_cpu_kv_layout against
// vLLM's own cpu_attn_reshape_and_cache): kv_cache [num_blocks, Hkv, BS, 2*D]; per (block,
// kv head) a key half of BS*D elements, then a value half of BS*D.
//   kLayoutVec ("vec", "vec16" ISAs): key half transposed [D][BS], value half [BS][D].
//   kLayoutAmx ("amx" ISA: bfloat16 on CPUs with AMX tiles), packed for AMX tile loads:
//     key (t, e) at (t/16)*16*D + (e/2)*32 + (t%16)*2 + e%2   (16-token groups of dim pairs)
//     value (t, e) at (e/16)*16*BS + (t/2)*32 + (e%16)*2 + t%2 (16-dim groups of token pairs)
//   Pass 1 reads an AMX block through a float copy in the vec order (amx_to_float).
// Semantics per tree request r (meta[r] = row_start, n1, root, req_index): row i of its n1
// rows (node i, node 0 = root token at position `root`) attends to positions 0..root-1 and
// to tree nodes j (position root + j) with anc[r][i][j] != 0 (anc[r][i][0] and [i][i] must be
// set); output[row_start + i] is overwritten, every other row is left alone.
//
// Work split (flash-decoding style, two passes):
//   1. one item per (request, kv head, KV block of its positions): all n1 * group queries of
//      that kv head share each K/V load (the key half is [D][BS], so scores accumulate over
//      the head dim with the positions as the vector lane); each item leaves a partial
//      softmax (running max m, sum l, unnormalised output acc[D]) per query;
//   2. one item per (request, query row, query head): merge its partials over blocks.
//   At batch 1 this still gives Hkv * blocks items (e.g. 3 x 4 at 400 tokens) for the cores.
// Built with -mavx512f (AVX-512 CPUs), pass 1's two products run in register tiles (qk_tile,
// pv_tile) when BS % 32 == 0 and D % 64 == 0: 10 rows x 700 positions of the default model's
// heads (9 x 64, 3 KV heads) in 97 us instead of 325 us (2-core Xeon, AVX-512; the loops were
// load/store-bound, a score or output element per multiply-add). Elsewhere, the plain loops.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <type_traits>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <vector>

namespace {

// Score of a masked (invisible) tree position: finite, exp(kMasked - max) == 0.
constexpr float kMasked = -1e30f;

constexpr int64_t kLayoutVec = 0, kLayoutAmx = 1;

inline int64_t amx_key_index(int64_t t, int64_t e, int64_t d) { return (t / 16) * 16 * d + (e / 2) * 32 + (t % 16) * 2 + e % 2; }
inline int64_t amx_value_index(int64_t t, int64_t e, int64_t bs) { return (e / 16) * 16 * bs + (t / 2) * 32 + (e % 16) * 2 + t % 2; }

// One (block, kv head) of the AMX layout, positions 0..cnt-1 (rounded up to whole 16-token
// groups, inside the block) -> float in the vec order: key [D][BS] at f, value [BS][D] at
// f + BS*D. A run of 32 bf16 holds an (even, odd) pair per lane: even lanes are dims 2p
// (key) or token 2p (value), odd lanes the next; bf16 -> float is a 16-bit shift.
inline void amx_to_float(const c10::BFloat16* __restrict base, int64_t cnt, int64_t bs, int64_t d, float* __restrict f) {
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(base);
  const int64_t groups = (cnt + 15) / 16;
  auto split = [](const uint16_t* src, float* even, float* odd) {
#ifdef __AVX512F__
    const __m512i x = _mm512_loadu_si512(src);
    _mm512_storeu_ps(even, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)));
    _mm512_storeu_ps(odd, _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)))));
#else
    for (int i = 0; i < 16; ++i) {
      uint32_t lo = static_cast<uint32_t>(src[2 * i]) << 16, hi = static_cast<uint32_t>(src[2 * i + 1]) << 16;
      std::memcpy(even + i, &lo, 4);
      std::memcpy(odd + i, &hi, 4);
    }
#endif
  };
  for (int64_t g = 0; g < groups; ++g)  // key: group g, dim pair p -> rows 2p, 2p+1 of [D][BS]
    for (int64_t p = 0; p < d / 2; ++p)
      split(raw + g * 16 * d + p * 32, f + (2 * p) * bs + g * 16, f + (2 * p + 1) * bs + g * 16);
  float* fv = f + bs * d;
  float even[16], odd[16];
  for (int64_t tp = 0; tp < groups * 8; ++tp)  // value: token pair tp, dim group eg
    for (int64_t eg = 0; eg < d / 16; ++eg) {
      split(raw + bs * d + eg * 16 * bs + tp * 32, even, odd);
      std::memcpy(fv + (2 * tp) * d + eg * 16, even, sizeof(even));
      std::memcpy(fv + (2 * tp + 1) * d + eg * 16, odd, sizeof(odd));
    }
}

// Register tiles of the AVX-512 path: QT queries x JT positions of scores (QK: 8 zmm
// accumulators), QT queries x ET head dims of output (PV: 16). The general loops load and
// store a score (or output) element per multiply-add.
#ifdef __AVX512F__
constexpr bool kTiles = true;
#else
constexpr bool kTiles = false;
#endif
constexpr int64_t kQT = 4, kJT = 32, kET = 64;

#ifdef __AVX512F__
// s[a][j] = sum_e q[a][e] * k[e][j] for a < QT, j < JT. q: QT rows of d (padded rows are
// zero); k: the key half at the tile's first position, rows of stride bs; s: row stride bs.
inline void qk_tile(const float* __restrict q, int64_t d, const float* __restrict k, int64_t bs,
                    float* __restrict s) {
  __m512 acc[kQT][2];
  for (int a = 0; a < kQT; ++a) acc[a][0] = acc[a][1] = _mm512_setzero_ps();
  for (int64_t e = 0; e < d; ++e) {
    const __m512 k0 = _mm512_loadu_ps(k + e * bs), k1 = _mm512_loadu_ps(k + e * bs + 16);
    for (int a = 0; a < kQT; ++a) {
      const __m512 qa = _mm512_set1_ps(q[a * d + e]);
      acc[a][0] = _mm512_fmadd_ps(qa, k0, acc[a][0]);
      acc[a][1] = _mm512_fmadd_ps(qa, k1, acc[a][1]);
    }
  }
  for (int a = 0; a < kQT; ++a) {
    _mm512_storeu_ps(s + a * bs, acc[a][0]);
    _mm512_storeu_ps(s + a * bs + 16, acc[a][1]);
  }
}

// o[a][e] = sum_{j < cnt} w[a][j] * v[j][e] for a < qt, e < ET. w: rows of stride bs; v: the
// value half at the tile's first head dim, rows of stride d; o: rows of stride ostride.
inline void pv_tile(const float* __restrict w, int64_t bs, const float* __restrict v, int64_t d, int64_t cnt,
                    float* __restrict o, int64_t ostride, int64_t qt) {
  __m512 acc[kQT][4];
  for (int a = 0; a < kQT; ++a)
    for (int c = 0; c < 4; ++c) acc[a][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < cnt; ++j) {
    const float* vr = v + j * d;
    const __m512 v0 = _mm512_loadu_ps(vr), v1 = _mm512_loadu_ps(vr + 16), v2 = _mm512_loadu_ps(vr + 32),
                 v3 = _mm512_loadu_ps(vr + 48);
    for (int a = 0; a < kQT; ++a) {
      const __m512 wa = _mm512_set1_ps(w[a * bs + j]);
      acc[a][0] = _mm512_fmadd_ps(wa, v0, acc[a][0]);
      acc[a][1] = _mm512_fmadd_ps(wa, v1, acc[a][1]);
      acc[a][2] = _mm512_fmadd_ps(wa, v2, acc[a][2]);
      acc[a][3] = _mm512_fmadd_ps(wa, v3, acc[a][3]);
    }
  }
  for (int64_t a = 0; a < qt; ++a)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o + a * ostride + 16 * c, acc[a][c]);
}
#else
inline void qk_tile(const float*, int64_t, const float*, int64_t, float*) {}
inline void pv_tile(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t, int64_t) {}
#endif

template <typename T>
void tree_attention_impl(const torch::Tensor& query, const torch::Tensor& kv_cache, torch::Tensor& output,
                         const torch::Tensor& meta, const torch::Tensor& block_table,
                         const torch::Tensor& anc, double scale, int64_t layout) {
  const int64_t num_heads = query.size(1), d = query.size(2);
  const int64_t hkv = kv_cache.size(1), bs = kv_cache.size(2);
  const int64_t group = num_heads / hkv;
  const int64_t num_req = meta.size(0), nmax = anc.size(1);
  const int64_t q_s0 = query.stride(0), q_s1 = query.stride(1);
  const int64_t o_s0 = output.stride(0), o_s1 = output.stride(1);
  const int64_t bt_s0 = block_table.stride(0);
  const T* q = query.data_ptr<T>();
  const T* kv = kv_cache.data_ptr<T>();
  T* out = output.data_ptr<T>();
  const int64_t* m = meta.data_ptr<int64_t>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const uint8_t* mask = anc.data_ptr<uint8_t>();
  const int64_t head_stride = bs * 2 * d;  // one (block, kv head): key half + value half

  int64_t num_chunks = 1;  // KV blocks of the longest request
  for (int64_t r = 0; r < num_req; ++r)
    num_chunks = std::max(num_chunks, (m[r * 4 + 2] + m[r * 4 + 1] + bs - 1) / bs);
  const int64_t qmax = nmax * group;  // queries per (request, kv head)
  const int64_t part = d + 2;         // one partial: acc[D], m, l
  std::vector<float> partials(num_req * hkv * num_chunks * qmax * part);

  // Pass 1: (request, kv head, chunk) -> partial softmax of each of its queries.
  // Tiled path when the block and head sizes are multiples of the tiles (the default model:
  // BS 128, D 64); the loops below stay as the general path.
  const bool tiled = kTiles && bs % kJT == 0 && d % kET == 0;
  const int64_t qpad = (qmax + kQT - 1) / kQT * kQT;  // query rows padded to whole tiles
  at::parallel_for(0, num_req * hkv * num_chunks, 1, [&](int64_t begin, int64_t end) {
    // A float copy of each (block, head) in the vec order, unless the cache is one already.
    const bool direct = std::is_same<T, float>::value && layout == kLayoutVec;
    std::vector<float> qf(qpad * d, 0.0f), s(qpad * bs), kvf(direct ? 0 : 2 * bs * d);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t r = w / (hkv * num_chunks), h = (w / num_chunks) % hkv, c = w % num_chunks;
      const int64_t start = m[r * 4], n1 = m[r * 4 + 1], root = m[r * 4 + 2], req = m[r * 4 + 3];
      const int64_t p0 = c * bs, p1 = std::min(root + n1, p0 + bs);
      float* pw = partials.data() + ((r * hkv + h) * num_chunks + c) * qmax * part;
      const int64_t nq = n1 * group;  // query index qi = i * group + g (row i, head h*group+g)
      if (p0 >= p1) {
        for (int64_t qi = 0; qi < nq; ++qi) pw[qi * part + d + 1] = 0.0f;  // empty: l = 0
        continue;
      }
      const int64_t cnt = p1 - p0;
      for (int64_t i = 0; i < n1; ++i)
        for (int64_t g = 0; g < group; ++g) {
          const T* qp = q + (start + i) * q_s0 + (h * group + g) * q_s1;
          float* dst = qf.data() + (i * group + g) * d;
          for (int64_t e = 0; e < d; ++e) dst[e] = static_cast<float>(qp[e]) * static_cast<float>(scale);
        }
      std::fill(qf.begin() + nq * d, qf.end(), 0.0f);  // padding rows (an earlier item's queries)
      const T* base = kv + (static_cast<int64_t>(bt[req * bt_s0 + c]) * hkv + h) * head_stride;
      // A float view of this (block, head) in the vec order (key [D][BS], value [BS][D]): the
      // cache itself, or a float copy of its first cnt positions.
      const float* kf = kvf.data();
      if constexpr (std::is_same<T, float>::value) {
        if (direct) kf = base;
      }
      if constexpr (std::is_same<T, c10::BFloat16>::value) {
        if (layout == kLayoutAmx) amx_to_float(base, cnt, bs, d, kvf.data());
      }
      if (!direct && layout == kLayoutVec) {
        for (int64_t e = 0; e < d; ++e)
          for (int64_t j = 0; j < cnt; ++j) kvf[e * bs + j] = static_cast<float>(base[e * bs + j]);
        for (int64_t j = 0; j < cnt; ++j)
          for (int64_t e = 0; e < d; ++e) kvf[bs * d + j * d + e] = static_cast<float>(base[bs * d + j * d + e]);
      }
      if (tiled) {
        // Whole JT-position tiles: positions cnt..round-up(cnt) are read (inside the block) and
        // their scores never used.
        const int64_t cnt_tiles = (cnt + kJT - 1) / kJT * kJT;
        for (int64_t qi0 = 0; qi0 < nq; qi0 += kQT)
          for (int64_t j0 = 0; j0 < cnt_tiles; j0 += kJT) qk_tile(qf.data() + qi0 * d, d, kf + j0, bs, s.data() + qi0 * bs + j0);
      } else {
        // Scores: s[qi][j] = q_qi . k_(p0+j); the key half is [D][BS], so the inner loop runs
        // over contiguous positions (vectorised). Explicit 4x16 register tiles with AVX2 only
        // measured 1.4x slower than these loops on the 2-core EPYC (gcc 12, -O3 -mavx2 -mfma).
        std::fill(s.begin(), s.begin() + nq * bs, 0.0f);
        for (int64_t e = 0; e < d; ++e) {
          const float* kr = kf + e * bs;
          for (int64_t qi = 0; qi < nq; ++qi) {
            const float qe = qf[qi * d + e];
            float* sq = s.data() + qi * bs;
            for (int64_t j = 0; j < cnt; ++j) sq[j] += qe * kr[j];
          }
        }
      }
      // Mask, max, exp, sum. Positions before `root` are seen by every row; a tree position
      // p needs anc[i][p - root], else its score becomes kMasked, whose exp is exactly 0 (no
      // -inf: the build uses -ffast-math). Branch-free loops, so exp is vectorised.
      const int64_t shared = std::clamp<int64_t>(root - p0, 0, cnt);
      for (int64_t qi = 0; qi < nq; ++qi) {
        const uint8_t* allowed = mask + (r * nmax + qi / group) * nmax;
        float* sq = s.data() + qi * bs;
        for (int64_t j = shared; j < cnt; ++j)
          if (!allowed[p0 + j - root]) sq[j] = kMasked;
        float mx = kMasked;
        for (int64_t j = 0; j < cnt; ++j) mx = std::max(mx, sq[j]);
        float l = 0.0f;
        if (mx > 0.5f * kMasked) {
          for (int64_t j = 0; j < cnt; ++j) {
            sq[j] = std::exp(sq[j] - mx);
            l += sq[j];
          }
        } else {
          std::fill(sq, sq + cnt, 0.0f);  // this row sees nothing here: l = 0, skipped in pass 2
        }
        pw[qi * part + d] = mx;
        pw[qi * part + d + 1] = l;
      }
      if (tiled) {
        // acc[qi] = sum_j w[qi][j] * v_j, QT queries x ET head dims in registers per tile.
        const float* vf = kf + bs * d;
        for (int64_t qi0 = 0; qi0 < nq; qi0 += kQT)
          for (int64_t e0 = 0; e0 < d; e0 += kET)
            pv_tile(s.data() + qi0 * bs, bs, vf + e0, d, cnt, pw + qi0 * part + e0, part, std::min<int64_t>(kQT, nq - qi0));
        continue;
      }
      // acc[qi] += w[qi][j] * v_j; rows of the value half are contiguous [D].
      const float* vb = kf + bs * d;
      for (int64_t qi = 0; qi < nq; ++qi) std::fill(pw + qi * part, pw + qi * part + d, 0.0f);
      for (int64_t j = 0; j < cnt; ++j) {
        const float* vr = vb + j * d;
        for (int64_t qi = 0; qi < nq; ++qi) {
          const float wgt = s[qi * bs + j];
          if (wgt == 0.0f) continue;
          float* acc = pw + qi * part;
          for (int64_t e = 0; e < d; ++e) acc[e] += wgt * vr[e];
        }
      }
    }
  });

  // Pass 2: (request, row, query head) -> merge partials over chunks, write the output row.
  at::parallel_for(0, num_req * nmax * num_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(d);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t r = w / (nmax * num_heads), i = (w / num_heads) % nmax, hq = w % num_heads;
      const int64_t start = m[r * 4], n1 = m[r * 4 + 1];
      if (i >= n1) continue;
      const int64_t h = hq / group, qi = i * group + hq % group;
      const float* pr = partials.data() + (r * hkv + h) * num_chunks * qmax * part + qi * part;
      float mx = -FLT_MAX;
      for (int64_t c = 0; c < num_chunks; ++c)
        if (pr[c * qmax * part + d + 1] > 0.0f) mx = std::max(mx, pr[c * qmax * part + d]);
      std::fill(acc.begin(), acc.end(), 0.0f);
      float l = 0.0f;
      for (int64_t c = 0; c < num_chunks; ++c) {
        const float* pc = pr + c * qmax * part;
        if (pc[d + 1] <= 0.0f) continue;
        const float f = std::exp(pc[d] - mx);
        l += f * pc[d + 1];
        for (int64_t e = 0; e < d; ++e) acc[e] += f * pc[e];
      }
      const float inv = 1.0f / l;  // l > 0: every row sees at least the root
      T* op = out + (start + i) * o_s0 + hq * o_s1;
      for (int64_t e = 0; e < d; ++e) op[e] = static_cast<T>(acc[e] * inv);
    }
  });
}

}  // namespace

// query [T, Hq, D] and output [T, Hq, D] (last dim contiguous), kv_cache [NB, Hkv, BS, 2*D]
// contiguous, meta int64 [R, 4], block_table int32 [num_reqs, max_blocks] (rows contiguous),
// anc uint8 [R, NMAX, NMAX], layout kLayoutVec or kLayoutAmx. Checked by the Python wrapper (kernels/tree_attention_cpu.py).
void tree_attention_cpu(const torch::Tensor& query, const torch::Tensor& kv_cache, torch::Tensor output,
                        const torch::Tensor& meta, const torch::Tensor& block_table, const torch::Tensor& anc,
                        double scale, int64_t layout) {
  TORCH_CHECK(layout == kLayoutVec || (layout == kLayoutAmx && kv_cache.scalar_type() == at::kBFloat16 &&
              kv_cache.size(2) % 16 == 0 && query.size(2) % 16 == 0), "tree_attention_cpu: unsupported KV layout");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "tree_attention_cpu", [&] {
    tree_attention_impl<scalar_t>(query, kv_cache, output, meta, block_table, anc, scale, layout);
  });
}

// KV compaction of accepted tree paths, every layer in one call. kv_caches: each layer's
// cache [num_blocks, Hkv, BS, 2*D], contiguous, in `layout`; src, dst int64 [M] flat slots
// (block * BS + offset), no -1. Per cache, every source token is read before any destination
// is written (a destination may be another move's source). Same contract as
// kernels.kv_compact_ref on the caches' (key, value) token views; one Python call instead
// of two indexing ops per cache.
void kv_compact_cpu(const std::vector<torch::Tensor>& kv_caches, const torch::Tensor& src, const torch::Tensor& dst,
                    int64_t layout) {
  const int64_t moves = src.numel();
  if (moves == 0 || kv_caches.empty()) return;
  TORCH_CHECK(layout == kLayoutVec || layout == kLayoutAmx, "kv_compact_cpu: unsupported KV layout");
  const int64_t* s = src.data_ptr<int64_t>();
  const int64_t* t = dst.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, kv_caches[0].scalar_type(), "kv_compact_cpu", [&] {
    at::parallel_for(0, static_cast<int64_t>(kv_caches.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<scalar_t> rows;
      std::vector<int64_t> offsets;  // element offsets of one token inside a (block, head): K then V
      for (int64_t c = begin; c < end; ++c) {
        const torch::Tensor& cache = kv_caches[c];
        const int64_t hkv = cache.size(1), bs = cache.size(2), d = cache.size(3) / 2;
        const int64_t head_stride = bs * 2 * d, block_stride = hkv * head_stride;
        scalar_t* base = cache.data_ptr<scalar_t>();
        rows.resize(moves * hkv * 2 * d);
        offsets.resize(2 * d);
        for (int pass = 0; pass < 2; ++pass)  // 0: gather every source token, 1: scatter
          for (int64_t m = 0; m < moves; ++m) {
            const int64_t slot = pass == 0 ? s[m] : t[m], off = slot % bs;
            for (int64_t e = 0; e < d; ++e) {
              offsets[e] = layout == kLayoutAmx ? amx_key_index(off, e, d) : e * bs + off;
              offsets[d + e] = bs * d + (layout == kLayoutAmx ? amx_value_index(off, e, bs) : off * d + e);
            }
            scalar_t* blk = base + (slot / bs) * block_stride;
            scalar_t* buf = rows.data() + m * hkv * 2 * d;
            for (int64_t h = 0; h < hkv; ++h)
              for (int64_t e = 0; e < 2 * d; ++e) {
                scalar_t& x = blk[h * head_stride + offsets[e]];
                if (pass == 0) buf[h * 2 * d + e] = x; else x = buf[h * 2 * d + e];
              }
          }
      }
    });
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("tree_attention_cpu", &tree_attention_cpu, "tree-masked attention over vLLM's CPU KV cache");
  module.def("kv_compact_cpu", &kv_compact_cpu, "move accepted tree rows of many KV caches to their slots");
}
