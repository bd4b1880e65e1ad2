"""The export's writers, one module per format: ``torch_save``, ``safetensors`` and ``dcp``.

Each writes one stored object (:class:`~elastic_ddp.checkpoint.objects.StoredObject`) to the path it
is given, streaming it from the checkpoint's files as it goes; :func:`elastic_ddp.checkpoint.export.write`
picks the writer, writes to a ``.partial`` path and renames the output into place.
"""

from __future__ import annotations

import os


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """Write all of ``view`` at ``offset`` of the open file ``fd`` (``os.pwrite`` may write less)."""
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
