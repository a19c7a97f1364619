// Tree-masked attention for vLLM's CPU KV cache (CPU_ATTN: the vec, vec16 and amx layouts), read in place.
//
// Why a kernel: the PyTorch path (vllm_clover/engine/tree_verify.py) first gathers each request's
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
//   Pass 1 multiplies an amx block in place with AMX tiles (bf16 products, float sums and
//   softmax; amx_qk, amx_pv) when built for them and allowed, else reads it through a float
//   copy in the vec order (amx_to_float).
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
// pv_tile) when BS % 32 == 0 and D % 64 == 0; the plain loops are load/store-bound (a score or
// output element per multiply-add), the tiles ~3x faster for the default model's heads
// (docs/results/*-fp32-tree-kernels-xeon.md). Built with -mavx2 -mfma, the same tiles
// in halves (4 queries x 16 positions / 16 head dims, 8 ymm accumulators), ~1.8x faster than the
// loops and bitwise the same output (docs/results/*-avx2-lighter-drafter.md; timed by
// vllm_clover/benchmarks/bench_tree_cpu.py). Elsewhere, the plain loops.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <type_traits>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <vector>

namespace {

// Score of a masked (invisible) tree position: finite, exp(kMasked - max) == 0.
constexpr float kMasked = -1e30f;
// Softmax weights below exp(kExpFloor) = 1.8e-35 of the row's largest count as 0.
constexpr float kExpFloor = -80.0f;

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

// Register tiles (AVX-512, or AVX2 + FMA): QT queries x JT positions of scores (QK: 8 zmm
// accumulators), QT queries x ET head dims of output (PV: 16). The general loops load and
// store a score (or output) element per multiply-add.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
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
#elif defined(__AVX2__) && defined(__FMA__)
// The same tiles with AVX2's 16 ymm registers: each in halves of 16 positions (QK) or
// quarters of 16 head dims (PV), 4 queries x 2 ymm accumulators (+ 2 loaded, 1 broadcast).
inline void qk_tile(const float* __restrict q, int64_t d, const float* __restrict k, int64_t bs,
                    float* __restrict s) {
  for (int64_t h = 0; h < kJT; h += 16) {
    __m256 acc[kQT][2];
    for (int a = 0; a < kQT; ++a) acc[a][0] = acc[a][1] = _mm256_setzero_ps();
    for (int64_t e = 0; e < d; ++e) {
      const __m256 k0 = _mm256_loadu_ps(k + e * bs + h), k1 = _mm256_loadu_ps(k + e * bs + h + 8);
      for (int a = 0; a < kQT; ++a) {
        const __m256 qa = _mm256_broadcast_ss(q + a * d + e);
        acc[a][0] = _mm256_fmadd_ps(qa, k0, acc[a][0]);
        acc[a][1] = _mm256_fmadd_ps(qa, k1, acc[a][1]);
      }
    }
    for (int a = 0; a < kQT; ++a) {
      _mm256_storeu_ps(s + a * bs + h, acc[a][0]);
      _mm256_storeu_ps(s + a * bs + h + 8, acc[a][1]);
    }
  }
}

inline void pv_tile(const float* __restrict w, int64_t bs, const float* __restrict v, int64_t d, int64_t cnt,
                    float* __restrict o, int64_t ostride, int64_t qt) {
  for (int64_t e0 = 0; e0 < kET; e0 += 16) {
    __m256 acc[kQT][2];
    for (int a = 0; a < kQT; ++a) acc[a][0] = acc[a][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < cnt; ++j) {
      const __m256 v0 = _mm256_loadu_ps(v + j * d + e0), v1 = _mm256_loadu_ps(v + j * d + e0 + 8);
      for (int a = 0; a < kQT; ++a) {
        const __m256 wa = _mm256_broadcast_ss(w + a * bs + j);
        acc[a][0] = _mm256_fmadd_ps(wa, v0, acc[a][0]);
        acc[a][1] = _mm256_fmadd_ps(wa, v1, acc[a][1]);
      }
    }
    for (int64_t a = 0; a < qt; ++a) {
      _mm256_storeu_ps(o + a * ostride + e0, acc[a][0]);
      _mm256_storeu_ps(o + a * ostride + e0 + 8, acc[a][1]);
    }
  }
}
#else
inline void qk_tile(const float*, int64_t, const float*, int64_t, float*) {}
inline void pv_tile(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t, int64_t) {}
#endif

// AMX tiles (built with -mamx-tile -mamx-bf16 on CPUs that have them; used for the amx
// layout, which vLLM packs for exactly these tile loads). Every tile is 16 rows x 64 bytes:
// A = 16 queries x 32 bf16 (QK: head dims; PV: probabilities of 32 positions), B = 16 rows
// of (even, odd) bf16 pairs (QK: a key group's dim pairs x 16 tokens; PV: token pairs x 16
// value dims), C = 16 x 16 float. tmm0 holds A, tmm2/3 B, tmm4..7 C.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__)
constexpr bool kAmxTiles = true;
struct TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
// Tile state is per thread: configured at the start of each parallel chunk and released at
// its end (vLLM's own AMX attention loads its configuration in every call, as does oneDNN).
inline void amx_begin() {
  alignas(64) TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
}
inline void amx_end() { _tile_release(); }

// s[qt*16 + m][16g + n] = q_m . k_(16g+n) for every 16-query tile qt < nq and 16-token group
// g < groups. qb: bf16 queries [16 * tiles][d] (rows past nq are read, their scores unused);
// key: the block's amx key half. d % 32 == 0. Four groups at a time, one C tile each: a
// single accumulator chain waits out each product's latency (2x slower).
inline void amx_qk(const c10::BFloat16* qb, int64_t nq, int64_t d, const c10::BFloat16* key, int64_t groups,
                   float* s, int64_t bs) {
  for (int64_t qt = 0; qt < nq; qt += 16)
    for (int64_t g0 = 0; g0 < groups; g0 += 4) {
      const int64_t ng = std::min<int64_t>(4, groups - g0);
      _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
      for (int64_t ks = 0; ks < d / 32; ++ks) {
        _tile_loadd(0, qb + qt * d + ks * 32, d * 2);
        const c10::BFloat16* kb = key + g0 * 16 * d + ks * 16 * 32;
        _tile_loadd(2, kb, 64); _tile_dpbf16ps(4, 0, 2);
        if (ng > 1) { _tile_loadd(3, kb + 16 * d, 64); _tile_dpbf16ps(5, 0, 3); }
        if (ng > 2) { _tile_loadd(2, kb + 32 * d, 64); _tile_dpbf16ps(6, 0, 2); }
        if (ng > 3) { _tile_loadd(3, kb + 48 * d, 64); _tile_dpbf16ps(7, 0, 3); }
      }
      float* sp = s + qt * bs + g0 * 16;
      _tile_stored(4, sp, bs * 4);
      if (ng > 1) _tile_stored(5, sp + 16, bs * 4);
      if (ng > 2) _tile_stored(6, sp + 32, bs * 4);
      if (ng > 3) _tile_stored(7, sp + 48, bs * 4);
    }
}

// e^x for x in [kExpFloor, 0], 16 lanes: 2^(x log2 e) = 2^n * 2^f, n = round(x log2 e),
// |f| <= 1/2, 2^f by its degree-6 Taylor polynomial (relative error ~1e-7, below the
// bf16 rounding of the probabilities that follows). Inline, no scalar tail (libmvec's
// expf costs ~20 cycles a call plus a scalar loop for the last cnt % 16 positions).
inline __m512 exp_avx512(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147181f));  // (t - n) ln 2
  __m512 p = _mm512_set1_ps(1.0f / 720);
  for (float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// softmax_rows for the AMX path, 16 positions per step: scores (times `scale`: the queries
// stay unscaled bf16; masked as in softmax_rows) -> each query's (max, sum) into pw and its unnormalised probabilities
// in bf16 into pb (rows of stride bs), zero from cnt to round-up-32(cnt) for amx_pv.
inline void amx_softmax(const float* s, int64_t bs, int64_t nq, int64_t cnt, float scale, const uint8_t* anc,
                        int64_t nmax, int64_t group, int64_t shared, int64_t node_offset, float* pw, int64_t part,
                        int64_t d, c10::BFloat16* pb) {
  const int64_t cnt32 = (cnt + 31) / 32 * 32;
  const __m512 masked = _mm512_set1_ps(kMasked), floor = _mm512_set1_ps(kExpFloor);
  auto lanes = [](int64_t lo, int64_t hi) -> __mmask16 {  // lanes j with lo <= j < hi of a 16-chunk
    lo = std::clamp<int64_t>(lo, 0, 16), hi = std::clamp<int64_t>(hi, 0, 16);
    return hi <= lo ? 0 : static_cast<__mmask16>(((1u << hi) - 1) & ~((1u << lo) - 1));
  };
  for (int64_t qi = 0; qi < nq; ++qi) {
    const uint8_t* allowed = anc + (qi / group) * nmax;
    const float* sq = s + qi * bs;
    __m512 vmax = masked;
    for (int64_t j = 0; j < cnt; j += 16) {  // pass 1: the row's max over what it sees
      const __mmask16 live = lanes(0, cnt - j), tree = lanes(shared - j, cnt - j);
      const __mmask16 seen = (live & ~tree) |
          _mm_mask_test_epi8_mask(tree, _mm_maskz_loadu_epi8(tree, allowed + j + node_offset), _mm_set1_epi8(-1));
      const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(live, sq + j), _mm512_set1_ps(scale));
      vmax = _mm512_mask_max_ps(vmax, seen, vmax, x);
    }
    const float mx = _mm512_reduce_max_ps(vmax);
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t j = 0; j < cnt32; j += 16) {  // pass 2: exp, sum, bf16
      const __mmask16 live = lanes(0, cnt - j), tree = lanes(shared - j, cnt - j);
      const __mmask16 seen = (live & ~tree) |
          _mm_mask_test_epi8_mask(tree, _mm_maskz_loadu_epi8(tree, allowed + j + node_offset), _mm_set1_epi8(-1));
      const __m512 x = _mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(live, sq + j), _mm512_set1_ps(scale)),
                                     _mm512_set1_ps(mx));
      const __mmask16 keep = seen & _mm512_cmp_ps_mask(x, floor, _CMP_GT_OQ);
      const __m512 e = _mm512_maskz_mov_ps(keep, exp_avx512(_mm512_max_ps(x, floor)));
      vsum = _mm512_add_ps(vsum, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + qi * bs + j),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
    }
    const float l = mx > 0.5f * kMasked ? _mm512_reduce_add_ps(vsum) : 0.0f;
    pw[qi * part + d] = mx;
    pw[qi * part + d + 1] = l;
  }
}

