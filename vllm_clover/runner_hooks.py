"""The two wraps on vLLM's V1 ``GPUModelRunner`` (``CPUModelRunner`` inherits them).

Both act only when the engine runs a Clover checkpoint through the medusa slot
(``frontend.is_clover_vllm_config``); every other engine runs vLLM's code unchanged.

* ``__init__``: replace the ``MedusaProposer`` vLLM just built with a ``CloverProposer``
  and turn on aux hidden states, so the target also returns its pre-final-norm residual.
* ``propose_draft_token_ids``: vLLM's medusa branch hands the drafter one post-norm row
  per request; Clover needs the pre-norm rows of every scheduled token, the positions,
  the attention metadata and the committed tokens, so route to ``propose_clover`` and
  publish its draft probabilities through the runner's own contract
  (``_draft_probs`` / ``_draft_prob_req_ids``, read by ``_get_spec_decode_draft_probs``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from vllm_clover.frontend import is_clover_vllm_config

_MARK = "__vllm_clover_wrapped__"


def wrap_init(orig: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(orig)
    def __init__(self: Any, vllm_config: Any, device: Any, *args: Any, **kwargs: Any) -> None:
        orig(self, vllm_config, device, *args, **kwargs)
        if is_clover_vllm_config(vllm_config) and hasattr(self, "drafter"):
            from vllm_clover.proposer import CloverProposer

            self.drafter = CloverProposer(vllm_config, device)
            self.use_aux_hidden_state_outputs = True

    setattr(__init__, _MARK, True)
    return __init__


def wrap_propose(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def propose_draft_token_ids(self: Any, scheduler_output: Any, sampled_token_ids: Any,
                                sampling_metadata: Any, hidden_states: Any, sample_hidden_states: Any,
                                aux_hidden_states: Any, spec_decode_metadata: Any,
                                common_attn_metadata: Any, slot_mappings: Any) -> Any:
        if not getattr(getattr(self, "drafter", None), "is_clover", False):
            return orig(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                        sample_hidden_states, aux_hidden_states, spec_decode_metadata,
                        common_attn_metadata, slot_mappings)
        self._draft_probs = None
        self._draft_prob_req_ids = None
        drafts, probs = self.drafter.propose_clover(
            self, scheduler_output, sampled_token_ids, sampling_metadata, aux_hidden_states,
            common_attn_metadata, slot_mappings)
        if probs is not None:
            self._draft_probs = probs
            self._draft_prob_req_ids = self.input_batch.req_ids.copy()
        return drafts

    setattr(propose_draft_token_ids, _MARK, True)
    return propose_draft_token_ids


def install(cls: type, name: str, wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``cls.name`` by ``wrapper(original)`` unless already wrapped."""
    orig = getattr(cls, name)
    if not getattr(orig, _MARK, False):
        setattr(cls, name, wrapper(orig))


def install_init() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    install(GPUModelRunner, "__init__", wrap_init)


def install_propose() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    install(GPUModelRunner, "propose_draft_token_ids", wrap_propose)
