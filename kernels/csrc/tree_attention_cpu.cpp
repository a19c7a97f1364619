// Tree-masked attention for vLLM's CPU KV cache (CPU_ATTN, vec / vec16 ISAs), read in place.
//
// Why a kernel: the PyTorch path (vllm_clover/tree_verify.py) first gathers each request's
// whole paged K/V prefix into contiguous tensors, once per layer per step; at batch 1 that
// gather is most of what the tree rows cost per layer on a 2-core CPU. This reads the blocks
// where they are.
//
// Layout (docs/tree-verification.md, checked at start-up by check_cpu_kv_layout):
//   kv_cache [num_blocks, Hkv, BS, 2*D]; per (block, kv head) the key half is stored
//   transposed [D][BS], followed by the value half [BS][D].
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
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <vector>

namespace {

// Score of a masked (invisible) tree position: finite, exp(kMasked - max) == 0.
constexpr float kMasked = -1e30f;

template <typename T>
void tree_attention_impl(const torch::Tensor& query, const torch::Tensor& kv_cache, torch::Tensor& output,
                         const torch::Tensor& meta, const torch::Tensor& block_table,
                         const torch::Tensor& anc, double scale) {
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
  at::parallel_for(0, num_req * hkv * num_chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(qmax * d), s(qmax * bs);
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
      const T* base = kv + (static_cast<int64_t>(bt[req * bt_s0 + c]) * hkv + h) * head_stride;
      // Scores: s[qi][j] = q_qi . k_(p0+j); the key half is [D][BS], so the inner loop runs
      // over contiguous positions (vectorised). Explicit 4x16 register tiles measured 1.4x
      // slower than this on the 2-core EPYC (gcc 12, -O3 -mavx2 -mfma).
      std::fill(s.begin(), s.begin() + nq * bs, 0.0f);
      for (int64_t e = 0; e < d; ++e) {
        const T* kr = base + e * bs;
        for (int64_t qi = 0; qi < nq; ++qi) {
          const float qe = qf[qi * d + e];
          float* sq = s.data() + qi * bs;
          for (int64_t j = 0; j < cnt; ++j) sq[j] += qe * static_cast<float>(kr[j]);
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
      // acc[qi] += w[qi][j] * v_j; rows of the value half are contiguous [D].
      const T* vb = base + bs * d;
      for (int64_t qi = 0; qi < nq; ++qi) std::fill(pw + qi * part, pw + qi * part + d, 0.0f);
      for (int64_t j = 0; j < cnt; ++j) {
        const T* vr = vb + j * d;
        for (int64_t qi = 0; qi < nq; ++qi) {
          const float wgt = s[qi * bs + j];
          if (wgt == 0.0f) continue;
          float* acc = pw + qi * part;
          for (int64_t e = 0; e < d; ++e) acc[e] += wgt * static_cast<float>(vr[e]);
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
// anc uint8 [R, NMAX, NMAX]. Checked by the Python wrapper (kernels/tree_attention_cpu.py).
void tree_attention_cpu(const torch::Tensor& query, const torch::Tensor& kv_cache, torch::Tensor output,
                        const torch::Tensor& meta, const torch::Tensor& block_table, const torch::Tensor& anc,
                        double scale) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "tree_attention_cpu", [&] {
    tree_attention_impl<scalar_t>(query, kv_cache, output, meta, block_table, anc, scale);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("tree_attention_cpu", &tree_attention_cpu, "tree-masked attention over vLLM's CPU KV cache");
}
