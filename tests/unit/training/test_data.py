"""Training-data pipeline: ShareGPT / MT-Bench loading, split, chat tokenisation, feature cache."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from vllm_clover.training import data as D
from vllm_clover.training import features as F
from vllm_clover.training.batches import collate_features
def _rec(rid: str, *turns: tuple[str, str]) -> dict:
    return {"id": rid, "conversations": [{"from": f, "value": v} for f, v in turns]}


# --------------------------------------------------------------------------- ShareGPT parsing


def _write_truncated(path: Path, records: list[dict]) -> None:
    text = json.dumps(records, indent=2)
    # Cut inside the last record's string, like the packaged file.
    cut = text.rindex('"value"') + 12
    path.write_text(text[:cut])


def test_truncated_json_keeps_complete_records(tmp_path: Path) -> None:
    recs = [_rec(f"a{i}_0", ("human", f"q{i}"), ("gpt", f"a{i}")) for i in range(4)]
    path = tmp_path / "sg.json"
    _write_truncated(path, recs)
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text())
    assert [r["id"] for r in D.read_sharegpt_records(path)] == ["a0_0", "a1_0", "a2_0"]
    # A complete file parses fully too.
    path.write_text(json.dumps(recs))
    assert len(D.read_sharegpt_records(path)) == 4


def test_sharegpt_cleaning_rules(tmp_path: Path) -> None:
    recs = [
        _rec("ok_0", ("human", "q"), ("gpt", "a"), ("human", "q2"), ("gpt", "a2")),
        _rec("gptfirst_1", ("gpt", "a"), ("human", "q")),
        _rec("system_0", ("system", "s"), ("human", "q"), ("gpt", "a")),
        _rec("trailing_0", ("human", "q"), ("gpt", "a"), ("human", "unanswered")),
        _rec("blank_0", ("human", "q"), ("gpt", "a"), ("human", "q2"), ("gpt", "  "), ("human", "x"), ("gpt", "y")),
        _rec("repeat_0", ("human", "q"), ("human", "q again"), ("gpt", "a")),
        _rec("onlyq_0", ("human", "q")),
        _rec("empty_0"),
        _rec("tail_0", ("human", "q"), ("gpt", "a")),
    ]
    path = tmp_path / "sg.json"
    _write_truncated(path, recs)
    convs = D.load_sharegpt(path)
    by_id = {c.id: c.messages for c in convs}
    assert list(by_id) == ["ok_0", "trailing_0", "blank_0"]
    assert [m["role"] for m in by_id["ok_0"]] == ["user", "assistant", "user", "assistant"]
    assert by_id["ok_0"][3] == {"role": "assistant", "content": "a2"}
    assert len(by_id["trailing_0"]) == 2  # unanswered user turn trimmed
    assert len(by_id["blank_0"]) == 2  # cut before the blank answer (and its question)


def test_missing_file_error_names_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(D.DataError, match="nope.json"):
        D.load_sharegpt(missing)
    with pytest.raises(D.DataError, match="nope.json"):
        D.load_mtbench(missing)


def test_real_sharegpt_counts() -> None:
    recs = D.read_sharegpt_records()
    assert len(recs) == 17_671
    assert sum(1 for r in recs if r["conversations"] and r["conversations"][0]["from"] == "human") == 11_144
    convs = D.load_sharegpt()
    assert 11_000 < len(convs) <= 11_144
    for c in convs[:2000]:
        roles = [m["role"] for m in c.messages]
        assert roles == ["user", "assistant"] * (len(roles) // 2)
        assert all(m["content"].strip() for m in c.messages)


# --------------------------------------------------------------------------- split


def _convs(ids: list[str]) -> list[D.Conversation]:
    return [D.Conversation(i, [{"role": "user", "content": i}, {"role": "assistant", "content": i}]) for i in ids]


def test_split_fixed_disjoint_and_order_independent() -> None:
    ids = [f"c{i}_{p}" for i in range(300) for p in range(1 + i % 3)]
    convs = _convs(ids)
    train, held = D.split_heldout(convs, heldout_size=50, seed=0)
    train2, held2 = D.split_heldout(list(reversed(convs)), heldout_size=50, seed=0)
    assert [c.id for c in held] == [c.id for c in held2]
    assert [c.id for c in train] == [c.id for c in train2]
    assert len(held) >= 50 and len(train) + len(held) == len(convs)
    # No group (chat split into _0, _1, ... parts) on both sides.
    groups = lambda cs: {c.id.rsplit("_", 1)[0] for c in cs}  # noqa: E731
    assert not groups(train) & groups(held)
    # Another seed gives another split.
    assert {c.id for c in D.split_heldout(convs, 50, seed=1)[1]} != {c.id for c in held}


def test_split_heldout_independent_of_training_subset() -> None:
    convs = D.load_sharegpt()
    train, held = D.split_heldout(convs, heldout_size=200, seed=0)
    assert len(held) >= 200
    train_b, held_b = D.split_heldout(convs, heldout_size=200, seed=0)
    assert [c.id for c in held_b] == [c.id for c in held]
    held_ids = {c.id for c in held}
    # Training subsets of any size are prefixes of the fixed training order.
    assert not held_ids & {c.id for c in train[:5000]}
    assert [c.id for c in train[:100]] == [c.id for c in train_b[:100]]


def test_load_mtbench() -> None:
    qs = D.load_mtbench()
    assert len(qs) == 80
    assert set(qs[0]) == {"question_id", "category", "turns"}
    assert all(len(q["turns"]) == 2 and all(isinstance(t, str) for t in q["turns"]) for q in qs)


# --------------------------------------------------------------------------- tokenisation


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


def _masked_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


def test_tokenize_masks_exactly_the_assistant_responses(tokenizer) -> None:
    msgs = [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Write a haiku."},
        {"role": "assistant", "content": "Autumn moonlight -\na worm digs silently\ninto the chestnut."},
    ]
    ids, mask = D.tokenize_conversation(tokenizer, msgs, max_len=10_000)
    text = tokenizer.apply_chat_template(msgs, tokenize=False)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    runs = _masked_runs(ids, mask)
    assert [tokenizer.decode(r) for r in runs] == [
        "Hello! How can I help?<|im_end|>",
        "Autumn moonlight -\na worm digs silently\ninto the chestnut.<|im_end|>",
    ]
    assert all(r[-1] == tokenizer.eos_token_id for r in runs)
    # Truncation keeps the prefix.
    ids8, mask8 = D.tokenize_conversation(tokenizer, msgs, max_len=8)
    assert ids8 == ids[:8] and mask8 == mask[:8]


def test_tokenize_response_merging_with_header(tokenizer) -> None:
    # "\n" ending the assistant header merges with a leading "\n" of the response into one
    # token; that token is response text too, so it is masked.
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "\n\nAnswer."}]
    ids, mask = D.tokenize_conversation(tokenizer, msgs, max_len=1000)
    (run,) = _masked_runs(ids, mask)
    assert tokenizer.decode(run).endswith("\n\nAnswer.<|im_end|>")
    assert tokenizer.decode(run).count("assistant") == 0


def _mask_by_token_diff(tokenizer, msgs) -> list[int]:
    """Reference: render prefixes, tokenise each, diff lengths (valid when no merges)."""
    enc = lambda m, g: tokenizer(tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=g),  # noqa: E731
                                 add_special_tokens=False)["input_ids"]
    full = enc(msgs, False)
    mask = [0] * len(full)
    for i, m in enumerate(msgs):
        if m["role"] == "assistant":
            a, b = len(enc(msgs[:i], True)), len(enc(msgs[: i + 1], False))
            for k in range(a, b - 1):  # b-1: drop the "\n" after <|im_end|>
                mask[k] = 1
    return mask


def test_tokenize_matches_prefix_token_diff_on_sharegpt(tokenizer) -> None:
    convs = [c for c in D.load_sharegpt()[:40] if not any(m["content"][:1].isspace() for m in c.messages)]
    assert len(convs) >= 20
    for c in convs[:20]:
        ids, mask = D.tokenize_conversation(tokenizer, c.messages, max_len=100_000)
        assert mask == _mask_by_token_diff(tokenizer, c.messages), c.id


# --------------------------------------------------------------------------- features


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, default_model_dir: Path) -> Path:
    """A random 2-layer Llama (hidden 32) sharing the default model's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2)
    model = LlamaForCausalLM(config)
    # Make the final norm non-trivial so pre- and post-norm differ in scale and direction.
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 2.0)
    model.save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default_model_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def small_convs() -> list[D.Conversation]:
    convs = D.split_heldout(D.load_sharegpt())[0][:6]
    return convs + [D.Conversation("short", [{"role": "user", "content": "Hi"},
                                             {"role": "assistant", "content": "Hello!"}])]


