"""The patch catalogue and the one patch utility.

Each catalogue entry's ``check`` inspects the installed vLLM (signatures, attributes,
source markers) without applying anything, so a vLLM upgrade fails here, loudly.
"""

from __future__ import annotations

import inspect
import types

import pytest

from vllm_clover import patches
from vllm_clover.patches import frontend as frontend_patches
from vllm_clover.patches import patching


@pytest.mark.parametrize("patch", [p for p in patches.CATALOGUE], ids=lambda p: p.name)
def test_patch_target_still_matches_installed_vllm(patch: patches.Patch) -> None:
    if patch.check is None:
        pytest.skip(f"{patch.name} has no shape check: {patch.no_check}")
    patch.check()


def test_every_vllm_patch_has_a_check_and_a_reason() -> None:
    for patch in patches.CATALOGUE:
        assert patch.why and patch.remove_when and patch.upstream, patch.name
        if patch.target.startswith("vllm."):
            assert patch.check is not None, f"{patch.name} patches vLLM but has no check"


def test_every_entry_has_a_shape_check_or_says_why_not() -> None:
    for patch in patches.CATALOGUE:
        assert (patch.check is not None) != bool(patch.no_check), patch.name


def test_catalogue_names_are_unique_and_describe_lists_every_field() -> None:
    names = [p.name for p in patches.CATALOGUE]
    assert len(set(names)) == len(names)
    text = patches.describe()
    for p in patches.CATALOGUE:
        entry = text[text.index(f"- {p.name}\n"):]
        for line in (f"target: {p.target}", f"why: {p.why}", f"upstream: {p.upstream}",
                     f"remove when: {p.remove_when}"):
            assert line in entry, (p.name, line)
    assert text.count("\n- ") + 1 == len(patches.CATALOGUE)


def test_the_cpu_environment_is_applied_first() -> None:
    assert patches.CATALOGUE[0].name == "cpu-env-for-spawned-processes"


def test_patches_are_installed_once() -> None:
    from vllm.config.speculative import SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    patches.apply_all()
    frontend_patches.install_serve_errors()  # only wraps once the CLI module is imported (above)

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
    assert patching.patched_by(GPUModelRunner.__init__) == "runner-init-clover-proposer"
    assert patching.patched_by(EngineArgs.add_cli_args) == "cli-speculative-model-flags"


def test_clover_architecture_is_registered() -> None:
    from vllm import ModelRegistry

    patches.apply_all()
    assert "CloverForSpeculativeDecoding" in ModelRegistry.get_supported_archs()


# ------------------------------------------------------------------ the patch utility
def _target_class() -> type:
    class Target:
        def method(self, x: int, y: int = 2) -> int:
            """vLLM's method."""
            return x + y

        @staticmethod
        def static(parser: list) -> list:
            return parser + ["vllm"]

    return Target


def _add_one(orig):
    def method(self, *args, **kwargs):
        return orig(self, *args, **kwargs) + 1

    return method


def test_wrap_marks_the_wrapper_and_keeps_the_original_behind_it() -> None:
    Target = _target_class()
    original = Target.method
    installed = patching.wrap(Target, "method", _add_one, "probe")
    assert Target.method is installed and Target().method(1) == 4
    assert patching.patched_by(Target.method) == "probe" and patching.patched_by(original) is None
    assert inspect.unwrap(Target.method) is original
    assert list(inspect.signature(Target.method).parameters) == ["self", "x", "y"]
    assert patching.params(Target.method) == ["self", "x", "y"]
    assert "vLLM's method" in patching.source(Target.method)


def test_wrap_keeps_a_staticmethod_static() -> None:
    Target = _target_class()

    def also_clover(orig):
        def static(parser, *args, **kwargs):
            return orig(parser, *args, **kwargs) + ["clover"]

        return static

    patching.wrap(Target, "static", also_clover, "probe")
    assert isinstance(Target.__dict__["static"], staticmethod)
    assert Target.static([]) == Target().static([]) == ["vllm", "clover"]
    assert patching.params(Target.static) == ["parser"]


def test_reapplying_the_same_patch_is_a_no_op() -> None:
    Target = _target_class()
    first = patching.wrap(Target, "method", _add_one, "probe")
    raw = Target.__dict__["method"]
    assert patching.wrap(Target, "method", _add_one, "probe") is first
    assert Target.__dict__["method"] is raw and Target().method(1) == 4  # wrapped once only


def test_a_second_patch_on_the_same_attribute_is_refused() -> None:
    Target = _target_class()
    patching.wrap(Target, "method", _add_one, "probe")
    with pytest.raises(patching.PatchConflict, match="already patched by 'probe'"):
        patching.wrap(Target, "method", _add_one, "other")
    with pytest.raises(patching.PatchConflict, match="'other'"):
        patching.replace(Target, "method", lambda self, x, y=2: 0, "other")
    assert Target().method(1) == 4  # still the first patch only


def test_replace_on_a_module_attribute() -> None:
    module = types.ModuleType("fake_vllm_module")

    def usage() -> int:
        return 5

    module.usage = usage

    def ours() -> int:
        return 3

    assert patching.replace(module, "usage", ours, "probe") is ours
    assert module.usage() == 3 and inspect.unwrap(module.usage) is usage
    assert patching.replace(module, "usage", ours, "probe") is ours  # no-op again


def test_a_patch_object_names_itself() -> None:
    Target = _target_class()
    patch = patching.Patch(name="probe-object", target="Target.method", why="test", remove_when="never",
                           apply=lambda: None, no_check="test only")
    patching.wrap(Target, "method", _add_one, patch)
    assert patching.patched_by(Target.method) == "probe-object"


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
