"""Per-step batches for one rank from any map-style dataset, as a pure function of the starting cursor.

The training loop owns the cursor. :class:`StepBatches` only *reads* it: step ``k`` of the loader is
computed from ``(start cursor, k)`` alone, so worker processes and prefetching can run ahead freely,
and a batch that was prepared but never trained on is never counted. The cursor to checkpoint is
always ``cursor_after`` of the last step the loop completed.

A step's global batch is split over the ranks (:func:`~elastic_ddp.data.sampler.rank_bounds`) and each
rank's share into micro-batches; each micro-batch is ``collate_fn([dataset[i] for i in indices])``
(``torch.utils.data.default_collate`` by default: tuples, dicts and tensors of samples batch as usual),
the samples read in one ``dataset.__getitems__(indices)`` call where the dataset has one (:func:`read_samples`).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate
from torch.utils.data._utils.pin_memory import pin_memory as _pin

from elastic_ddp.data.sampler import DataCursor, ElasticSampler, micro_batches, rank_bounds
from elastic_ddp.data.seeds import derive_seed, sample_seeds

__all__ = [
    "MicroBatch", "StepBatch", "StepBatches", "check_dataset", "check_same_dataset", "dataset_fingerprint",
    "make_step_batch", "micro_weight", "read_samples",
]  # fmt: skip


def check_dataset(dataset: Any) -> int:
    """The number of samples of a map-style ``dataset``; ``TypeError`` saying why if it is not one."""
    if isinstance(dataset, IterableDataset):
        raise TypeError(
            f"{type(dataset).__name__} is an IterableDataset. Exactly-once data order needs a map-style "
            "dataset (__len__ and __getitem__): the job's position is a cursor into a permutation of sample "
            "indices, which is what lets a resumed job, at any world size, continue with exactly the samples "
            "the interrupted one had not consumed. A stream cannot be indexed or restarted at a position. "
            "Wrap the stream's records (files, shards, rows) in a map-style Dataset instead (a Hugging Face "
            "dataset: load it without streaming=True)."
        )
    if isinstance(dataset, Mapping):
        # A dict of splits (datasets.DatasetDict, what load_dataset returns without split=) has
        # __len__ and __getitem__ too, but its keys are split names, not sample indices.
        raise TypeError(
            f"{type(dataset).__name__} is a mapping (keys {sorted(map(str, dataset))[:5]}), not a map-style "
            "dataset whose sample i is dataset[i]. Pass one of its datasets, e.g. dataset['train']."
        )
    if not callable(getattr(dataset, "__getitem__", None)) or not callable(getattr(dataset, "__len__", None)):
        raise TypeError(
            f"{type(dataset).__name__} is not a map-style dataset: it needs __len__ and __getitem__ "
            "(sample i = dataset[i] for i in 0..len-1)."
        )
    size = len(dataset)
    if size <= 0:
        raise ValueError(f"The dataset ({type(dataset).__name__}) is empty.")
    return size


def dataset_fingerprint(dataset: Any, given: str = "") -> str:
    """What a checkpoint stores to recognise ``dataset``'s contents when a job resumes over it.

    ``given`` (``run.steps(dataset, fingerprint=...)``) when not empty. Otherwise the dataset's own
    ``_fingerprint`` where it has one: a Hugging Face ``datasets.Dataset`` carries a hash of its source
    data and of every transform applied since (``map``, ``filter``, ``select``, ``shuffle``,
    ``with_format``, ...), the same in every process that builds the dataset the same way. Otherwise
    ``""``: the resume then checks only the number of samples. A ``_fingerprint`` that is there but is
    not a non-empty string raises ``TypeError``: the dataset says it has a fingerprint and none could
    be read, and passing it as "no fingerprint" would let a resume continue over other contents.
    """
    if given:
        return given
    if not hasattr(dataset, "_fingerprint"):
        return ""
    own = dataset._fingerprint
    if not isinstance(own, str) or not own:
        raise TypeError(
            f"{type(dataset).__name__}._fingerprint is {own!r}, not a non-empty string, so the checkpoint "
            "could not recognise this dataset's contents on resume. Pass run.steps(dataset, "
            "fingerprint='...') with a string that names the contents (a version, a hash of the files)."
        )
    return own


def check_same_dataset(num_samples: int, fingerprint: str, group: Any = None) -> None:
    """Raise ``ValueError`` unless every rank of ``group`` has ``num_samples`` and ``fingerprint`` (collective).

    The data order is computed independently by each rank over its own copy of the dataset; copies
    that differ (another local file on one node, another preprocessing) would silently break the
    exactly-once promise. Nothing to do without a process group or with one rank.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    # One all-reduce of 16 bytes whatever the world size: the largest digest and the largest of
    # their negations, equal up to sign only when every rank has the same one. The ranks are
    # compared one by one only when they differ, to name them.
    mine = int.from_bytes(hashlib.blake2b(f"{num_samples}\0{fingerprint}".encode(), digest_size=8).digest(), "big") >> 1
    extremes = torch.tensor([mine, -mine], dtype=torch.int64)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    if int(extremes[0]) == -int(extremes[1]):
        return
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (num_samples, fingerprint), group=group)
    differing = [rank for rank, theirs in enumerate(everyone) if theirs != everyone[0]]
    if differing:
        shown = "; ".join(
            f"rank {rank}: {everyone[rank][0]} samples, fingerprint {everyone[rank][1]!r}" for rank in [0, *differing[:3]]
        )
        raise ValueError(
            f"The ranks were given different datasets ({shown}). Every rank must see the same samples in the "
            "same order of indices, or some samples are trained twice and others never. A Hugging Face dataset "
            "transformed with a function or argument that `datasets` could not hash gets a random fingerprint "
            "in each process (it logs \"couldn't be hashed properly, a random hash was used instead\"): make "
            "it picklable, or pass run.steps(dataset, fingerprint='...') naming the contents."
        )