def _reference_prenorm(model_dir: Path, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(pre-norm last-layer output, post-norm output) for one unpadded sequence, float32.

    Uses transformers' own hidden_states with ``tie_last_hidden_states=False``, which
    keeps the last decoder layer's raw output instead of overwriting it with the normed one.
    """
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        post = model.model(input_ids=x).last_hidden_state[0]
        model.config.tie_last_hidden_states = False
        pre = model.model(input_ids=x, output_hidden_states=True).hidden_states[-1][0]
    assert not torch.allclose(pre, post, atol=1e-2)  # they really are different things
    return pre, post


def test_feature_cache_end_to_end(tiny_model: Path, small_convs, tmp_path: Path, monkeypatch) -> None:
    cache = tmp_path / "feats"
    F.extract_features(tiny_model, small_convs, cache, max_len=256, dtype="float32",
                       data_source="test", shard_tokens=600, batch_tokens=700, verbose=False)
    manifest = F.read_manifest(cache)
    assert manifest["complete"] and manifest["max_len"] == 256
    assert manifest["target"]["hidden_size"] == 32 and manifest["hidden_dtype"] == "bfloat16"
    tok = _tok(tiny_model)
    tokenized = [D.tokenize_conversation(tok, c.messages, 256) for c in small_convs]
    # Conversations whose answer starts beyond max_len have nothing to train on: skipped.
    kept = [k for k, (_, m) in enumerate(tokenized) if sum(m[1:])]
    assert 0 < len(kept) < len(small_convs)
    assert manifest["data"]["num_sequences"] == len(kept)
    assert manifest["data"]["num_conversations_dropped_no_loss"] == len(small_convs) - len(kept)
    shards = sorted(p.name for p in cache.glob("shard_*.safetensors"))
    assert len(shards) >= 2 and shards == [s["file"] for s in manifest["shards"]]

    from safetensors import safe_open

    with safe_open(str(cache / shards[0]), "pt") as f:
        assert f.get_tensor("input_ids").dtype == torch.int32
        assert f.get_tensor("loss_mask").dtype == torch.uint8
        assert f.get_tensor("hidden").dtype == torch.bfloat16
        assert f.get_tensor("seq_offsets").dtype == torch.int64

    ds = F.FeatureDataset(cache)
    assert len(ds) == len(kept) and ds.lengths.tolist() == [len(tokenized[k][0]) for k in kept]
    for j, k in enumerate(kept):
        assert ds[j]["input_ids"].tolist() == tokenized[k][0]
        assert ds[j]["loss_mask"].tolist() == tokenized[k][1]
    tok_ids = tokenized[kept[-1]][0]
    item = ds[len(kept) - 1]
    assert item["hidden"].shape == (len(tok_ids), 32)

    # Stored x_t is the pre-final-norm state (to bf16 rounding), and norm(x_t) is the post-norm.
    pre, post = _reference_prenorm(tiny_model, tok_ids)
    torch.testing.assert_close(item["hidden"].float(), pre, rtol=1.6e-2, atol=1e-3)
    norm_w, eps, lm_head, embed = F.load_target_head(tiny_model)
    assert lm_head is embed and norm_w.shape == (32,) and eps == pytest.approx(1e-5)
    torch.testing.assert_close(F.rms_norm(item["hidden"], norm_w, eps), post, rtol=3e-2, atol=3e-2)

    # Second run: reused without loading the model.
    monkeypatch.setattr(F, "load_target_for_features", lambda *a, **k: pytest.fail("model reloaded"))
    mtimes = {p.name: p.stat().st_mtime_ns for p in cache.glob("shard_*")}
    F.extract_features(tiny_model, small_convs, cache, max_len=256, dtype="float32",
                       data_source="test", shard_tokens=600, batch_tokens=700, verbose=False)
    assert mtimes == {p.name: p.stat().st_mtime_ns for p in cache.glob("shard_*")}

    # Different inputs: clear error, or recompute with overwrite=True.
    with pytest.raises(F.FeatureCacheMismatch, match="max_len"):
        F.extract_features(tiny_model, small_convs, cache, max_len=128, dtype="float32",
                           shard_tokens=600, verbose=False)
    monkeypatch.undo()


def _tok(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def test_feature_cache_resumes_missing_shards(tiny_model: Path, tmp_path: Path, monkeypatch) -> None:
    cache = tmp_path / "feats"
    convs = [D.Conversation(f"s{i}", [{"role": "user", "content": f"Question {i}? " * (i + 1)},
                                      {"role": "assistant", "content": f"Answer {i}. " * (3 * i + 2)}])
             for i in range(6)]
    kw = dict(max_len=128, dtype="bfloat16", shard_tokens=100, batch_tokens=256, verbose=False)
    F.extract_features(tiny_model, convs, cache, **kw)
    before = {p.name: p.read_bytes() for p in cache.glob("shard_*")}
    assert len(before) >= 3
    # Simulate an interrupted run: one shard missing, manifest not complete.
    victim = sorted(before)[1]
    (cache / victim).unlink()
    manifest = F.read_manifest(cache)
    manifest["complete"] = False
    (cache / F.MANIFEST).write_text(json.dumps(manifest))
    computed = []
    real = F._compute_shard
    monkeypatch.setattr(F, "_compute_shard", lambda d, n, seqs, *rest: computed.append(len(seqs)) or real(d, n, seqs, *rest))
    F.extract_features(tiny_model, convs, cache, **kw)
    assert len(computed) == 1 and F.read_manifest(cache)["complete"]
    assert {p.name: p.read_bytes() for p in cache.glob("shard_*")} == before
    # overwrite=True recomputes under new settings.
    F.extract_features(tiny_model, convs, cache, **{**kw, "max_len": 48}, overwrite=True)
    assert F.read_manifest(cache)["max_len"] == 48
    assert max(F.FeatureDataset(cache).lengths) == 48


def test_collate_shift_convention() -> None:
    h = 4
    a = {"input_ids": torch.tensor([10, 11, 12, 13, 14]), "loss_mask": torch.tensor([0, 0, 1, 1, 1], dtype=torch.uint8),
         "hidden": torch.arange(5 * h, dtype=torch.bfloat16).reshape(5, h)}
    b = {"input_ids": torch.tensor([20, 21, 22]), "loss_mask": torch.tensor([0, 1, 1], dtype=torch.uint8),
         "hidden": -torch.ones(3, h, dtype=torch.bfloat16)}
    out = collate_features([a, b])
    assert out["x"].shape == (2, 5, h) and out["x"].dtype == torch.bfloat16
    assert torch.equal(out["x"][0], a["hidden"]) and not out["x"][1, 3:].any()
    # x_t pairs with y_{t+1}; the last real position and padding get 0.
    assert out["input_ids_shifted"].tolist() == [[11, 12, 13, 14, 0], [21, 22, 0, 0, 0]]
    assert out["loss_mask"].tolist() == [[0, 1, 1, 1, 0], [1, 1, 0, 0, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert out["input_ids"].tolist() == [[10, 11, 12, 13, 14], [20, 21, 22, 0, 0]]
    assert out["lengths"].tolist() == [5, 3]
    # Post-norm targets h̄_{t+1}: row t holds norm(x_{t+1}), zero at the last position.
    w = torch.ones(h)
    tgt = F.shifted_postnorm_targets(out["x"], out["lengths"], w, 1e-6)
    torch.testing.assert_close(tgt[0, :4], F.rms_norm(a["hidden"][1:], w, 1e-6))
    assert not tgt[0, 4].any() and not tgt[1, 2:].any()


def test_feature_dataset_requires_complete_cache(tmp_path: Path) -> None:
    with pytest.raises(F.FeatureCacheError, match="manifest"):
        F.FeatureDataset(tmp_path)
    (tmp_path / F.MANIFEST).write_text(json.dumps({"complete": False, "format_version": 1}))
    with pytest.raises(F.FeatureCacheError, match="incomplete"):
        F.FeatureDataset(tmp_path)


def test_load_target_head_default_model(default_model_dir: Path) -> None:
    norm_w, eps, lm_head, embed = F.load_target_head(default_model_dir)
    assert norm_w.shape == (576,) and lm_head.shape == embed.shape == (49152, 576)
    assert lm_head is embed and 0 < eps < 1e-4
