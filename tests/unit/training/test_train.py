"""Training pipeline and evaluation (vllm_clover.training.train and its parts, .evaluate, CLI).

Everything runs on a tiny random Llama target (hidden 32, 2 layers) that shares the
default model's tokenizer (``tiny_target`` and ``convs_file`` in conftest.py), so features,
training and evaluation take seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from vllm_clover.training.state import load_state
from vllm_clover import cli
from vllm_clover.training import evaluate as E
from vllm_clover.training.batches import epoch_batches
from vllm_clover.training import train as T
from vllm_clover.model.checkpoint import load_drafter
from vllm_clover.model.drafter import clover_loss

from tests.unit.model.test_drafter import H, V, make_drafter, rand_inputs


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _args(tiny_target: Path, convs_file: Path, out: Path, **kw) -> T.TrainArgs:
    values = dict(out=str(out), target=str(tiny_target), data=str(convs_file), num_conversations=8,
                  max_len=128, num_heads=3, steps=6, batch_tokens=512, save_every=2, threads=1,
                  feature_cache=str(out.parent / f"{out.name}-features"),
                  train_vocab=1024)  # a vocabulary subset keeps each step ~50x cheaper
    values.update(kw)
    return T.TrainArgs(**values)


# ----------------------------------------------------------------------------- loss
def test_loss_backward_equals_official_loss_and_gradients() -> None:
    d = make_drafter("clover2").train()
    x, ids = rand_inputs(b=3, t=10)
    target = torch.randn(3, 10, H)
    mask = (torch.rand(3, 10, generator=torch.Generator().manual_seed(3)) > 0.3).float()
    mask[:, -1] = 0
    ref, ref_m = clover_loss(d.forward_train(x, ids), target, d.lm_head_weight, mask)
    d.zero_grad()
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in d.named_parameters()}
    for vocab in (None, torch.arange(V)):  # the full "subset" is the exact loss too
        d.zero_grad()
        loss, m = T.clover_loss_backward(d.forward_train(x, ids), target, d.lm_head_weight, mask,
                                         vocab=vocab, chunk_rows=4)
        assert loss == pytest.approx(ref.item(), rel=1e-5)
        for key in ("correct", "total", "acc"):
            torch.testing.assert_close(m[key], ref_m[key])
        for name, p in d.named_parameters():
            # Chunked rows sum the float32 gradient in another order: tiny entries of a
            # gradient can differ by ~1e-6 absolute (seen on CI's CPU), so the tolerance is
            # relative to the gradient's own scale.
            scale = ref_grads[name].abs().max().item()
            torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-4, atol=1e-5 * max(scale, 1.0))


def test_batch_vocab_holds_base_batch_tokens_and_target_top_tokens() -> None:
    g = torch.Generator().manual_seed(0)
    lm = torch.randn(V, H, generator=g)
    target = torch.randn(2, 6, H, generator=g)
    mask = torch.zeros(2, 6)
    mask[0, 2:5] = 1
    ids = torch.randint(0, V, (2, 6), generator=g)
    base = torch.tensor([0, 5, 7])
    vocab = T.batch_vocab(base, target, mask, ids, lm, topk=3)
    assert torch.equal(vocab, torch.unique(vocab))  # sorted, no duplicates
    members = set(vocab.tolist())
    assert {0, 5, 7} <= members and set(ids.flatten().tolist()) <= members
    top = (target[mask > 0] @ lm.T).topk(3, dim=-1).indices
    assert set(top.flatten().tolist()) <= members
    assert len(vocab) <= 3 + 12 + 3 * 3  # base + batch tokens + top-3 of 3 trained rows


def test_epoch_batches_seeded_and_within_budget() -> None:
    lengths = np.random.default_rng(0).integers(5, 200, size=300)
    a = epoch_batches(lengths, 1000, seed=1, epoch=0)
    assert a == epoch_batches(lengths, 1000, seed=1, epoch=0)
    assert a != epoch_batches(lengths, 1000, seed=1, epoch=1)
    assert sorted(i for b in a for i in b) == list(range(300))  # every sequence once
    assert all(len(b) * max(lengths[b]) <= 1000 for b in a)
    plan = T.BatchPlan(lengths, 1000, seed=1)
    n0 = len(plan.epoch(0))
    assert plan.locate(n0) == (1, 0) and plan.steps_for_epochs(1.5) == n0 + round(0.5 * len(plan.epoch(1)))


# ----------------------------------------------------------------------------- training
@pytest.mark.parametrize("compute_dtype", ["bfloat16", "float32"])
def test_train_loss_falls_and_writes_loadable_drafter(tiny_target, convs_file, tmp_path, compute_dtype) -> None:
    out = tmp_path / "run"
    report = T.train(_args(tiny_target, convs_file, out, steps=30, warmup_steps=1, compute_dtype=compute_dtype),
                     progress=False)
    manifest = json.loads((Path(report["data"]["feature_caches"][0]) / "manifest.json").read_text())
    assert manifest["compute_dtype"] == compute_dtype and report["args"]["compute_dtype"] == compute_dtype
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    losses = [h["loss"] for h in history]
    # The soft-label term cannot fall below the target's entropy (large for a random
    # target), so check the total falls and the regression term falls a lot.
    assert np.mean(losses[-5:]) < np.mean(losses[:3]) - 2.0, losses
    vloss = [sum(h["vloss"]) for h in history]
    assert np.mean(vloss[-5:]) < 0.8 * np.mean(vloss[:3]), vloss
    assert report["data"]["num_conversations_kept"] == 8 and report["steps"] == 30
    saved = json.loads((out / "training.json").read_text())
    assert saved["wall_time_s"]["training"] > 0 and len(saved["final_train_metrics"]["acc_per_head"]) == 3
    assert saved["device"] == "cpu" and saved["args"]["device"] == "cpu"
    assert not (out / "checkpoint").exists()  # removed after a finished run
    tensors = load_file(str(out / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert not any(k.startswith(("lm_head", "_embed", "clover_embed")) for k in tensors)
    d = load_drafter(out)
    assert d.config.num_heads == 3 and d.config.hidden_size == 32


def test_resume_after_interruption_gives_identical_weights(tiny_target, convs_file, tmp_path) -> None:
    full = tmp_path / "full"
    T.train(_args(tiny_target, convs_file, full, keep_checkpoint=True), progress=False)
    part = tmp_path / "part"
    args = _args(tiny_target, convs_file, part, keep_checkpoint=True)
    assert T.train(args, stop_after=3, progress=False) == {"interrupted_at_step": 3}
    assert not (part / "model.safetensors").exists()
    with pytest.raises(T.TrainingError, match="--resume"):
        T.train(args, progress=False)  # refuses to overwrite the interrupted run
    T.train(args, resume=True, progress=False)
    a = load_state(full / "checkpoint")
    b = load_state(part / "checkpoint")
    assert a["step"] == b["step"] == 6
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert [h["loss"] for h in a["history"]] == [h["loss"] for h in b["history"]]
    with pytest.raises(T.TrainingError, match="different settings"):
        T.train(_args(tiny_target, convs_file, part, keep_checkpoint=True, lr=5e-4), resume=True,
                progress=False)


def test_init_from_trained_heads_starts_from_their_weights(tiny_target, convs_file, tmp_path) -> None:
    first = tmp_path / "first"
    T.train(_args(tiny_target, convs_file, first), progress=False)
    # lr 0: AdamW's update and its decoupled weight decay (lr * wd) both vanish, so the
    # continued run must end exactly where its initial weights came from; a run with a
    # nonzero lr starting there must move away from them.
    frozen = tmp_path / "frozen"
    T.train(_args(tiny_target, convs_file, frozen, init_from=str(first), lr=0.0,
                  token_value_init="matched"), progress=False)
    a, b = load_file(str(first / "model.safetensors")), load_file(str(frozen / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    moved = tmp_path / "moved"
    report = T.train(_args(tiny_target, convs_file, moved, init_from=str(first)), progress=False)
    assert report["args"]["init_from"] == str(first)
    c = load_file(str(moved / "model.safetensors"))
    assert any(not torch.equal(a[k], c[k]) for k in a)
    # Clover-2 shares one head's weights across draft positions, so the layer count is what
    # changes the shape.
    with pytest.raises(T.TrainingError, match="does not match this run's shape"):
        T.train(_args(tiny_target, convs_file, tmp_path / "o1", init_from=str(first), num_layers=1),
                progress=False)
    with pytest.raises(T.TrainingError, match="clover2 heads, this run trains clover"):
        T.train(_args(tiny_target, convs_file, tmp_path / "o2", init_from=str(first), variant="clover"),
                progress=False)
    with pytest.raises(T.TrainingError, match="--init-from applies to --method clover only"):
        T.train(_args(tiny_target, convs_file, tmp_path / "o3", init_from=str(first), method="eagle"),
                progress=False)
    assert "--init-from" in _cli_error(["train", "--target", str(tiny_target), "--data", str(convs_file),
                                        "--init-from", str(tmp_path / "none"), "--out", str(tmp_path / "o4"),
                                        "--feature-cache", str(tmp_path / "o4-features")])


# ----------------------------------------------------------------------------- evaluation
def test_chain_acceptance_known_answers() -> None:
    """Oracle drafts (the target's own greedy tokens) are all accepted; wrong ones never."""
    eos = 2
    ids = torch.tensor([7, 8, 9, 10, 11, 12, 13, 14, 15, 2])  # the target's own greedy text
    greedy = torch.cat((ids[1:], torch.tensor([0])))  # g_t = y_{t+1}
    starts = torch.arange(0, 8)  # y_{t+1} is not eos
    k = 3
    oracle = torch.stack([torch.stack([greedy[min(t + 1 + j, 9)] for j in range(k)]) for t in starts.tolist()])
    acc = E.chain_accepts(oracle, starts, greedy, ids, eos)
    # full chains except where the text (at eos) ends: start 6 drafts 14, 15, eos -> 3 ...
    assert acc.tolist() == [3, 3, 3, 3, 3, 3, 2, 1]
    assert E.chain_accepts(oracle + 1, starts, greedy, ids, eos).tolist() == [0] * 8
    valid = torch.zeros(10, dtype=torch.bool)
    valid[starts] = True
    steps = E.decode_walk(acc, starts, valid, k)
    assert steps == [3, 3]  # t=0: 3 accepted + 1 -> t=4: 3 + 1 -> t=8, not a start: done
    assert E.decode_walk(acc, starts, valid, 1) == [1, 1, 1, 1]
    # a draft that matches the target but leaves the stored text stops the count
    text = ids.clone()
    text[2] = 99  # stored token differs from the target's greedy choice at position 2
    assert E.chain_accepts(oracle[:1], starts[:1], greedy, text, eos).tolist() == [1]


def test_evaluate_end_to_end_on_tiny_target(tiny_target, convs_file, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("VLLM_CLOVER_CACHE", str(tmp_path / "cache"))
    heads = tmp_path / "heads"
    T.train(_args(tiny_target, convs_file, heads, steps=4), progress=False)
    report = E.evaluate(E.EvalArgs(heads=str(heads), target=str(tiny_target), data=str(convs_file),
                                   max_len=128, feature_dtype="float32"), progress=False)
    assert report["k_max"] == 3 and len(report["per_head_accuracy"]) == 3
    lengths = [row["mean_acceptance_length_decode"] for row in report["chain"]]
    assert all(1.0 <= a <= row["k"] + 1 for a, row in zip(lengths, report["chain"]))
    assert lengths == sorted(lengths)  # longer chains never accept less
    hist = np.asarray(report["accepted_histogram_kmax"])
    per_pos = report["chain"][-1]["mean_acceptance_length_positions"]
    assert per_pos == pytest.approx(1 + (hist * np.arange(len(hist))).sum() / hist.sum())
    assert json.loads((heads / "eval_convs.json").read_text())["k_max"] == 3
    assert "mean acceptance length" in E.format_report(report)


# ----------------------------------------------------------------------------- bad input
def _cli_error(argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    message = str(exc.value.code)
    assert message.startswith("vllm-clover: error: ") and "\n" not in message, message
    return message


def test_compute_dtype_auto_is_float32_without_avx512(monkeypatch) -> None:
    from vllm_clover import cli
    from vllm_clover.cpu import env as cpu_env
    assert not cpu_env.fast_bf16_matmul({"avx2", "fma"})
    assert cpu_env.fast_bf16_matmul({"avx2", "avx512f"}) and cpu_env.fast_bf16_matmul({"amx_bf16"})
    monkeypatch.setattr(cpu_env, "cpu_flags", lambda: {"avx2"})
    assert cli.resolve_compute_dtype("auto") == "float32"
    monkeypatch.setattr(cpu_env, "cpu_flags", lambda: {"avx512f"})
    assert cli.resolve_compute_dtype("auto") == "bfloat16"
    assert cli.resolve_compute_dtype("float32") == "float32"
    monkeypatch.setattr(cpu_env, "cpu_flags", lambda: {"avx2"})
    assert cli.resolve_compute_dtype("auto", "cuda") == "bfloat16"  # a GPU: bf16 whatever the CPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_train_device_refused_with_one_line_when_absent(tiny_target, convs_file, tmp_path) -> None:
    """--device cuda without a GPU (and unknown devices) fail before any data work, naming it."""
    assert T.resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(T.TrainingError, match="sees no CUDA device"):
        T.resolve_device("cuda")
    with pytest.raises(T.TrainingError, match="only cpu and cuda"):
        T.resolve_device("meta")
    with pytest.raises(T.TrainingError, match="not a torch device"):
        T.resolve_device("gpu0")
    assert "--device cuda" in _cli_error(["train", "--target", str(tiny_target), "--data", str(convs_file),
                                          "--device", "cuda", "--out", str(tmp_path / "o"),
                                          "--feature-cache", str(tmp_path / "o-features")])


def test_train_bad_inputs_give_one_line(tiny_target, convs_file, tmp_path) -> None:
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    assert "Llama-family" in _cli_error(["train", "--target", str(gpt2), "--data", str(convs_file),
                                         "--out", str(tmp_path / "o1")])
    assert "does not exist" in _cli_error(["train", "--target", str(tmp_path / "nope"),
                                           "--out", str(tmp_path / "o2")])
    assert "not found" in _cli_error(["train", "--target", str(tiny_target), "--data",
                                      str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o3")])
    assert "no checkpoint" in _cli_error(["train", "--target", str(tiny_target), "--data", str(convs_file),
                                          "--resume", "--out", str(tmp_path / "o4")])
    assert "does not exist" in _cli_error(["eval", "--heads", str(tmp_path / "none"),
                                           "--target", str(tiny_target)])
    assert "does not exist" in _cli_error(["convert", str(tmp_path / "none"), str(tmp_path / "o5")])
