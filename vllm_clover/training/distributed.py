"""Data-parallel training over several processes (``torchrun``), one rank per device.

``torchrun --nproc_per_node N -m vllm_clover.cli train --data CORPUS_DIR ...`` starts N
copies of the same run. Each finds its place from the variables torchrun sets (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) in :meth:`DataParallel.start`,
which joins the process group (nccl on CUDA, each rank on ``cuda:LOCAL_RANK``; gloo on the CPU).

What holds, and why:

* **The same global batch and steps as one process.** Every rank builds the same seeded
  :class:`~vllm_clover.training.batches.BatchPlan`; step s's batch is split into disjoint
  shares (:meth:`DataParallel.share`, every N-th sequence of the length-sorted batch, so the
  shares' token counts are close) and each rank computes the target features of its own share
  only (streamed, nothing cached). The learning-rate schedule counts global steps.
* **Gradients are those of one process.** The Clover-2 loss divides each head's sums by that
  head's trained-row count over the whole batch (+1, as the official code). Each rank divides
  its share's sums by the global counts (:meth:`DataParallel.sum` of the per-rank counts
  before the loss), so the ranks' losses add up to the one-process loss and their gradients
  are **summed** (:meth:`DataParallel.sum_gradients`), not averaged.
* **Why not DistributedDataParallel:** DDP reduces gradients only when its own ``forward`` is
  called, while the trainer calls ``forward_train`` and back-propagates the chunked
  cross-entropy in pieces (:func:`~vllm_clover.training.loss.clover_loss_backward`); DDP
  averages where this loss needs a sum over global denominators; and it would re-broadcast
  the frozen target LM head the drafter holds as a buffer at every step. One all-reduce per
  trainable tensor after the backward does the exact job.
* **Identical replicas.** Every rank seeds the same way and builds the same model; rank 0's
  state is broadcast once (:meth:`DataParallel.broadcast_module`), and since all ranks then
  apply the same summed gradients with the same optimizer, their weights stay equal.
* **One writer.** Rank 0 alone writes checkpoints, history and the result; each rank's RNG
  state is gathered into rank 0's checkpoint (:meth:`DataParallel.gather`) and restored on
  that rank on ``--resume``.
* **Stopping together.** SIGTERM / SIGINT only set a flag here (:meth:`DataParallel.signalled`);
  before every step the ranks all-reduce their stop reasons (signal, ``--stop-at`` deadline,
  pause file: :meth:`DataParallel.any_rank`), so all stop, pause or go on at the same step
  and none is left waiting in a collective.

With ``WORLD_SIZE`` unset or 1 the same object stands for one process: every collective is
the identity, so the trainer has a single code path.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch

from vllm_clover.training.args import TrainingError, resolve_device

Tensor = torch.Tensor

# The variables torchrun (and torch.multiprocessing launchers following its convention) set.
RANK_ENV, WORLD_ENV, LOCAL_RANK_ENV = "RANK", "WORLD_SIZE", "LOCAL_RANK"


def world_size_from_env() -> int:
    """``$WORLD_SIZE`` as an int (1 when unset); :class:`TrainingError` if it is not one."""
    value = os.environ.get(WORLD_ENV, "1")
    try:
        world = int(value)
    except ValueError:
        raise TrainingError(f"${WORLD_ENV} must be a positive integer, got {value!r}") from None
    if world < 1:
        raise TrainingError(f"${WORLD_ENV} must be a positive integer, got {value!r}")
    return world


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None or not value.isdigit():
        raise TrainingError(f"${WORLD_ENV} is {os.environ[WORLD_ENV]} but ${name} is {value!r}: "
                            "start the processes with torchrun")
    return int(value)


@dataclass
class DataParallel:
    """This process's place in a data-parallel run (or a single process: ``world_size`` 1)."""

    device: torch.device
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None  # "nccl" / "gloo"; None for a single process
    owns_group: bool = False  # this object initialised the process group and destroys it
    _signalled: bool = False
    _saved_handlers: dict[int, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ set-up
    @classmethod
    def start(cls, device_arg: str) -> "DataParallel":
        """Join the process group torchrun's variables describe (or stand for one process).

        ``--device cpu`` -> gloo; ``--device cuda`` -> nccl with this rank on
        ``cuda:$LOCAL_RANK`` (a fixed index such as ``cuda:1`` is refused under several
        processes: every rank would use the same GPU).
        """
        import torch.distributed as dist

        world = world_size_from_env()
        if world == 1:
            return cls(device=resolve_device(device_arg))
        rank, local_rank = _env_int(RANK_ENV), _env_int(LOCAL_RANK_ENV)
        device = _rank_device(device_arg, local_rank)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dp = cls(device=device, rank=rank, world_size=world, local_rank=local_rank, backend=backend)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if dist.is_initialized():
            if dist.get_world_size() != world or dist.get_rank() != rank:
                raise TrainingError(f"a process group of {dist.get_world_size()} ranks is already "
                                    f"initialised here, ${WORLD_ENV} says {world}")
        else:
            try:
                dist.init_process_group(backend, rank=rank, world_size=world)
            except (ValueError, RuntimeError) as exc:  # missing MASTER_ADDR / PORT, unreachable
                raise TrainingError(f"joining the {backend} process group failed: "
                                    f"{str(exc).splitlines()[0]}") from None
            dp.owns_group = True
        dp._install_stop_handlers()
        return dp

    def close(self) -> None:
        """Restore the signal handlers and leave the process group (if this object joined it)."""
        for signum, handler in self._saved_handlers.items():
            signal.signal(signum, handler)
        self._saved_handlers.clear()
        if self.owns_group:
            import torch.distributed as dist

            dist.destroy_process_group()
            self.owns_group = False

    def _install_stop_handlers(self) -> None:
        """SIGTERM / SIGINT set a flag that the ranks agree on before the next step, instead
        of raising wherever they land (possibly inside a collective other ranks then wait in)."""
        def request_stop(signum, frame) -> None:
            self._signalled = True

        for signum in (signal.SIGTERM, signal.SIGINT):
            self._saved_handlers[signum] = signal.signal(signum, request_stop)

    # ------------------------------------------------------------------ queries
    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes files."""
        return self.rank == 0

    @property
    def signalled(self) -> bool:
        """A SIGTERM / SIGINT arrived here since :meth:`start` (always False for one process,
        whose signals raise KeyboardInterrupt as before)."""
        return self._signalled

    # ------------------------------------------------------------------ data
    def share(self, indices: Sequence[int]) -> list[int]:
        """This rank's disjoint share of one global batch: every ``world_size``-th sequence
        from position ``rank``; the shares together are the batch."""
        return list(indices[self.rank::self.world_size])

    def check_batches(self, batches: Iterable[Sequence[int]]) -> None:
        """Refuse a run whose batches have fewer sequences than ranks (a rank would get none)."""
        if not self.enabled:
            return
        smallest = min(len(b) for b in batches)
        if smallest < self.world_size:
            raise TrainingError(f"{self.world_size} processes but a batch of this run holds only {smallest} "
                                f"sequence(s): raise --batch-tokens or start fewer processes")

    # ------------------------------------------------------------------ collectives
    def sum(self, values: Tensor) -> Tensor:
        """The sum of ``values`` over the ranks (a new tensor on the caller's device)."""
        if not self.enabled:
            return values.clone()
        import torch.distributed as dist

        out = values.detach().to(self.device, copy=True)
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out.to(values.device)

    def any_rank(self, flags: Sequence[bool]) -> list[bool]:
        """Each flag OR-ed over the ranks (the stop / pause agreement before a step)."""
        if not self.enabled:
            return list(flags)
        import torch.distributed as dist

        t = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [bool(v) for v in t.tolist()]

    def union(self, ids: Tensor) -> Tensor:
        """Sorted unique union over the ranks of long ids [n] (a per-batch token subset)."""
        if not self.enabled:
            return ids
        import torch.distributed as dist

        n = torch.tensor([len(ids)], dtype=torch.int64, device=self.device)
        sizes = [torch.zeros_like(n) for _ in range(self.world_size)]
        dist.all_gather(sizes, n)
        width = int(max(int(s) for s in sizes))
        padded = torch.full((width,), -1, dtype=torch.int64, device=self.device)
        padded[:len(ids)] = ids.to(self.device)
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded)
        merged = torch.cat(parts)
        return torch.unique(merged[merged >= 0]).to(ids.device)

    def sum_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Replace each trainable tensor's gradient by its sum over the ranks. A tensor no rank
        has a gradient for keeps ``grad = None`` (AdamW then skips it, as in one process); one
        only some ranks have a gradient for counts as zero on the others."""
        if not self.enabled:
            return
        import torch.distributed as dist

        params = [p for p in params if p.requires_grad]
        has = self.sum(torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=self.device))
        pending = []
        for p, count in zip(params, has.tolist()):
            if count == 0:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            pending.append(dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, async_op=True))
        for work in pending:
            work.wait()

    def broadcast_module(self, module: torch.nn.Module) -> None:
        """Copy rank 0's parameters and persistent buffers into every rank's ``module``."""
        if not self.enabled:
            return
        import torch.distributed as dist

        for t in module.state_dict().values():
            dist.broadcast(t, src=0)

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` (picklable), in rank order, on rank 0; None on the others."""
        if not self.enabled:
            return [obj]
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.world_size if self.is_main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def barrier(self) -> None:
        if self.enabled:
            import torch.distributed as dist

            dist.barrier()


def _rank_device(device_arg: str, local_rank: int) -> torch.device:
    """The device of the rank with ``local_rank`` for ``--device``."""
    device = resolve_device(device_arg)  # a cpu or cuda device that exists here, or one line why not
    if device.type == "cpu":
        return device
    if torch.device(device_arg).index is not None:
        raise TrainingError(f"--device {device_arg} under several processes: pass --device cuda, "
                            f"each rank then uses cuda:$LOCAL_RANK")
    return resolve_device(f"cuda:{local_rank}")


def check_supported(method: str, data_is_corpus: bool, world_size: int) -> None:
    """Refuse, with one line, what data-parallel training does not cover."""
    if world_size <= 1:
        return
    if method == "eagle3":
        raise TrainingError(f"--method eagle3 runs in one process only (WORLD_SIZE={world_size}); "
                            "start it without torchrun")
    if not data_is_corpus:
        raise TrainingError(f"data-parallel training (WORLD_SIZE={world_size}) needs a corpus directory as --data "
                            "(`vllm-clover corpus`: features computed per batch, per rank); "
                            "feature-cache runs use one process")
