"""The model-registry entry: vLLM's public API, no attribute is replaced."""

from __future__ import annotations

from vllm_clover.patches.patching import Patch, params


def register_model() -> None:
    from vllm import ModelRegistry

    from vllm_clover.model.config import ARCHITECTURE

    # Lazy "module:Class" string: no torch-heavy import in processes that never build it.
    ModelRegistry.register_model(ARCHITECTURE, "vllm_clover.engine.vllm_model:CloverForSpeculativeDecoding")


def check_register_model() -> None:
    from vllm import ModelRegistry

    assert params(ModelRegistry.register_model)[:2] == ["model_arch", "model_cls"]


MODEL_ARCH = Patch(
    name="clover-model-architecture",
    target="vllm.ModelRegistry.register_model",
    why=("Registers CloverForSpeculativeDecoding (vllm_clover.engine.vllm_model, lazily), so the draft "
         "ModelConfig of the front end and get_model() in the worker resolve a Clover checkpoint's "
         "config.json architecture."),
    upstream="none needed (public registration API)",
    remove_when="never (public registration API)",
    apply=register_model,
    check=check_register_model,
)
