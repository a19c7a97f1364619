"""Tree attention and KV compaction: Triton kernel vs the PyTorch reference, side by side.

    python -m vllm_clover.benchmarks.bench_kernels                 # CUDA: realistic shapes
    TRITON_INTERPRET=1 python -m vllm_clover.benchmarks.bench_kernels --tiny   # CPU: checks the script

Prints, per shape, the time of each backend (median of ``--iters`` timed calls after warm-up,
CUDA-synchronised), the ratio, and the largest difference between the two outputs. The
reference loops over requests in Python (it is the readable oracle, not a tuned baseline), so
a second baseline is timed too: one batched dense SDPA call over the gathered K/V with the
tree mask, what a PyTorch-only implementation would do.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from vllm_clover.kernels import kv_compact_ref, kv_compact_triton, tree_attention_ref, tree_attention_triton
from vllm_clover.drafting.tree import get_tree


def paged_inputs(b: int, prefix: int, tree: str, hq: int, hkv: int, d: int, block: int,
                 dtype: torch.dtype, device: str) -> tuple[torch.Tensor, ...]:
    """Random q [B,Q,Hq,D], K/V caches with shuffled blocks, block table, seq lens, mask [Q,Q]."""
    g = torch.Generator().manual_seed(0)
    mask = get_tree(tree).ancestor_mask
    n1 = mask.shape[-1]
    per_req = (prefix + n1 + block - 1) // block
    blocks = torch.randperm(b * per_req + 8, generator=g)
    table = blocks[: b * per_req].view(b, per_req).to(torch.int32)
    k = torch.randn(b * per_req + 8, block, hkv, d, generator=g).to(dtype)
    v = torch.randn(b * per_req + 8, block, hkv, d, generator=g).to(dtype)
    q = torch.randn(b, n1, hq, d, generator=g).to(dtype)
    sl = torch.full((b,), prefix, dtype=torch.int32)
    return tuple(x.to(device) for x in (q, k, v, table, sl, mask))


def dense_sdpa(q, k, v, table, sl, mask):
    """Batched PyTorch baseline: gather each request's K/V rows, one masked SDPA call."""
    b, n1, hq, d = q.shape
    hkv = k.shape[2]
    length = int(sl[0]) + n1  # equal prefixes in this benchmark
    rows = k[table.long()].reshape(b, -1, hkv, d)[:, :length]
    vrows = v[table.long()].reshape(b, -1, hkv, d)[:, :length]
    group = hq // hkv
    kk = rows.repeat_interleave(group, 2).transpose(1, 2)
    vv = vrows.repeat_interleave(group, 2).transpose(1, 2)
    allowed = torch.cat((torch.ones(n1, length - n1, dtype=torch.bool, device=q.device), mask.bool()), 1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, attn_mask=allowed)
    return out.transpose(1, 2)


def timed(fn, iters: int, device: str) -> float:
    """Median seconds of ``fn()`` over ``iters`` calls after 3 warm-ups."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="toy shapes (for the Triton interpreter on CPU)")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.tiny:
        shapes = [(2, 40, "small_10", 4, 2, 16, 16, torch.float32)]
        args.iters = min(args.iters, 2)
    else:  # Llama-7B-like heads (32 q / 8 kv, D=128) and SmolLM2-135M's (9 q / 3 kv, D=64)
        shapes = [(b, prefix, tree, hq, hkv, d, 16, dt)
                  for dt in (torch.bfloat16, torch.float32)
                  for (b, prefix, tree, hq, hkv, d) in ((1, 1024, "mc_sim_7b_63", 32, 8, 128),
                                                        (8, 1024, "mc_sim_7b_63", 32, 8, 128),
                                                        (32, 2048, "small_10", 32, 8, 128),
                                                        (32, 512, "small_4", 9, 3, 64))]
    print(f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, torch {torch.__version__}")
    print("tree attention: B prefix tree Hq/Hkv D dtype | triton ms | reference ms | dense SDPA ms | "
          "ref/triton | sdpa/triton | max |triton-ref|")
    for b, prefix, tree, hq, hkv, d, block, dt in shapes:
        q, k, v, table, sl, mask = paged_inputs(b, prefix, tree, hq, hkv, d, block, dt, device)
        out_t = tree_attention_triton(q, k, v, table, sl, mask)
        out_r = tree_attention_ref(q, k, v, table, sl, mask)
        err = float((out_t.float() - out_r.float()).abs().max())
        t_t = timed(lambda: tree_attention_triton(q, k, v, table, sl, mask), args.iters, device)
        t_r = timed(lambda: tree_attention_ref(q, k, v, table, sl, mask), args.iters, device)
        t_s = timed(lambda: dense_sdpa(q, k, v, table, sl, mask), args.iters, device)
        print(f"{b} {prefix} {tree} {hq}/{hkv} {d} {str(dt)[6:]} | {t_t * 1e3:.3f} | {t_r * 1e3:.3f} | "
              f"{t_s * 1e3:.3f} | {t_r / t_t:.1f}x | {t_s / t_t:.1f}x | {err:.2e}", flush=True)
    print("KV compaction: B path_len Hkv D | triton ms | reference ms | ref/triton | equal")
    for b, m, hkv, d in ([(2, 3, 2, 16)] if args.tiny else [(1, 5, 8, 128), (32, 5, 8, 128), (256, 5, 8, 128)]):
        block, nblocks = 16, b * 8 + 4
        g = torch.Generator().manual_seed(1)
        caches = [torch.randn(nblocks, block, hkv, d, generator=g).to(device) for _ in range(2)]
        base = torch.arange(b)[:, None] * 8 * block + 40
        src = (base + torch.randint(1, 26, (b, m), generator=g)).to(device)
        dst = (base + torch.arange(1, m + 1)).to(device)
        ref = [c.clone() for c in caches]
        kv_compact_ref(ref, src, dst)
        tri = [c.clone() for c in caches]
        kv_compact_triton(tri, src, dst)
        same = all(torch.equal(x, y) for x, y in zip(ref, tri))
        t_t = timed(lambda: kv_compact_triton(tri, src, dst), args.iters, device)
        t_r = timed(lambda: kv_compact_ref(ref, src, dst), args.iters, device)
        print(f"{b} {m} {hkv} {d} | {t_t * 1e3:.3f} | {t_r * 1e3:.3f} | {t_r / t_t:.1f}x | {same}", flush=True)


if __name__ == "__main__":
    main()
