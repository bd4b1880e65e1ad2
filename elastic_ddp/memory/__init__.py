"""The memory tier: the state after recent steps kept in node memory, so a hard node loss costs at
most one step (see docs/memory-tier.md).

``tier`` is one rank's front door (:class:`~elastic_ddp.memory.tier.MemoryTier`), delegating to
``saver`` (staging a part, the background write), ``interval`` (measurements, the agreed interval)
and ``survey`` (the start-up survey, the restore); ``store`` is one node's directory and its format,
``copies`` the device-to-host copies on GPUs, ``policy`` the decisions (how often to save, where to
resume from) as pure functions.
"""
