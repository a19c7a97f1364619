"""The n-gram datastore of retrieval drafts (vllm_clover/drafting/datastore.py): counting, back-off,
the file format and its errors, and the shipped datastore against the default tokenizer."""

from __future__ import annotations

import collections
import zipfile
from pathlib import Path

import numpy as np
import pytest

from vllm_clover.drafting.datastore import (DatastoreError, build_datastore, key_bits, load_datastore,
                                   save_datastore)

SHIPPED = Path(__file__).resolve().parents[3] / "vllm_clover/heads/smollm2-135m-instruct-clover2/datastore.npz"


def _reference_followers(sequences: list[list[int]], n: int, min_count: int) -> dict[tuple, tuple[int, int]]:
    """Brute force: context tuple -> (most frequent next token (ties: smaller id), its share
    of the context's occurrences x 255, rounded down)."""
    counts: dict[tuple, collections.Counter] = collections.defaultdict(collections.Counter)
    for s in sequences:
        for i in range(n, len(s)):
            counts[tuple(s[i - n:i])][s[i]] += 1
    out = {}
    for ctx, c in counts.items():
        best = min(c, key=lambda t: (-c[t], t))
        if c[best] >= min_count:
            out[ctx] = best, 255 * c[best] // sum(c.values())
    return out


def test_table_equals_brute_force_counting() -> None:
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 6, size=int(rng.integers(1, 40))).tolist() for _ in range(60)]
    store = build_datastore(seqs, vocab_size=6, max_order=3, min_count=2)
    for n in (1, 2, 3):
        ref = _reference_followers(seqs, n, 2)
        assert store.keys[n - 1].size == len(ref) > 0
        for ctx, (nxt, share) in ref.items():  # an n-token context is looked up at order n
            assert store.continuation(np.array(ctx), 1).tolist() == [nxt]
            assert store.continuation(np.array(ctx), 1, min_confidence=(share + 1) / 255).tolist() == []
        # Every key decodes to a context of the reference, with its follower.
        mask = (1 << store.bits) - 1
        for key, nxt, share in zip(store.keys[n - 1].tolist(), store.next_tokens[n - 1].tolist(),
                                   store.confidence[n - 1].tolist()):
            ctx = tuple((key >> (store.bits * (n - 1 - j))) & mask for j in range(n))
            assert ref[ctx] == (nxt, share)


def test_continuation_backs_off_and_never_crosses_sequences() -> None:
    # "1 2 3" is followed by 4 twice; "2 3" alone by 9 three times (in other contexts); the
    # separator between sequences is never part of an n-gram.
    seqs = [[1, 2, 3, 4], [1, 2, 3, 4], [7, 2, 3, 9], [8, 2, 3, 9], [5, 2, 3, 9], [3, 5]]
    store = build_datastore(seqs, vocab_size=10, max_order=3, min_count=2)
    assert store.continuation(np.array([0, 1, 2, 3]), 1).tolist() == [4]  # longest context wins
    assert store.continuation(np.array([6, 6, 2, 3]), 1).tolist() == [9]  # backs off to "2 3"
    assert store.continuation(np.array([4]), 3).tolist() == []  # 4 ends its sequences: nothing follows
    # Greedy chain: 1 2 -> 3, then 1 2 3 -> 4, then nothing follows 4.
    assert store.continuation(np.array([1, 2]), 5).tolist() == [3, 4]
    assert store.continuation(np.array([1, 2]), 0).tolist() == []
    # "2 3" was followed by 9 in 3 of its 5 occurrences: confidence 0.6.
    assert store.continuation(np.array([6, 2, 3]), 1, min_confidence=0.6).tolist() == [9]
    assert store.continuation(np.array([6, 2, 3]), 1, min_confidence=0.61).tolist() == []
    # The chain stops at the first uncertain token: 1 2 -> 3 (certain), 1 2 3 -> 4 (certain).
    assert store.continuation(np.array([1, 2]), 5, min_confidence=1.0).tolist() == [3, 4]
    # Ids outside the vocabulary (special tokens) are skipped by back-off, not an error.
    assert store.continuation(np.array([2, 3, 10 ** 6]), 2).tolist() == []


def test_save_load_round_trip_and_errors(tmp_path: Path) -> None:
    store = build_datastore([[1, 2, 3, 1, 2, 3, 1, 2, 4]], vocab_size=8, max_order=2, min_count=1, source="toy")
    path = tmp_path / "ds.store"  # any file name, no ".npz" appended
    save_datastore(store, path)
    back = load_datastore(path, vocab_size=8)
    assert back.source == "toy" and back.bits == store.bits and back.max_order == 2
    for a, b in zip(store.keys + store.next_tokens + store.confidence, back.keys + back.next_tokens + back.confidence):
        assert np.array_equal(a, b)
    with pytest.raises(DatastoreError, match="8-token vocabulary, the target has 49152"):
        load_datastore(path, vocab_size=49152)
    with pytest.raises(DatastoreError, match="does not exist"):
        load_datastore(tmp_path / "missing.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip file")
    with pytest.raises(DatastoreError, match="unreadable or corrupt"):
        load_datastore(tmp_path / "junk.npz")
    with zipfile.ZipFile(path) as z:  # the same file without its second order's tokens
        kept = {n: z.read(n) for n in z.namelist() if n != "next2.npy"}
    with zipfile.ZipFile(tmp_path / "cut.npz", "w") as z:
        for name, blob in kept.items():
            z.writestr(name, blob)
    with pytest.raises(DatastoreError, match="corrupt"):
        load_datastore(tmp_path / "cut.npz")
    np.savez(tmp_path / "other.npz", meta=np.frombuffer(b'{"format": "x"}', dtype=np.uint8))
    with pytest.raises(DatastoreError, match="not a vllm-clover-ngram-datastore"):
        load_datastore(tmp_path / "other.npz")


def test_key_bits_refuse_keys_over_64_bits() -> None:
    assert key_bits(49152, 4) == 16
    assert key_bits(128256, 3) == 17
    with pytest.raises(DatastoreError, match="max_order <= 3"):
        key_bits(128256, 4)
    with pytest.raises(DatastoreError, match="outside the 5-token vocabulary"):
        build_datastore([[1, 7]], vocab_size=5)


def test_shipped_datastore_drafts_common_phrases(default_model_dir) -> None:
    """The shipped table (ShareGPT answers, SmolLM2's tokenizer) continues a stock phrase
    the way the corpus does."""
    from transformers import AutoTokenizer

    store = load_datastore(SHIPPED, vocab_size=49152)
    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    ids = tok("I hope this helps! Let me know if you have any", add_special_tokens=False)["input_ids"]
    draft = tok.decode(store.continuation(np.array(ids), 3).tolist())
    assert draft.strip().startswith("other questions"), draft
    assert store.max_order == 4 and store.num_entries > 100_000
    assert "sharegpt_v3:train" in store.source