// acc[qi][e] = sum_j p[qi][j] v_j[e] (j < cnt) into the partials pw (row stride `part`).
// pb: bf16 probabilities [16 * tiles][bs], zero at positions cnt..round-up-32(cnt); value:
// the block's amx value half. The last 32-position chunk is read through a copy whose
// positions >= cnt are zeroed: unwritten cache slots may hold anything (NaN * 0 = NaN).
// d % 64 == 0 (4 C tiles of 16 dims per pass).
inline void amx_pv(const c10::BFloat16* pb, int64_t nq, const c10::BFloat16* value, int64_t cnt, int64_t bs,
                   int64_t d, float* pw, int64_t part) {
  alignas(64) float c[16 * 64];
  alignas(64) c10::BFloat16 tail[4][16 * 32];
  const int64_t chunks = (cnt + 31) / 32;
  for (int64_t qt = 0; qt < nq; qt += 16)
    for (int64_t e0 = 0; e0 < d; e0 += 64) {
      _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
      for (int64_t tc = 0; tc < chunks; ++tc) {
        const c10::BFloat16* v[4];
        for (int q = 0; q < 4; ++q) v[q] = value + (e0 / 16 + q) * 16 * bs + tc * 16 * 32;
        const int64_t live = cnt - tc * 32;  // positions of this chunk before cnt
        if (live < 32) {
          // Row k holds positions 2k (even lanes) and 2k + 1 (odd lanes): rows from
          // ceil(live / 2) on are zeroed; an odd `live` leaves one row with its odd lanes dead.
          for (int q = 0; q < 4; ++q) {
            std::memcpy(tail[q], v[q], (live + 1) / 2 * 64);
            std::memset(tail[q] + (live + 1) / 2 * 32, 0, (16 - (live + 1) / 2) * 64);
            if (live % 2)
              for (int n = 0; n < 16; ++n) tail[q][(live / 2) * 32 + n * 2 + 1] = c10::BFloat16(0.0f);
            v[q] = tail[q];
          }
        }
        _tile_loadd(0, pb + qt * bs + tc * 32, bs * 2);
        _tile_loadd(2, v[0], 64); _tile_dpbf16ps(4, 0, 2);
        _tile_loadd(3, v[1], 64); _tile_dpbf16ps(5, 0, 3);
        _tile_loadd(2, v[2], 64); _tile_dpbf16ps(6, 0, 2);
        _tile_loadd(3, v[3], 64); _tile_dpbf16ps(7, 0, 3);
      }
      _tile_stored(4, c, 64 * 4); _tile_stored(5, c + 16, 64 * 4);
      _tile_stored(6, c + 32, 64 * 4); _tile_stored(7, c + 48, 64 * 4);
      for (int64_t m = 0; m < std::min<int64_t>(16, nq - qt); ++m)
        std::memcpy(pw + (qt + m) * part + e0, c + m * 64, 64 * sizeof(float));
    }
}
#else
constexpr bool kAmxTiles = false;
inline void amx_begin() {}
inline void amx_end() {}
inline void amx_qk(const c10::BFloat16*, int64_t, int64_t, const c10::BFloat16*, int64_t, float*, int64_t) {}
inline void amx_softmax(const float*, int64_t, int64_t, int64_t, float, const uint8_t*, int64_t, int64_t, int64_t, int64_t,
                        float*, int64_t, int64_t, c10::BFloat16*) {}
