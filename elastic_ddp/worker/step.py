"""What a training script holds inside the loop: :class:`Step`, one optimizer step's micro-batches on
this rank, and :class:`DataState`, the data position the run saves in every checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import nullcontext
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from elastic_ddp.data import ORDER_VERSION, DataCursor, MicroBatch, StepBatch, to_device
from elastic_ddp.worker.lifecycle import RunError

__all__ = ["DataState", "Step"]


class DataState:
    """The data position, saved in every checkpoint: the cursor, and what it is a position *in*.

    The cursor counts positions in a permutation of the dataset's samples; resuming it over another
    dataset (another size, other contents when a fingerprint is given) or another order algorithm
    would silently repeat and skip samples, so :meth:`bind` refuses that -- or, told to
    (``data.on_change=next_epoch``), moves the position to the next epoch's start.
    """

    def __init__(self) -> None:
        self.cursor = DataCursor()
        self.num_samples = 0
        self.fingerprint = ""
        self.order = ORDER_VERSION
        self._saved: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {
            **self.cursor.state_dict(), "num_samples": self.num_samples, "fingerprint": self.fingerprint,
            "order": self.order,
        }  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.cursor = DataCursor.from_state_dict(state)
        self._saved = dict(state)

    def bind(
        self, num_samples: int, fingerprint: str, where: str, order: str = ORDER_VERSION, on_change: str = "refuse"
    ) -> str | None:
        """Attach the position to a dataset of ``num_samples`` (and ``fingerprint``) in the order named
        ``order``. ``where`` names the checkpoint for the messages.

        A resumed position that belongs to another dataset or order raises RunError, unless
        ``on_change`` (``data.on_change``) is ``"next_epoch"``: the position then moves to the start of
        the next epoch of this dataset, ``DataCursor(epoch + 1, 0)`` -- ``DataCursor(epoch, 0)`` as
        saved where the checkpoint ended an epoch, since nothing of that one was consumed -- and the
        warning to log once (what changed, and the saved epoch's samples left untrained) is returned.
        Otherwise returns None.
        """
        note = None
        saved = self._saved
        if saved is not None:
            problems = []
            if saved.get("order") != order:
                problems.append(f"its data order is {saved.get('order')!r}, this version uses {order!r}")
            if saved.get("num_samples") != num_samples:
                problems.append(f"it was written for a dataset of {saved.get('num_samples')} samples, this one has {num_samples}")
            if saved.get("fingerprint", "") != fingerprint:
                problems.append(f"its dataset fingerprint is {saved.get('fingerprint')!r}, this one's is {fingerprint!r}")
            if problems and on_change != "next_epoch":
                raise RunError(
                    f"Checkpoint {where} cannot continue over this dataset: {'; '.join(problems)}. Its data "
                    "position would then name other samples, repeating some and skipping others. Use the same "
                    "data, start a new run (another run.name or checkpoint.url), or pass "
                    "--data.on_change=next_epoch to continue at the start of the next epoch of this data."
                )
            if problems:
                epoch, consumed = self.cursor.epoch, self.cursor.consumed
                if consumed:
                    untrained = saved["num_samples"] - consumed
                    skipped = f"the rest of epoch {epoch} -- {untrained} samples not yet consumed -- is not trained"
                    epoch += 1
                else:
                    skipped = "the checkpoint had not begun that epoch, so no sample is left untrained"
                self.cursor = DataCursor(epoch, 0)
                note = (
                    f"Checkpoint {where} does not match this dataset: {'; '.join(problems)}. With "
                    f"data.on_change=next_epoch the run continues at the start of epoch {epoch} of this data; "
                    f"{skipped}."
                )
        self.num_samples = num_samples
        self.fingerprint = fingerprint
        self.order = order
        return note


class Step:
    """One optimizer step of this rank. Iterate it for the micro-batches; call :meth:`backward` on each.

    ``for batch in step:`` yields this rank's micro-batches (the ``collate_fn`` output, tensors moved
    to the run's device); DDP synchronises gradients only on the last one (gradient accumulation).
    The script's loss must be the *mean* over the micro-batch's samples (what every torch loss
    returns by default); :meth:`backward` weights it so that the gradient is the global-batch mean
    however the batch was split over ranks and micro-batches.
    """

    def __init__(self, batch: StepBatch, ddp_model: DistributedDataParallel, device: torch.device) -> None:
        self.number = batch.step
        self._batch = batch
        self._ddp = ddp_model
        self._device = device
        self._micro: MicroBatch | None = None
        self._position = -1
        self._backwards = 0
        self._losses: list[tuple[torch.Tensor, int]] = []  # (mean loss, samples) of each real micro-batch
        self.scalars: dict[str, Any] = {}

    @property
    def indices(self) -> list[int]:
        """The dataset indices of this rank's samples in this step."""
        return list(self._batch.rank_indices)

    @property
    def micro(self) -> MicroBatch:
        """The micro-batch being trained (its ``indices``, ``weight``, ``sample_seeds``)."""
        if self._micro is None:
            raise RunError("step.micro is only available inside `for batch in step:`.")
        return self._micro

    def __iter__(self) -> Iterator[Any]:
        micros = self._batch.micro_batches
        for position, micro in enumerate(micros):
            self._micro, self._position = micro, position
            last = position == len(micros) - 1
            with nullcontext() if last else self._ddp.no_sync():
                yield to_device(micro.data, self._device)
            if self._backwards != position + 1:
                raise RunError(
                    f"Step {self.number}: micro-batch {position + 1} of {len(micros)} ended without "
                    "step.backward(loss); every micro-batch needs exactly one (DDP's gradient all-reduce "
                    "counts on it)."
                )
        self._micro = None

    def backward(self, loss: torch.Tensor, scaler: Any = None) -> None:
        """Backpropagate the micro-batch's mean ``loss``, weighted for uneven splits; with a
        ``torch.amp.GradScaler``, scaled by it (then call ``scaler.step(optimizer)`` as usual)."""
        micro = self.micro
        if self._backwards != self._position:
            raise RunError(f"Step {self.number}: step.backward() was called twice for one micro-batch.")
        if loss.dim() != 0:
            raise RunError(
                f"Step {self.number}: step.backward() needs the micro-batch's mean loss (a scalar), got shape "
                f"{tuple(loss.shape)}."
            )
        # A weight of 1 (an even split, one micro-batch) changes no bit of the loss or its gradient.
        weighted = loss if micro.weight == 1.0 else loss * micro.weight
        (weighted if scaler is None else scaler.scale(weighted)).backward()
        self._backwards += 1
        if not micro.dummy:
            # Kept on the device, summed (one host sync) only at the steps whose loss is recorded.
            self._losses.append((loss.detach(), micro.samples))

    def log(self, **scalars: float | torch.Tensor) -> None:
        """Extra scalars for this step, e.g. ``step.log(grad_norm=norm)`` (TensorBoard tag
        ``train/grad_norm``). Tensors stay on the device; they are read only at logged steps."""
        self.scalars.update({f"train/{name}": value for name, value in scalars.items()})

    def _check_complete(self) -> None:
        if self._micro is not None or self._backwards != len(self._batch.micro_batches):
            raise RunError(
                f"Step {self.number}: the step ended after {self._backwards} of "
                f"{len(self._batch.micro_batches)} micro-batches; iterate `for batch in step:` to the end "
                "and call step.backward(loss) for each."
            )

    def _loss_and_samples(self) -> torch.Tensor:
        """This rank's summed loss over its samples and their number, as float64, on the device."""
        out = torch.zeros(2, dtype=torch.float64, device=self._device)
        if self._losses:
            out[0] = sum(loss.float() * samples for loss, samples in self._losses).double()
        out[1] = float(sum(samples for _, samples in self._losses))
        return out
