"""Plain vLLM's greedy float32 tokens for token-id prompts: the reference that a Clover
server's outputs (prompts sent as the same token ids) must equal token for token."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from tests.conftest import shutdown_llm


def plain_greedy_tokens(model: Path, prompts: Mapping[str, list[int]], max_tokens: Mapping[str, int],
                        max_model_len: int) -> dict[str, list[int]]:
    """{key: generated token ids} of an offline plain ``LLM`` (no speculation), all prompts
    in one batch, ``max_tokens[key]`` new tokens each."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(model), dtype="float32", enforce_eager=True, kv_cache_memory_bytes=1 << 30,
              max_model_len=max_model_len)
    try:
        keys = list(prompts)
        outs = llm.generate([TokensPrompt(prompt_token_ids=prompts[k]) for k in keys],
                            [SamplingParams(temperature=0, max_tokens=max_tokens[k]) for k in keys], use_tqdm=False)
    finally:
        shutdown_llm(llm)
    return {k: list(o.outputs[0].token_ids) for k, o in zip(keys, outs)}
