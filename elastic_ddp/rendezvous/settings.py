"""The rendezvous handler's settings: what torchrun's ``--rdzv-conf`` and node counts become
(:func:`elastic_ddp.rendezvous.plugin.handler_settings` reads them, with this project's defaults),
checked once, so that no part of the handler meets a setting that cannot work.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HandlerSettings"]


@dataclass(frozen=True)
class HandlerSettings:
    """Everything the handler needs besides its etcd client and store (see the plugin for the
    rdzv_conf keys and defaults).

    ``last_call_timeout``: how long a round after the first waits, once it has ``min_nodes``, for
    nodes it cannot account for; ``first_round_timeout``: the same for a run's first round (the
    start-up skew of a cluster's nodes); ``lease_ttl``: seconds a node stays registered after its
    last renewal (the time to notice a dead node that cannot be probed); ``keep_alive_interval``:
    seconds between renewals; ``keep_alive_deadline``: the longest one renewal may take before the
    next member is tried; ``run_ttl``: seconds the round record outlives the last node of the run.
    """

    run_id: str
    min_nodes: int
    max_nodes: int
    key_prefix: str
    join_timeout: float = 600.0
    last_call_timeout: float = 2.0
    first_round_timeout: float = 30.0
    close_timeout: float = 10.0
    keep_alive_interval: float = 1.0
    lease_ttl: int = 5
    keep_alive_deadline: float = 2.5
    run_ttl: int = 7200

    def __post_init__(self) -> None:
        if not self.run_id:
            raise ValueError("The run id must be a non-empty string.")
        if self.min_nodes < 1:
            raise ValueError(f"The minimum number of nodes ({self.min_nodes}) must be greater than zero.")
        if self.max_nodes < self.min_nodes:
            raise ValueError(
                f"The maximum number of nodes ({self.max_nodes}) must be greater than or equal to the minimum "
                f"number of nodes ({self.min_nodes})."
            )
        if self.lease_ttl < 2 or self.lease_ttl <= self.keep_alive_interval:
            raise ValueError(
                f"The node lease TTL ({self.lease_ttl} s = keep_alive_interval x keep_alive_max_attempt) must be at "
                f"least 2 s and longer than keep_alive_interval ({self.keep_alive_interval} s), or a node would be "
                "dropped between two renewals."
            )
        for name in ("join_timeout", "last_call_timeout", "first_round_timeout", "close_timeout", "keep_alive_interval",
                     "keep_alive_deadline"):
            if getattr(self, name) <= 0:
                raise ValueError(f"The rendezvous setting '{name}' ({getattr(self, name)}) must be positive.")