inline void amx_pv(const c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t, int64_t, int64_t, float*, int64_t) {}
#endif

// Scores -> unnormalised probabilities of one item, in place, and each query's (max, sum)
// into its partial (pw[qi * part + d], [d + 1]). Positions before `shared` are seen by every
// row; position j >= shared is tree node j + node_offset and needs anc[i][node], else its
// score becomes kMasked, whose exp is exactly 0 (no -inf: the build uses -ffast-math).
// Branch-free loops, so exp is vectorised.
inline void softmax_rows(float* s, int64_t bs, int64_t nq, int64_t cnt, const uint8_t* anc, int64_t nmax,
                         int64_t group, int64_t shared, int64_t node_offset, float* pw, int64_t part, int64_t d) {
  for (int64_t qi = 0; qi < nq; ++qi) {
    const uint8_t* allowed = anc + (qi / group) * nmax;
    float* sq = s + qi * bs;
    for (int64_t j = shared; j < cnt; ++j)
      if (!allowed[j + node_offset]) sq[j] = kMasked;
    float mx = kMasked;
    for (int64_t j = 0; j < cnt; ++j) mx = std::max(mx, sq[j]);
    float l = 0.0f;
    if (mx > 0.5f * kMasked) {
      // exp's argument is clamped to kExpFloor: vectorised expf takes a slow scalar path
      // for lanes far below (a masked score's -1e30 - max); those lanes become 0.
      for (int64_t j = 0; j < cnt; ++j) {
        const float x = sq[j] - mx;
        sq[j] = x > kExpFloor ? std::exp(std::max(x, kExpFloor)) : 0.0f;
        l += sq[j];
      }
    } else {
      std::fill(sq, sq + cnt, 0.0f);  // this row sees nothing here: l = 0, skipped in pass 2
    }
    pw[qi * part + d] = mx;
    pw[qi * part + d + 1] = l;
  }
}

