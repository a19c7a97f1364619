"""Data-parallel training: 2 CPU processes over gloo, started with torchrun, on a tiny Llama.

The runs train Clover-2 on a small real corpus (the first ShareGPT training conversations,
tests/unit/training/test_corpus.py) with the target's features computed per batch, in
float32, with ``--train-vocab`` (a per-batch token subset, combined over the ranks) and
``--token-value-init matched`` (computed on rank 0, broadcast). What they prove:

* 2 processes give the weights of 1 process with the same global batches and steps
  (allclose in float32) and the same per-step loss and trained-row counts: the gradients
  are combined as one batch's and the shares are disjoint and cover every batch (shares
  computed twice would double the counts; gradients not combined would move the weights
  apart by about the learning rate per step, far beyond the tolerance).
* A 2-process run stopped by a SIGTERM to one rank stops on both ranks at the same step
  with a checkpoint, and resumed it ends with the uninterrupted run's weights.
* A pause file that one rank sees pauses every rank (the resumed run above).
* Only rank 0 writes under ``--out``: each rank records its file-system writes there with
  a Python audit hook (opens for writing, renames, removals, mkdir).

Running this file as a script is the per-rank harness torchrun starts for the audited runs
(``_rank_main``): it installs the audit hook, optionally sends its own rank a SIGTERM once
a checkpoint reaches a step, and runs ``vllm_clover.cli.main``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

from vllm_clover.training import train as T
from vllm_clover.training.corpus import build_corpus
from vllm_clover.training.distributed import DataParallel, check_supported
from vllm_clover.training.state import load_state
from vllm_clover.training.train import PAUSE_ENV

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_thread")]  # tests/conftest.py

REPO = Path(__file__).resolve().parents[3]
MAX_LEN = 256
STEPS = 5
# One process per rank, one intra-op thread each (2-core machine); a few steps of batches of
# 1,024 padded tokens (4 or more sequences each, so both ranks get a share).
TRAIN_FLAGS = ["--max-len", str(MAX_LEN), "--num-heads", "3", "--steps", str(STEPS), "--batch-tokens", "1024",
               "--save-every", "1", "--threads", "1", "--train-vocab", "512", "--compute-dtype", "float32",
               "--token-value-init", "matched", "--keep-checkpoint"]


# ----------------------------------------------------------------------------- per-rank harness
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_MUTATING_EVENTS = {"os.rename", "os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree", "os.truncate",
                    "os.link", "os.symlink", "os.chmod"}


def _record_writes_under(root: Path, writes: list[list[str]]) -> None:
    """Append [event, path] to ``writes`` for every write-like file-system event under ``root``
    in this process (Python's audit events: what our code writes passes through them)."""
    prefix = str(root.resolve())

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, _mode, flags = args
            if not isinstance(flags, int) or not flags & _WRITE_FLAGS:
                return
            paths = [path]
        elif event in _MUTATING_EVENTS:
            paths = list(args[:2])
        else:
            return
        for p in paths:
            if isinstance(p, (str, bytes, os.PathLike)):
                full = os.path.abspath(os.fsdecode(p))
                if full == prefix or full.startswith(prefix + os.sep):
                    writes.append([event, full])

    sys.addaudithook(hook)


def _sigterm_self_after(out: Path, step: int) -> None:
    """Send this process a SIGTERM once ``out``'s checkpoint holds step ``step`` or later."""
    state = out / "checkpoint" / "state.json"
    while True:
        try:
            done = json.loads(state.read_text())["state"]["step"]
        except (OSError, ValueError, KeyError):
            done = -1
        if done >= step:
            os.kill(os.getpid(), signal.SIGTERM)
            return
        time.sleep(0.01)


def _rank_main(argv: list[str]) -> None:
    """``THIS_FILE AUDIT_DIR SIGTERM_RANK SIGTERM_AFTER_STEP PAUSE_FILE -- train ARGS`` under
    torchrun: rank SIGTERM_RANK (-1: none) signals itself once the checkpoint reaches
    SIGTERM_AFTER_STEP; rank 1 alone watches PAUSE_FILE ("-": none) as its pause file."""
    from vllm_clover import cli

    audit_dir, sigterm_rank, sigterm_step, pause_file = Path(argv[0]), int(argv[1]), int(argv[2]), argv[3]
    train_argv = argv[argv.index("--") + 1:]
    rank = int(os.environ["RANK"])
    out = Path(train_argv[train_argv.index("--out") + 1])
    writes: list[list[str]] = []
    _record_writes_under(out, writes)
    if rank == sigterm_rank:
        threading.Thread(target=_sigterm_self_after, args=(out, sigterm_step), daemon=True).start()
    if rank == 1 and pause_file != "-":
        os.environ[PAUSE_ENV] = pause_file
    try:
        cli.main(train_argv)
    finally:
        (audit_dir / f"rank{rank}.json").write_text(json.dumps(writes))


# ----------------------------------------------------------------------------- helpers

def _torchrun(entry: list[str], train_argv: list[str], timeout: float = 300,
             on_stderr: Callable[[str], bool] | None = None) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node 2 ENTRY TRAIN_ARGV`` from the repository root
    (the source checkout is what the ranks import); returns the finished process. While it
    runs, ``on_stderr(stderr so far)`` is called every 0.1 s until it returns True."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc_per_node", "2", *entry, *train_argv]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop(PAUSE_ENV, None)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err, text=True)
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"torchrun ran over {timeout} s")
            if on_stderr is not None:
                err.seek(0)
                if on_stderr(err.read()):
                    on_stderr = None
            time.sleep(0.1)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())


