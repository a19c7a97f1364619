"""`vllm-clover` argument handling (pure parts; the server itself is tested in test_serve.py)."""

from __future__ import annotations

from vllm_clover import cli, cpu_env


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


def test_iomp_preload_is_prepended_once(monkeypatch, tmp_path) -> None:
    lib = tmp_path / "libiomp5.so"
    lib.write_text("")
    monkeypatch.setattr(cpu_env, "iomp_library", lambda: lib)
    env = cpu_env.with_iomp_preload({"LD_PRELOAD": "/x/libtcmalloc.so"})
    assert env["LD_PRELOAD"] == f"{lib}:/x/libtcmalloc.so"
    assert cpu_env.with_iomp_preload(env)["LD_PRELOAD"] == env["LD_PRELOAD"]
    assert "LD_PRELOAD" not in cpu_env.with_iomp_preload({"VLLM_CLOVER_PRELOAD_IOMP": "0"})


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
