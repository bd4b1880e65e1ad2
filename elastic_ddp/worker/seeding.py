"""Seeding every random generator of the worker: once before the model is built, and before each step.

Each step starts every generator from a seed derived from the run's seed, the rank and the step
(``Run._seed_step``), so what a step draws does not depend on the steps before it. That runs every
step, so its cost counts: :func:`torch.manual_seed` also queues a seed for every accelerator family
torch knows (CUDA, XPU, MPS, MTIA, a custom backend) and, for one not initialised, records the Python
stack that queued it -- about 80 us a step on a CPU worker, nearly all of it ``traceback.format_stack``
for devices the process does not have. :class:`StepSeeder` seeds the same generators the same way but
skips the families the process cannot use: a family that is not available now never will be in
this process, so no draw can tell the difference.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import torch

__all__ = ["StepSeeder", "seed_everything"]


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and every accelerator), Python's ``random`` and NumPy's global generator with ``seed``."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def _only_cpu_and_cuda() -> bool:
    """True when no generator family besides the CPU's and CUDA's can be used in this process."""
    others = (
        torch.xpu.is_available(),
        torch.backends.mps.is_available(),
        torch.mtia.is_available(),
        hasattr(torch, torch._C._get_privateuse1_backend_name()),  # a custom backend's module is registered
    )
    return not any(others)


class StepSeeder:
    """``seeder(seed)`` does what :func:`seed_everything` does, at a fraction of its cost.

    Built once per attempt (the families available do not change within a process). Where a family
    other than CPU and CUDA is available, it calls :func:`seed_everything` itself. CUDA is seeded
    through :func:`torch.cuda.manual_seed_all`, as :func:`torch.manual_seed` does: directly once CUDA
    is initialised (on a GPU worker it is, by the time the loop runs), queued for its initialisation
    before then.
    """

    def __init__(self) -> None:
        seeders: list[Callable[[int], object]] = []
        if torch.cuda.is_available():
            seeders.append(torch.cuda.manual_seed_all)
        seeders.append(torch.default_generator.manual_seed)
        self._seed_torch = seeders if _only_cpu_and_cuda() else [torch.manual_seed]

    def __call__(self, seed: int) -> None:
        for seed_torch in self._seed_torch:
            seed_torch(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)