def _audited(audit_dir: Path, train_argv: list[str], sigterm_rank: int = -1, sigterm_step: int = 0,
             pause_file: Path | None = None, on_stderr: Callable[[str], bool] | None = None
             ) -> tuple[subprocess.CompletedProcess, list[list[list[str]]]]:
    """A 2-rank run through :func:`_rank_main`; returns it and each rank's writes under --out."""
    audit_dir.mkdir(parents=True, exist_ok=True)
    harness = [__file__, str(audit_dir), str(sigterm_rank), str(sigterm_step), str(pause_file or "-"), "--"]
    proc = _torchrun(harness, train_argv, on_stderr=on_stderr)
    writes = [json.loads((audit_dir / f"rank{r}.json").read_text()) for r in range(2)]
    return proc, writes


def _train_argv(target: Path, corpus: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--target", str(target), "--data", str(corpus), "--out", str(out), *TRAIN_FLAGS, *extra]


def _one_process_args(target: Path, corpus: Path, out: Path) -> T.TrainArgs:
    """The TrainArgs ``_train_argv`` gives (the same run in this process)."""
    return T.TrainArgs(out=str(out), target=str(target), data=str(corpus), max_len=MAX_LEN, num_heads=3,
                       steps=STEPS, batch_tokens=1024, save_every=1, threads=1, train_vocab=512,
                       compute_dtype="float32", token_value_init="matched", keep_checkpoint=True)


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory, tiny_target):
    out = tmp_path_factory.mktemp("corpus") / "c"
    build_corpus(out, target=tiny_target, max_len=MAX_LEN, seed=0, limit=12)
    return out


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory, tiny_target, corpus_dir) -> Path:
    """The uninterrupted 2-process run, started as docs/training.md says:
    ``torchrun --nproc_per_node 2 -m vllm_clover.cli train ...``."""
    out = tmp_path_factory.mktemp("dp") / "run"
    proc = _ok(_torchrun(["-m", "vllm_clover.cli"], _train_argv(tiny_target, corpus_dir, out)))
    assert proc.stdout.count("[vllm-clover] wrote") == 1  # rank 0 reports, once
    return out


