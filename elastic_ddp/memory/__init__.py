"""The memory tier: the state after recent steps kept in node memory, so a hard node loss costs at
most one step (see docs/memory-tier.md).

``store`` is one node's directory and its format, ``tier`` saving and restoring across ranks,
``policy`` the two decisions (how often to save, where to resume from) as pure functions.
"""
