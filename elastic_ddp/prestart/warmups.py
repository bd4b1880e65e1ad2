"""What the template's successor runs, besides its imports, so that its forks start with it done.

torch.compile's inductor asks, once per process, which vector instructions the CPU has and which C++
compiler is there (``cpu_vec_isa.pick_vec_isa``, ``cpp_builder.get_compiler_version_info``, ...):
subprocesses whose answers it keeps for the process's life (``functools`` caches). A compiled
model's first step in a fresh worker pays them even when every compiled graph comes from the node's
cache: 0.8 s of a 1.3 s first step measured here (the language-model recipe's small model, inductor's
on-disk caches warm). Made in the successor, they are in every fork's memory. They leave no thread
behind (the template's fork check would refuse to serve otherwise).
"""

from __future__ import annotations

__all__ = ["inductor_probes"]


def inductor_probes() -> None:
    """Inductor's probes of the CPU and the C++ compiler, answered and cached in this process."""
    from torch._inductor import cpp_builder, cpu_vec_isa

    cpu_vec_isa.pick_vec_isa()
    compiler = cpp_builder.get_cpp_compiler()
    cpp_builder.get_compiler_version_info(compiler)
    cpp_builder._is_intel_compiler(compiler)