def read_samples(dataset: Any, indices: list[int]) -> list[Any]:
    """``[dataset[i] for i in indices]``, read in one ``dataset.__getitems__(indices)`` call where there is one.

    ``__getitems__`` is the batched read ``torch.utils.data.DataLoader`` uses: a Hugging Face dataset
    then reads a micro-batch's rows from Arrow at once instead of one row at a time, and applies a
    ``set_transform``/``with_transform`` function to the micro-batch as a whole. It must return one
    sample per index, in order (``ValueError`` otherwise).
    """
    read_many = getattr(dataset, "__getitems__", None)
    if not callable(read_many):
        return [dataset[i] for i in indices]
    samples = read_many(list(indices))
    if len(samples) != len(indices):
        raise ValueError(
            f"{type(dataset).__name__}.__getitems__ returned {len(samples)} samples for {len(indices)} indices; "
            "it must return one sample per index, in order."
        )
    return list(samples)


def micro_weight(samples: int, world_size: int, global_batch_size: int) -> float:
    """What a micro-batch's *mean* loss is multiplied by before ``backward()``.

    DDP *averages* gradients over ranks. With each micro-batch's mean loss weighted by
    ``samples * world_size / global_batch_size``, the average over ranks of the summed micro-batch
    gradients is exactly the global-batch mean -- however unevenly the batch is split (10 samples on
    3 ranks: 4, 3, 3) and however many micro-batches a rank uses.
    """
    return samples * world_size / global_batch_size


@dataclass(frozen=True)
class MicroBatch:
    """One forward/backward of a rank.

    ``data`` is the collated batch of the samples ``indices`` (global dataset indices). ``weight``
    multiplies its mean loss (:func:`micro_weight`). A ``dummy`` micro-batch (a rank with no samples
    this step) has weight 0: it only keeps the rank in DDP's gradient all-reduce.
    """

    indices: list[int]
    data: Any
    weight: float
    step: int
    seed: int
    dummy: bool = False
    _seeds: list[int] = field(default_factory=list, repr=False, compare=False)

    @property
    def samples(self) -> int:
        """Samples that count (0 for a dummy)."""
        return 0 if self.dummy else len(self.indices)

    @property
    def sample_seeds(self) -> list[int]:
        """Per-sample random seeds for this step: ``derive_seed("dropout", seed, step, index)``.

        The same on whichever rank and in whichever micro-batch a sample lands, and again when a
        resumed job replays the step: what per-sample randomness (e.g.
        :class:`~elastic_ddp.worker.nn.SampleDropout`) needs to be independent of the world size.
        """
        if not self._seeds:
            self._seeds.extend(sample_seeds(self.seed, self.step, self.indices))
        return list(self._seeds)

    def pin_memory(self) -> MicroBatch:
        # DataLoader's pin-memory thread calls this (it does not know the dataclass otherwise).
        return replace(self, data=_pin(self.data))