template <typename T>
void tree_attention_impl(const torch::Tensor& query, const torch::Tensor& kv_cache, torch::Tensor& output,
                         const torch::Tensor& meta, const torch::Tensor& block_table,
                         const torch::Tensor& anc, double scale, int64_t layout, bool amx_tiles) {
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
  // AMX tiles read the amx layout's blocks in place (QK and PV in bf16, float accumulation):
  // asked for by the caller (the CPU has AMX and the process may use it), bf16 only.
  const bool amx = kAmxTiles && amx_tiles && std::is_same<T, c10::BFloat16>::value && layout == kLayoutAmx &&
                   bs % 32 == 0 && d % 64 == 0;
  const int64_t qtile = amx ? 16 : kQT;
  const int64_t qpad = (qmax + qtile - 1) / qtile * qtile;  // query rows padded to whole tiles
  at::parallel_for(0, num_req * hkv * num_chunks, 1, [&](int64_t begin, int64_t end) {
    // A float copy of each (block, head) in the vec order, unless the cache is one already
    // or AMX reads it as it is.
    const bool direct = (std::is_same<T, float>::value && layout == kLayoutVec) || amx;
    std::vector<float> qf(amx ? 0 : qpad * d, 0.0f), s(qpad * bs), kvf(direct ? 0 : 2 * bs * d);
    std::vector<c10::BFloat16> qb(amx ? qpad * d : 0), pb(amx ? qpad * bs : 0);
    if (amx) amx_begin();
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
      const T* base = kv + (static_cast<int64_t>(bt[req * bt_s0 + c]) * hkv + h) * head_stride;
      if constexpr (std::is_same<T, c10::BFloat16>::value) {
        if (amx) {
          for (int64_t i = 0; i < n1; ++i)
            for (int64_t g = 0; g < group; ++g)
              std::memcpy(qb.data() + (i * group + g) * d, q + (start + i) * q_s0 + (h * group + g) * q_s1,
                          d * sizeof(T));
          amx_qk(qb.data(), nq, d, base, (cnt + 15) / 16, s.data(), bs);
          amx_softmax(s.data(), bs, nq, cnt, static_cast<float>(scale), mask + r * nmax * nmax, nmax, group,
                      std::clamp<int64_t>(root - p0, 0, cnt), p0 - root, pw, part, d, pb.data());
          amx_pv(pb.data(), nq, base + bs * d, cnt, bs, d, pw, part);
          continue;
        }
      }
      for (int64_t i = 0; i < n1; ++i)
        for (int64_t g = 0; g < group; ++g) {
          const T* qp = q + (start + i) * q_s0 + (h * group + g) * q_s1;
          float* dst = qf.data() + (i * group + g) * d;
          for (int64_t e = 0; e < d; ++e) dst[e] = static_cast<float>(qp[e]) * static_cast<float>(scale);
        }
      std::fill(qf.begin() + nq * d, qf.end(), 0.0f);  // padding rows (an earlier item's queries)
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
        // over contiguous positions (vectorised).
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
      softmax_rows(s.data(), bs, nq, cnt, mask + r * nmax * nmax, nmax, group, std::clamp<int64_t>(root - p0, 0, cnt),
                   p0 - root, pw, part, d);
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
    if (amx) amx_end();
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
// anc uint8 [R, NMAX, NMAX], layout kLayoutVec or kLayoutAmx; amx_tiles: the caller allows
// AMX instructions (the CPU has them and the process was granted tile state). Checked by the
// Python wrapper (vllm_clover/kernels/tree_attention_cpu.py).
void tree_attention_cpu(const torch::Tensor& query, const torch::Tensor& kv_cache, torch::Tensor output,
                        const torch::Tensor& meta, const torch::Tensor& block_table, const torch::Tensor& anc,
                        double scale, int64_t layout, bool amx_tiles) {
  TORCH_CHECK(layout == kLayoutVec || (layout == kLayoutAmx && kv_cache.scalar_type() == at::kBFloat16 &&
              kv_cache.size(2) % 16 == 0 && query.size(2) % 16 == 0), "tree_attention_cpu: unsupported KV layout");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "tree_attention_cpu", [&] {
    tree_attention_impl<scalar_t>(query, kv_cache, output, meta, block_table, anc, scale, layout, amx_tiles);
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

// The bits of x as a float (bfloat16 is a float's top half). Comparisons run on these
// floats; NaN is found from the bits, because -ffast-math lets the compiler assume no NaN.
template <typename T>
inline float as_float(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    uint32_t bits = static_cast<uint32_t>(x.x) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  } else {
    return static_cast<float>(x);
  }
}

inline bool is_nan_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return (bits & 0x7fffffffu) > 0x7f800000u;
}

// First index of the row's maximum, a NaN counting as larger than any number (torch.max's
// rule). One vectorised pass, 16 lanes: each lane keeps its maximum and where it first
// occurred, and whether it saw a NaN; the answer is the smallest index among the lanes
// holding the overall maximum (each lane's first occurrence is its earliest).
template <typename T>
int64_t row_argmax(const T* x, int64_t n) {
  constexpr int64_t kLanes = 16;
  float lane_max[kLanes];
  int32_t lane_idx[kLanes];
  uint32_t lane_nan[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) {
    lane_max[l] = -INFINITY;
    lane_idx[l] = static_cast<int32_t>(l);
    lane_nan[l] = 0;
  }
  const int64_t full = n / kLanes * kLanes;
  for (int64_t i = 0; i < full; i += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) {
      const float f = as_float(x[i + l]);
      lane_nan[l] |= is_nan_bits(f);
      const bool greater = f > lane_max[l];
      lane_max[l] = greater ? f : lane_max[l];
      lane_idx[l] = greater ? static_cast<int32_t>(i + l) : lane_idx[l];
    }
  // (-inf, index 0) is the answer when every element is -inf; the tail comes after every
  // lane's index, so it wins only when larger.
  float best = -INFINITY;
  int64_t best_idx = 0;
  bool nan = false;
  for (int64_t l = 0; l < kLanes && l < n; ++l) {
    nan |= lane_nan[l] != 0;
    if (lane_max[l] > best || (lane_max[l] == best && lane_idx[l] < best_idx)) {
      best = lane_max[l];
      best_idx = lane_idx[l];
    }
  }
  for (int64_t i = full; i < n; ++i) {
    const float f = as_float(x[i]);
    nan |= is_nan_bits(f);
    if (f > best) {
      best = f;
      best_idx = i;
    }
  }
  if (nan)
    for (int64_t i = 0; i < n; ++i)
      if (is_nan_bits(as_float(x[i]))) return i;
  return best_idx;
}

#ifdef __AVX512F__
// row_argmax for float and bfloat16 rows with AVX-512 (the compiler does not vectorise the
// generic loop's index tracking): per lane the maximum, the index where it first occurred,
// a NaN seen (from the bits: -ffast-math may fold float NaN tests away).
template <typename T>
int64_t row_argmax_avx512(const T* x, int64_t n) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>);
  const int64_t full = n / 16 * 16;
  if (full == 0) return row_argmax(x, n);
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  __m512i vidx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i cur = vidx;
  const __m512i step = _mm512_set1_epi32(16), abs_mask = _mm512_set1_epi32(0x7fffffff),
                inf_bits = _mm512_set1_epi32(0x7f800000);
  __mmask16 nan = 0;
  for (int64_t i = 0; i < full; i += 16) {
    __m512i bits;
    if constexpr (std::is_same_v<T, float>)
      bits = _mm512_loadu_si512(reinterpret_cast<const void*>(x + i));
    else
      bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i))), 16);
    const __m512 v = _mm512_castsi512_ps(bits);
    nan |= _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, abs_mask), inf_bits);
    const __mmask16 greater = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
    vmax = _mm512_mask_blend_ps(greater, vmax, v);
    vidx = _mm512_mask_blend_epi32(greater, vidx, cur);
    cur = _mm512_add_epi32(cur, step);
  }
  if (nan)
    for (int64_t i = 0; i < n; ++i)
      if (is_nan_bits(as_float(x[i]))) return i;
  alignas(64) float lane_max[16];
  alignas(64) int32_t lane_idx[16];
  _mm512_store_ps(lane_max, vmax);
  _mm512_store_si512(reinterpret_cast<void*>(lane_idx), vidx);
  float best = lane_max[0];
  int64_t best_idx = lane_idx[0];
  for (int l = 1; l < 16; ++l)
    if (lane_max[l] > best || (lane_max[l] == best && lane_idx[l] < best_idx)) {
      best = lane_max[l];
      best_idx = lane_idx[l];
    }
  for (int64_t i = full; i < n; ++i) {
    const float f = as_float(x[i]);
    if (is_nan_bits(f)) return i;
    if (f > best) {
      best = f;
      best_idx = i;
    }
  }
  return best_idx;
}
#endif