# ----------------------------------------------------------------------------- tests
def test_two_processes_train_the_weights_of_one(two_process_run, tiny_target, corpus_dir, tmp_path) -> None:
    one = tmp_path / "one"
    T.train(_one_process_args(tiny_target, corpus_dir, one), progress=False)
    a, b = load_state(one / "checkpoint"), load_state(two_process_run / "checkpoint")
    assert a["step"] == b["step"] == STEPS and len(b["rng_ranks"]) == 2
    # Same global batches: the same trained rows per head, the same subset of the vocabulary
    # and, up to float rounding, the same loss at every step.
    assert [h["total"] for h in a["history"]] == [h["total"] for h in b["history"]]
    assert [h["vocab"] for h in a["history"]] == [h["vocab"] for h in b["history"]]
    assert [h["correct"] for h in a["history"]] == [h["correct"] for h in b["history"]]
    torch.testing.assert_close([h["loss"] for h in b["history"]], [h["loss"] for h in a["history"]],
                               rtol=1e-6, atol=0)
    # The weights moved by about lr per step and agree far closer than that.
    args = _one_process_args(tiny_target, corpus_dir, tmp_path / "init")
    init = T._seeded_model(args, tiny_target, T.check_target(tiny_target), torch.device("cpu"))[0].state_dict()
    moved = max(float((a["model"][k] - init[k]).abs().max()) for k in init)
    assert moved > 1e-3
    for k, w in a["model"].items():
        torch.testing.assert_close(b["model"][k], w, rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")
    report = json.loads((two_process_run / "training.json").read_text())
    assert report["world_size"] == 2 and report["steps"] == STEPS


def test_sigterm_to_one_rank_stops_both_and_the_run_resumes_exactly(two_process_run, tiny_target, corpus_dir,
                                                                   tmp_path) -> None:
    out = tmp_path / "run"
    argv = _train_argv(tiny_target, corpus_dir, out)
    # Rank 1 alone gets the signal, once step 1 is checkpointed; both ranks stop at one step.
    stopped, stop_writes = _audited(tmp_path / "audit-stop", argv, sigterm_rank=1, sigterm_step=1)
    assert stopped.returncode != 0
    steps = re.findall(r"vllm-clover: error: interrupted at step (\d+); continue with --resume", stopped.stderr)
    assert len(steps) == 2 and len(set(steps)) == 1, stopped.stderr[-4000:]
    stop_step = int(steps[0])
    assert 1 <= stop_step < STEPS
    assert load_state(out / "checkpoint")["step"] == stop_step
    assert not (out / "training.json").exists()

    # Resumed with a pause file that rank 1 alone sees: rank 0 pauses too (it says so), and
    # both go on once the file is gone.
    pause = tmp_path / "PAUSE"
    pause.touch()

    def unpause_once_rank0_pauses(stderr: str) -> bool:
        if "paused while another rank's pause file exists" not in stderr:
            return False
        pause.unlink()
        return True

    resumed, resume_writes = _audited(tmp_path / "audit-resume", [*argv, "--resume"], pause_file=pause,
                                      on_stderr=unpause_once_rank0_pauses)
    _ok(resumed)
    assert not pause.exists() and "[vllm-clover] resumed\n" in resumed.stderr
    a, b = load_state(two_process_run / "checkpoint"), load_state(out / "checkpoint")
    assert b["step"] == STEPS
    for k, w in a["model"].items():
        assert torch.equal(b["model"][k], w), k
    assert [h["loss"] for h in a["history"]] == [h["loss"] for h in b["history"]]

    # Only rank 0 wrote under --out: the checkpoints while stopping, the result on resuming.
    assert stop_writes[1] == [] and resume_writes[1] == []
    written = {Path(p).name for _e, p in stop_writes[0] + resume_writes[0]}
    assert {"state.json", "training.json", "history.jsonl", "config.json"} <= written


def test_too_few_sequences_per_batch_is_refused_on_every_rank(tiny_target, corpus_dir, tmp_path) -> None:
    # Batches of 256 padded tokens hold one sequence whenever one is longer than 128 tokens.
    argv = _train_argv(tiny_target, corpus_dir, tmp_path / "run") + ["--batch-tokens", "256"]
    proc = _torchrun(["-m", "vllm_clover.cli"], argv)
    assert proc.returncode != 0
    line = ("vllm-clover: error: 2 processes but a batch of this run holds only 1 sequence(s): "
            "raise --batch-tokens or start fewer processes")
    assert proc.stderr.count(line) == 2, proc.stderr[-4000:]
    assert not (tmp_path / "run").exists()


def test_what_data_parallel_does_not_cover_is_refused_with_one_line(monkeypatch, convs_file, tmp_path,
                                                                    capsys) -> None:
    from vllm_clover import cli

    monkeypatch.setenv("WORLD_SIZE", "2")
    for flags, problem in ((["--data", str(convs_file)], "needs a corpus directory as --data"),
                           (["--method", "eagle3", "--data", str(tmp_path)], "--method eagle3 runs in one process")):
        with pytest.raises(SystemExit) as exc:
            cli.main(["train", "--out", str(tmp_path / "run"), "--steps", "1", *flags])
        assert str(exc.value).startswith("vllm-clover: error: ") and problem in str(exc.value)
        assert "\n" not in str(exc.value)
    assert not (tmp_path / "run").exists()
    check_supported("clover", False, 1)  # one process: feature caches as before
    with pytest.raises(T.TrainingError, match="batch of this run holds only 1"):
        DataParallel(torch.device("cpu"), world_size=2).check_batches([[0, 1], [2]])
    assert DataParallel(torch.device("cpu"), rank=1, world_size=2).share([7, 6, 5, 4, 3]) == [6, 4]


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
