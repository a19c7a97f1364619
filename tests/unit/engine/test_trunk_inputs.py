"""The trunk's inputs computed on the device (proposer.device_trunk_inputs) equal their
definition read from the committed tokens (proposer.trunk_inputs), for random steps that mix
decodes with accepted and rejected drafts, full prefills after a prefix-cache hit, partial
prefill chunks, and trunk views of accepted tree paths."""

from __future__ import annotations

import pytest
import torch

# The GPU check (vllm_clover/benchmarks/gpu_check.sh) also runs on machines without vLLM: there
# only the kernel tests run.
pytest.importorskip("vllm", reason="needs vLLM (the GPU check's kernel-only machines have none)")

from vllm_clover.engine.proposer import device_trunk_inputs, trunk_inputs

pytestmark = pytest.mark.gpu_path
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def random_step(g: torch.Generator, b: int, width: int = 64):
    """One engine step after the runner's bookkeeping: (token_ids [B, L] committed tokens,
    num_tokens [B], first_positions [B], positions [N], query_start_loc [B+1], input_ids [N])."""
    token_ids = torch.zeros(b, width, dtype=torch.int32)
    num_tokens, first, positions, input_ids, counts = [], [], [], [], []

    def rand(n: int) -> torch.Tensor:
        return torch.randint(1, 1000, (n,), generator=g, dtype=torch.int32)

    for i in range(b):
        kind = int(torch.randint(0, 3, (1,), generator=g))
        if kind == 0:  # decode: last token at c scheduled with d drafts, a accepted, + bonus
            c = int(torch.randint(1, width - 8, (1,), generator=g))
            d = int(torch.randint(0, 5, (1,), generator=g))
            a = int(torch.randint(0, d + 1, (1,), generator=g))
            committed = rand(c + a + 2)
            rows = committed[c:c + 1 + a].tolist()
            rows += [t + 1000 for t in rand(d - a).tolist()]  # rejected drafts: never committed
            token_ids[i, :c + a + 2] = committed
            num_tokens.append(c + a + 2)
            start, count = c, d + 1
        else:  # prefill of a prompt of p tokens from a prefix-cache hit at p0
            p = int(torch.randint(2, width - 1, (1,), generator=g))
            p0 = int(torch.randint(0, p, (1,), generator=g))
            prompt = rand(p + 1)  # + the token sampled after a full prefill
            end = p if kind == 1 else int(torch.randint(p0 + 1, p + 1, (1,), generator=g))
            token_ids[i, :p + 1] = prompt
            num_tokens.append(p + 1 if end == p else p)  # a partial chunk's sample is discarded
            rows = prompt[p0:end].tolist()
            start, count = p0, end - p0
        first.append(start)
        positions += list(range(start, start + count))
        input_ids += rows
        counts.append(count)
    qsl = torch.zeros(b + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(counts), 0)
    return (token_ids, torch.tensor(num_tokens, dtype=torch.int32), torch.tensor(first, dtype=torch.int32),
            torch.tensor(positions), qsl, torch.tensor(input_ids, dtype=torch.int32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(20))
def test_device_trunk_inputs_equal_the_definition(seed, device) -> None:
    g = torch.Generator().manual_seed(seed)
    token_ids, num_tokens, first, positions, qsl, input_ids = random_step(g, b=1 + seed % 7)
    y, last, first_tok = trunk_inputs(token_ids, num_tokens, positions, qsl)
    got = device_trunk_inputs(token_ids, num_tokens, first, qsl, input_ids.to(device), positions.to(device))
    assert got.y.device.type == device and got.last.device.type == device
    assert torch.equal(got.y.cpu(), y)
    assert torch.equal(got.last.cpu(), last)
    assert torch.equal(got.first.cpu(), first_tok)
    assert torch.equal(got.last_positions, positions[last])


def test_hand_built_step() -> None:
    """The case of tests/unit/engine/test_frontend.py::test_trunk_inputs_eagle_shift: a decode
    with 2 drafts (1 accepted), a full prefill after 2 cached tokens, a partial prefill."""
    tokens = torch.zeros(3, 16, dtype=torch.int32)
    tokens[0, :7] = torch.tensor([10, 11, 12, 13, 14, 15, 16])
    tokens[1, :6] = torch.tensor([20, 21, 22, 23, 24, 25])
    tokens[2, :8] = torch.tensor([30, 31, 32, 33, 34, 35, 36, 37])
    positions = torch.tensor([4, 5, 6, 2, 3, 4, 0, 1, 2])
    input_ids = torch.tensor([14, 15, 99, 22, 23, 24, 30, 31, 32], dtype=torch.int32)  # 99: rejected
    got = device_trunk_inputs(tokens, torch.tensor([7, 6, 8]), torch.tensor([4, 2, 0]),
                              torch.tensor([0, 3, 6, 9]), input_ids, positions)
    assert got.y.tolist() == [15, 16, 0, 23, 24, 25, 31, 32, 33]
    assert got.last.tolist() == [1, 5, 8] and got.first.tolist() == [16, 25, 37]
    assert got.last_positions.tolist() == [5, 4, 2]


def test_trunk_view_of_accepted_tree_paths() -> None:
    """After a tree step the trunk sees each tree request's accepted path as a chain from the
    root (proposer._propose gathers positions and input ids by tree_verify.trunk_view's rows)."""
    from vllm_clover.drafting.tree import get_tree
    from vllm_clover.engine.tree_verify import TreeRequest, TreeStep, trunk_view, tree_buffers

    tree = get_tree("small_4")
    parent = tuple(tree.parent.tolist())
    n1 = len(parent)
    root = 5
    committed = torch.arange(100, 100 + root + 1, dtype=torch.int32)  # prompt, root token at 5
    path = [0, 1, 3]  # root, node 1, node 3 (child of 1): 2 drafts accepted
    buffers = tree_buffers(parent)
    assert [int(buffers.depth[0, m]) for m in path] == [0, 1, 2]
    node_tokens = torch.arange(500, 500 + n1, dtype=torch.int32)
    node_tokens[0] = committed[root]
    accepted = node_tokens[path[1:]]
    token_ids = torch.zeros(1, 32, dtype=torch.int32)
    token_ids[0, :root + 1] = committed
    token_ids[0, root + 1:root + 3] = accepted
    token_ids[0, root + 3] = 777  # bonus
    num_tokens = torch.tensor([root + 4])
    positions = root + buffers.depth[0]  # tree positions (root + depth)
    request = TreeRequest(index=0, start=0, root=root, buffers=buffers, slots=torch.arange(n1) + 40)
    request.path = path
    rows, qsl, slots = trunk_view(TreeStep(num_tokens=n1, requests=[request]), torch.tensor([0, n1]).numpy(),
                                  1, torch.arange(n1) + 40)
    y, last, first = trunk_inputs(token_ids, num_tokens, positions[rows], qsl)
    got = device_trunk_inputs(token_ids, num_tokens, torch.tensor([root]), qsl, node_tokens[rows], positions[rows])
    assert y.tolist() == [int(accepted[0]), int(accepted[1]), 777]
    assert torch.equal(got.y, y) and torch.equal(got.last, last) and torch.equal(got.first, first)
