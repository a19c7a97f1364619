"""The drafter's vocab-parallel E and LM head (vllm_clover/engine/vocab_parallel.py) equal the whole
table's, on two gloo processes with vLLM's own shard layout (padding included), and the adaptive
tree's shape survives the ints it travels between ranks as."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vllm_clover.engine.vocab_parallel import TargetVocab

V, H, N = 100, 16, 12  # 100 real rows padded to 128: rank 1 holds 36 real rows and 28 of padding


class GlooGroup:
    """The two collectives TargetVocab calls, over torch.distributed's default (gloo) group,
    with the signatures of vLLM's GroupCoordinator."""

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t)
        return torch.cat(parts, dim=dim)


def _rank(rank: int, port: int, errors) -> None:
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding, pad_vocab_size

    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2)
        torch.set_num_threads(1)
        g = torch.Generator().manual_seed(0)
        full = torch.randn(V, H, generator=g)
        padded = pad_vocab_size(V)
        idx = VocabParallelEmbedding._get_indices(padded, padded, V, V, rank, 2)
        shard = torch.zeros(padded // 2, H)
        shard[: idx.num_org_elements] = full[idx.org_vocab_start_index: idx.org_vocab_end_index]
        vocab = TargetVocab(weight=shard, start=idx.org_vocab_start_index, real=idx.num_org_elements,
                            vocab_size=V, group=GlooGroup())
        ids = torch.tensor([[0, 63, 64, 99], [5, 70, 98, 1]])
        h = torch.randn(3, H, generator=g)
        draft_ids = torch.tensor([99, 0, 64, 63, 10, 80, 31, 65, 2, 97, 50, 70])
        torch.testing.assert_close(vocab.embed(ids), full[ids])
        torch.testing.assert_close(vocab.logits(h), h @ full.T)
        partial = h @ vocab.draft_rows(draft_ids).T
        torch.testing.assert_close(vocab.reduce_draft_logits(partial), h @ full[draft_ids].T)
    except BaseException as exc:  # reported to the parent, which fails the test
        errors.put(f"rank {rank}: {exc!r}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
def test_two_shards_give_the_whole_tables_products() -> None:
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, errors)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    found = [errors.get() for _ in range(errors.qsize())] if not errors.empty() else []
    assert not found, found
    assert [p.exitcode for p in procs] == [0, 0]


def test_one_rank_uses_the_whole_table() -> None:
    full = torch.randn(V + 28, H)  # ParallelLMHead's padding rows after the real ones
    vocab = TargetVocab(weight=full, start=0, real=V, vocab_size=V)
    assert not vocab.sharded and vocab.full_weight.shape == (V, H)
    ids = torch.tensor([3, 99])
    torch.testing.assert_close(vocab.embed(ids), full[ids])
    h = torch.randn(2, H)
    torch.testing.assert_close(vocab.logits(h), h @ full[:V].T)
    torch.testing.assert_close(vocab.reduce_draft_logits(h @ vocab.draft_rows(ids).T), h @ full[ids].T)


def test_adaptive_shapes_survive_the_broadcast_encoding() -> None:
    from vllm_clover.engine.adaptive import OFF, Shape, decode_shape, encode_shape, tree_of

    paths = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    for shape in (Shape(tree=tree_of(paths), lookup=2, on=True), Shape(tree=None, lookup=3, on=True), OFF):
        values = encode_shape(shape, max_nodes=16)
        assert len(values) == 3 + 2 * 16
        back = decode_shape(values)
        assert (back.on, back.lookup) == (shape.on, shape.lookup if shape.on else 0)
        assert (back.tree.paths if back.tree is not None else None) == (
            shape.tree.paths if shape.on and shape.tree is not None else None)
    with pytest.raises(ValueError):
        encode_shape(Shape(tree=tree_of(paths), lookup=0, on=True), max_nodes=4)