@dataclass(frozen=True)
class StepBatch:
    """Everything one rank needs for optimizer step ``step`` (1-based: the step being computed).

    ``rank_indices``: this rank's contiguous share of the step's global batch; ``micro_batches``: at
    least one; ``cursor_after``: the data cursor to store in a checkpoint taken after this step.
    """

    step: int
    rank_indices: list[int]
    micro_batches: list[MicroBatch]
    cursor_after: DataCursor

    def pin_memory(self) -> StepBatch:
        return replace(self, micro_batches=[mb.pin_memory() for mb in self.micro_batches])


def make_step_batch(
    dataset: Any,
    sampler: ElasticSampler,
    cursor: DataCursor,
    step: int,
    rank: int,
    world_size: int,
    micro_batch_size: int = 0,
    collate_fn: Callable[[list[Any]], Any] = default_collate,
    rank_indices: list[int] | None = None,
) -> StepBatch:
    """The batch of step ``step`` for ``rank``, starting at ``cursor`` (a pure function).

    Only this rank's share of the global batch is computed and read from ``dataset``.
    ``rank_indices``: that share, when the caller computed it already (:meth:`ElasticSampler.shares`).
    """
    mine = rank_indices
    if mine is None:
        start, stop = rank_bounds(sampler.global_batch_size, rank, world_size)
        mine = sampler.slice_at(cursor, start, stop)
    batches = []
    for chunk in micro_batches(mine, micro_batch_size):
        data = collate_fn(read_samples(dataset, chunk))
        weight = micro_weight(len(chunk), world_size, sampler.global_batch_size)
        batches.append(MicroBatch(chunk, data, weight, step, sampler.seed))
    if not batches:
        # More ranks than samples: this rank still has to join DDP's all-reduce, or the others hang.
        # It forwards a real sample with weight 0, so its gradient contribution is exactly zero.
        chunk = sampler.slice_at(cursor, 0, 1)
        data = collate_fn(read_samples(dataset, chunk))
        batches.append(MicroBatch(chunk, data, 0.0, step, sampler.seed, dummy=True))
    return StepBatch(step, mine, batches, sampler.advance(cursor, 1))


# Steps whose shares StepBatches computes at once: the permutation's fixed cost per call spread over
# them, for the memory of 64 shares of indices (a few KB at any scale: a rank's share of a step).
SHARES_AHEAD = 64


class _StepDataset(Dataset):
    """Map-style view: item ``k`` is the batch of step ``start_step + 1 + k``; workers index it by k."""

    def __init__(self, batches: StepBatches) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return self.batches.num_steps

    def __getitem__(self, offset: int) -> StepBatch:
        return self.batches.batch(offset)


