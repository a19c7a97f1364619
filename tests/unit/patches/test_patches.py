"""Every vLLM touch point in the patch catalogue still has the shape the patch relies on.

Each catalogue entry's ``check`` inspects the installed vLLM (signatures, attributes,
source markers) without applying anything, so a vLLM upgrade fails here, loudly.
"""

from __future__ import annotations

import pytest

from vllm_clover import patches
@pytest.mark.parametrize("patch", [p for p in patches.CATALOGUE], ids=lambda p: p.name)
def test_patch_target_still_matches_installed_vllm(patch: patches.Patch) -> None:
    if patch.check is None:
        pytest.skip(f"{patch.name} touches no vLLM object ({patch.target})")
    patch.check()


def test_every_vllm_patch_has_a_check_and_a_reason() -> None:
    for patch in patches.CATALOGUE:
        assert patch.why and patch.remove_when, patch.name
        if patch.target.startswith("vllm."):
            assert patch.check is not None, f"{patch.name} patches vLLM but has no check"


def test_patches_are_installed_once() -> None:
    from vllm.config.speculative import SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    patches.apply_all()
    patches._install_serve_errors()  # only wraps once the CLI module is imported (above)

    def targets():
        return (EngineArgs.create_speculative_config, EngineArgs.__dict__["add_cli_args"],
                GPUModelRunner.__init__, GPUModelRunner.propose_draft_token_ids,
                SpeculativeConfig.use_eagle_block_drop, ServeSubcommand.__dict__["cmd"],
                GPUModelRunner._input_fits_in_drafter, GPUModelRunner.sample_tokens)

    before = targets()
    for patch in patches.CATALOGUE:  # applying again (e.g. a second plugin load) is a no-op
        patch.apply()
    assert before == targets()
    assert all(getattr(f, "__vllm_clover_wrapped__", False) for f in (
        EngineArgs.create_speculative_config, EngineArgs.add_cli_args,
        GPUModelRunner.__init__, GPUModelRunner.propose_draft_token_ids,
        SpeculativeConfig.use_eagle_block_drop, ServeSubcommand.cmd,
        GPUModelRunner._input_fits_in_drafter, GPUModelRunner.sample_tokens))


def test_clover_architecture_is_registered() -> None:
    from vllm import ModelRegistry

    patches.apply_all()
    assert "CloverForSpeculativeDecoding" in ModelRegistry.get_supported_archs()


def test_drafter_custom_ops_run_their_platform_kernel_when_the_target_is_compiled() -> None:
    """Under a compiled target's config vLLM disables custom ops (their forward is a
    torch.compile-wrapped forward_native); run_custom_ops_natively points the drafter's at
    the kernel an enabled op dispatches to (forward_cpu here), with the same results."""
    import torch
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm

    from vllm_clover.engine.vllm_model import run_custom_ops_natively

    config = VllmConfig(compilation_config=CompilationConfig(mode=3, custom_ops=["none"]))
    with set_current_vllm_config(config):
        block = torch.nn.Sequential(RMSNorm(64), SiluAndMul())
        assert block[0]._forward_method != block[0].forward_cpu  # disabled: forward_native
        assert run_custom_ops_natively(block) == 2
        assert block[1]._forward_method == block[1].forward_cpu
        x = torch.randn(3, 64)
        torch.testing.assert_close(block[0](x), block[0].forward_native(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(block[1](x), SiluAndMul.forward_native(x), rtol=1e-5, atol=1e-5)
        # RMSNorm on CPU: vLLM's C kernels (no forward_cpu of its own), residual form too,
        # leaving the caller's tensors as they were.
        assert block[0]._forward_method != block[0].forward_cpu
        block[0].weight.data.normal_()
        residual = torch.randn(3, 64)
        before = (x.clone(), residual.clone())
        for got, want in zip(block[0](x, residual), block[0].forward_native(x, residual)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(x, before[0]) and torch.equal(residual, before[1])
