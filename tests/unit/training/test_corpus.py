"""The tokenized corpus, training on it with features computed per batch, and the state files.

Real ShareGPT conversations (the first training conversations), the real tokenizer and a
tiny random Llama target (tests/conftest.py), so each test takes seconds.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from vllm_clover.training import train as T
from vllm_clover.training.corpus import Corpus, build_corpus, preamble_tokens, turn_windows
from vllm_clover.training.data import tokenize_conversation
from vllm_clover.training.features import load_target_for_features, prenorm_hidden
from vllm_clover.training.inputs import split_sharegpt
from vllm_clover.training.state import StateError, load_state, save_state
from vllm_clover.training.stream import CorpusSlice, TargetFeatures

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

MAX_LEN = 256


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory, tiny_target):
    out = tmp_path_factory.mktemp("corpus") / "c"
    build_corpus(out, target=tiny_target, max_len=MAX_LEN, seed=0, limit=12)
    return out


def _args(tiny_target, corpus_dir, out, **kw) -> T.TrainArgs:
    values = dict(out=str(out), target=str(tiny_target), data=str(corpus_dir), max_len=MAX_LEN, num_heads=3,
                  steps=5, batch_tokens=1024, save_every=2, threads=1, draft_vocab=512, keep_checkpoint=True)
    values.update(kw)
    return T.TrainArgs(**values)


# ----------------------------------------------------------------------------- the corpus
def test_corpus_holds_every_window_of_the_training_conversations(corpus_dir, tiny_target) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_target))
    corpus = Corpus(corpus_dir)
    train, held = split_sharegpt()
    expected = []
    for c in train[:12]:
        for w in turn_windows(tok, c.messages, MAX_LEN, preamble_tokens(tok)):
            ids, mask = tokenize_conversation(tok, w, MAX_LEN)
            if sum(mask[1:]):
                expected.append((tuple(ids), tuple(mask)))
    got = [tuple(map(tuple, corpus.sequence(s))) for s in range(len(corpus))]
    assert sorted(got) == sorted(expected)  # same sequences, in the seeded order
    assert got != expected or len(got) < 3
    assert corpus.tokens.dtype == np.uint16 and max(corpus.lengths) <= MAX_LEN
    assert len(got) > 12  # long conversations were cut into several windows
    assert corpus.info["counts"]["tokens"] == int(corpus.offsets[-1])
    assert not {c.id for c in train[:12]} & {c.id for c in held}


def test_windows_are_whole_pairs_in_order() -> None:
    from transformers import AutoTokenizer

    from vllm_clover.default_model import default_model_dir

    tok = AutoTokenizer.from_pretrained(str(default_model_dir()))
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " + "word " * 60}
            for i in range(10)]
    windows = turn_windows(tok, msgs, 200, preamble_tokens(tok))
    assert [m for w in windows for m in w] == msgs
    assert all(len(w) % 2 == 0 and w[0]["role"] == "user" for w in windows)
    assert len(windows) > 1
    assert all(len(tokenize_conversation(tok, w, 10**6)[0]) <= 200 for w in windows)


def test_token_range_picks_whole_sequences_and_refuses_bad_ranges(corpus_dir) -> None:
    corpus = Corpus(corpus_dir)
    offsets = corpus.offsets
    r = corpus.token_range(int(offsets[1]), int(offsets[4]))
    assert list(r) == [1, 2, 3]
    a, b = corpus.token_range(0, int(offsets[2])), corpus.token_range(int(offsets[2]), int(offsets[-1]))
    assert set(a).isdisjoint(b) and len(a) + len(b) == len(corpus)
    for bad in ((5, 5), (int(offsets[-1]) + 1, int(offsets[-1]) + 9)):
        with pytest.raises(T.TrainingError, match="token-range"):
            corpus.token_range(*bad)


def test_corrupt_or_foreign_corpus_is_refused(corpus_dir, tmp_path, tiny_target, default_model_dir) -> None:
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(corpus_dir, bad)
    np.save(bad / "offsets.npy", np.load(bad / "offsets.npy")[:-2])
    with pytest.raises(T.TrainingError, match="disagree"):
        Corpus(bad)
    (bad / "tokens.npy").write_bytes(b"not numpy")
    with pytest.raises(T.TrainingError, match="tokens.npy"):
        Corpus(bad)
    with pytest.raises(T.TrainingError, match="not a corpus"):
        Corpus(tmp_path)
    with pytest.raises(T.TrainingError, match="another target"):
        T.train(_args(default_model_dir, corpus_dir, tmp_path / "run"), progress=False)


# ----------------------------------------------------------------------------- features per batch
def test_features_per_batch_equal_the_target_forward(corpus_dir, tiny_target) -> None:
    ds = CorpusSlice(Corpus(corpus_dir))
    ds.features = TargetFeatures(tiny_target, "float32", torch.device("cpu"))
    batch = ds.collate([0, 1])
    _m, decoder, norm = load_target_for_features(tiny_target, "float32")
    for row in range(2):
        n = int(batch["lengths"][row])
        ids = ds[row]["input_ids"][None]
        ref = prenorm_hidden(decoder, norm, ids, torch.ones_like(ids)).to(torch.bfloat16)[0]
        torch.testing.assert_close(batch["x"][row, :n], ref, atol=2e-2, rtol=2e-2)
        assert torch.all(batch["x"][row, n:] == 0)
    assert ds.features.tokens == int(batch["lengths"].sum())


def test_training_on_a_corpus_resumes_exactly(corpus_dir, tiny_target, tmp_path) -> None:
    full, part = tmp_path / "full", tmp_path / "part"
    report = T.train(_args(tiny_target, corpus_dir, full), progress=False)
    assert report["data"]["corpus"] and report["data"]["num_sequences"] == len(Corpus(corpus_dir))
    args = _args(tiny_target, corpus_dir, part)
    assert T.train(args, stop_after=3, progress=False) == {"interrupted_at_step": 3}
    T.train(args, resume=True, progress=False)
    a, b = load_state(full / "checkpoint"), load_state(part / "checkpoint")
    assert a["step"] == b["step"] == 5
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert [h["loss"] for h in a["history"]] == [h["loss"] for h in b["history"]]
    # The served draft vocabulary is the corpus's ranking, and the loss used its first 512 ids.
    saved = json.loads((full / "draft_vocab.json").read_text())
    ranking = saved["token_ids"]
    assert list(ranking[:512]) == Corpus(corpus_dir).ranking[:512].tolist()
    assert {h["vocab"] for h in a["history"]} == {512}


def test_token_ranges_split_the_data_and_deadline_checkpoints(corpus_dir, tiny_target, tmp_path) -> None:
    corpus = Corpus(corpus_dir)
    mid = int(corpus.offsets[len(corpus) // 2])
    first = T.train(_args(tiny_target, corpus_dir, tmp_path / "a", token_range=(0, mid), steps=2), progress=False)
    assert first["data"]["num_sequences"] == len(corpus) // 2
    args = _args(tiny_target, corpus_dir, tmp_path / "b", token_range=(mid, int(corpus.offsets[-1])),
                 init_from=str(tmp_path / "a"))
    assert T.train(args, progress=False, deadline=0.0) == {"interrupted_at_step": 0}
    report = T.train(args, resume=True, progress=False)
    assert report["data"]["num_sequences"] == len(corpus) - len(corpus) // 2


# ----------------------------------------------------------------------------- the state files
def test_state_round_trip_is_exact_and_tampering_fails(tmp_path) -> None:
    import random

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.randn(3, 2))], lr=1e-3, betas=(0.9, 0.95))
    opt.param_groups[0]["params"][0].grad = torch.ones(3, 2)
    opt.step()
    state = {"opt": opt.state_dict(), "py": random.getstate(), "np": np.random.get_state(),
             "torch": torch.get_rng_state(), "hist": [{"loss": 1.25, "acc": [0.5, None]}], "n": 3}
    d = tmp_path / "ckpt"
    save_state(d, state, step=3)
    back = load_state(d)
    assert back["py"] == state["py"] and back["n"] == 3 and back["hist"] == state["hist"]
    assert back["np"][0] == "MT19937" and np.array_equal(back["np"][1], state["np"][1])
    assert back["np"][1].dtype == state["np"][1].dtype and torch.equal(back["torch"], state["torch"])
    assert back["opt"]["param_groups"] == state["opt"]["param_groups"]
    for k, v in state["opt"]["state"][0].items():
        assert torch.equal(back["opt"]["state"][0][k], v)
    tensors = next(d.glob("state-*.safetensors"))
    raw = tensors.read_bytes()
    tensors.write_bytes(raw[:-8] + bytes(b ^ 0xFF for b in raw[-8:]))
    with pytest.raises(StateError, match="sha256"):
        load_state(d)
    (d / "state.json").write_text("{not json")
    with pytest.raises(StateError, match="not valid JSON"):
        load_state(d)
    (d / "state.json").unlink()
    (d / "state.pt").write_bytes(b"\x80\x04pickle")
    with pytest.raises(StateError, match="not loaded"):
        load_state(d)