class StepBatches:
    """Iterate this rank's :class:`StepBatch` for steps ``start_step + 1 .. start_step + num_steps``.

    The step after ``start_step + k`` begins at ``sampler.advance(start, k)``. With ``num_workers > 0``
    the batches are built by a ``DataLoader`` over a map-style view indexed by ``k``, each worker
    preparing up to ``prefetch_batches`` ahead; the batches and their ``cursor_after`` are identical to
    ``num_workers == 0``. Tensors are pinned when ``pin_memory`` (default: CUDA is available). The
    loader's own random generator is seeded from the sampler's seed, so iterating never draws from
    the process's global generators (whose state a checkpoint restores).
    """

    def __init__(
        self,
        dataset: Any,
        sampler: ElasticSampler,
        start: DataCursor,
        *,
        rank: int,
        world_size: int,
        num_steps: int,
        start_step: int = 0,
        micro_batch_size: int = 0,
        num_workers: int = 0,
        prefetch_batches: int = 2,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool | None = None,
    ) -> None:
        if num_steps < 0:
            raise ValueError(f"num_steps ({num_steps}) must not be negative.")
        if num_workers < 0 or prefetch_batches < 1:
            raise ValueError(
                f"num_workers ({num_workers}) must be >= 0 and prefetch_batches ({prefetch_batches}) >= 1."
            )
        size = check_dataset(dataset)
        if size != sampler.num_samples:
            raise ValueError(f"The dataset has {size} samples but the sampler orders {sampler.num_samples}.")
        # Validate rank, world size, micro-batch size and the cursor up front, not in a worker.
        rank_bounds(sampler.global_batch_size, rank, world_size)
        micro_batches([], micro_batch_size)
        sampler.advance(start, 0)
        self.dataset = dataset
        self.sampler = sampler
        self.start = start
        self.rank = rank
        self.world_size = world_size
        self.num_steps = num_steps
        self.start_step = start_step
        self.micro_batch_size = micro_batch_size
        self.num_workers = num_workers
        self.prefetch_batches = prefetch_batches
        self.collate_fn = collate_fn or default_collate
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._ahead: tuple[int, list[list[int]]] | None = None  # (first offset, this rank's shares from it)

    def __len__(self) -> int:
        return self.num_steps

    def batch(self, offset: int) -> StepBatch:
        """The batch ``offset`` steps after the start (what the iterator yields at position offset)."""
        if not 0 <= offset < self.num_steps:
            raise IndexError(f"Step offset {offset} is outside 0..{self.num_steps - 1}.")
        return make_step_batch(
            self.dataset,
            self.sampler,
            self.sampler.advance(self.start, offset),
            self.start_step + offset + 1,
            self.rank,
            self.world_size,
            self.micro_batch_size,
            self.collate_fn,
            self._rank_indices(offset),
        )

    def _rank_indices(self, offset: int) -> list[int]:
        """This rank's share of the step ``offset`` steps after the start, computed with the shares of
        the steps around it (:data:`SHARES_AHEAD` at a time, see :meth:`ElasticSampler.shares`)."""
        first = offset - offset % SHARES_AHEAD
        if self._ahead is None or self._ahead[0] != first:
            start, stop = rank_bounds(self.sampler.global_batch_size, self.rank, self.world_size)
            count = min(SHARES_AHEAD, self.num_steps - first)
            self._ahead = (first, self.sampler.shares(self.sampler.advance(self.start, first), start, stop, count))
        return self._ahead[1][offset - first]

    def __iter__(self) -> Iterator[StepBatch]:
        if self.num_workers == 0:
            for offset in range(self.num_steps):
                batch = self.batch(offset)
                yield batch.pin_memory() if self.pin_memory else batch
            return
        loader = DataLoader(
            _StepDataset(self),
            batch_size=None,  # each item already is a whole step; no collation
            shuffle=False,  # the order is the step order; shuffling happened in the sampler
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch_batches,
            pin_memory=self.pin_memory,
            generator=torch.Generator().manual_seed(derive_seed("loader", self.sampler.seed, self.start_step)),
        )
        yield from loader


def to_device(data: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """``data`` with every tensor moved to ``device`` (tuples, lists, dicts and ``.to()`` objects)."""
    if isinstance(data, torch.Tensor):
        return data.to(device, non_blocking=non_blocking)
    if isinstance(data, dict):
        # A copy keeps the mapping's type and extra state (a defaultdict's factory, whose
        # constructor would take the items as its factory); then its values are replaced.
        moved = copy.copy(data)
        moved.update((k, to_device(v, device, non_blocking)) for k, v in data.items())
        return moved
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # a namedtuple
        return type(data)(*(to_device(v, device, non_blocking) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(to_device(v, device, non_blocking) for v in data)
    mover = getattr(data, "to", None)
    return mover(device) if callable(mover) else data