// Per row of logits [R, V] (rows contiguous): the first index of its maximum, int64 [R];
// torch.max(-1).indices's result (ties: first index; NaN: the first NaN) at a fraction of its
// time on the CPU (one pass per row over float or bf16, rows across threads).
torch::Tensor rows_argmax_cpu(const torch::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.stride(1) == 1,
              "rows_argmax_cpu: logits must be [R, V] with V > 0 and contiguous rows");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  torch::Tensor out = torch::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "rows_argmax_cpu", [&] {
    const scalar_t* base = logits.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
#ifdef __AVX512F__
        if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, at::BFloat16>) {
          o[r] = row_argmax_avx512(base + r * stride, n);
          continue;
        }
#endif
        o[r] = row_argmax(base + r * stride, n);
      }
    });
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("tree_attention_cpu", &tree_attention_cpu, "tree-masked attention over vLLM's CPU KV cache");
  module.def("kv_compact_cpu", &kv_compact_cpu, "move accepted tree rows of many KV caches to their slots");
  module.def("rows_argmax_cpu", &rows_argmax_cpu, "first index of each row's maximum (torch.max(-1).indices)");
  module.def("has_amx_tiles", [] { return kAmxTiles; }, "built with the AMX tile path (-mamx-tile -mamx-bf16)");
}
