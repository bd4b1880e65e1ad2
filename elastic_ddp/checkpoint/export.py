"""Objects of a checkpoint written in formats other tools read: ``torch.save``, safetensors, DCP.

:func:`~elastic_ddp.checkpoint.objects.open_objects` names some objects of a checkpoint without
reading them; :func:`write` then streams one of them into a format of :data:`FORMATS`, file by file
through the checkpoint's data files (:class:`~elastic_ddp.checkpoint.objects.Spans`), each byte
hashed as it passes and every file checked against the manifest. Each format has its writer in
``checkpoint/formats/``:

* ``torch`` (``formats/torch_save.py``): one ``torch.save`` file of the state dict as saved
  (``torch.load(path, weights_only=True)``, ``mmap=True`` too), record for record what ``torch.save``
  of the same tensors writes.
* ``safetensors`` (``formats/safetensors.py``): one ``.safetensors`` file of the state dict's tensors,
  keyed by their paths joined with ``.`` (a model's keys are its ``state_dict()`` keys); plain values
  cannot go in and are listed in :attr:`Written.left_out`.
* ``dcp`` (``formats/dcp.py``): a ``torch.distributed.checkpoint`` directory (one process, no process
  group), which ``dcp_to_torch_save`` converts to a ``torch.save`` file; int dict keys come back as
  strings and empty dicts are dropped.

Memory: the torch and safetensors writers hold no tensor at all -- only the read buffers
(:data:`~elastic_ddp.checkpoint.objects.BUFFERS` of :data:`~elastic_ddp.checkpoint.objects.CHUNK`
bytes); DCP's holds the tensors of one group, and any tensor whose bytes the files have begun but
not ended. ``benchmarks/bench_export.py`` measures it.

Verification: a file's checksum is known once the file has been read to its end, and by then some
of its bytes are already in the output. Every output is therefore written to ``PATH.partial`` and
renamed into place only after every file it drew on matched the manifest; a mismatch ends the
export (:class:`ExportError` naming the file) and removes the partial output. An interrupted export
leaves no partial output under the name asked for either.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass

from elastic_ddp.checkpoint.errors import CheckpointError, ExportError
from elastic_ddp.checkpoint.formats import dcp, safetensors, torch_save
from elastic_ddp.checkpoint.objects import StoredObject

FORMATS = ("torch", "safetensors", "dcp")
# What one object's output is called inside a directory of several (a DCP export is a directory).
SUFFIXES = {"torch": ".pt", "safetensors": ".safetensors", "dcp": ""}


@dataclass(frozen=True)
class Written:
    """What :func:`write` wrote of one object: its tensors and their bytes, and the paths of the
    plain values the format could not hold (safetensors only)."""

    tensors: int
    bytes: int
    left_out: tuple[str, ...] = ()


def write(fmt: str, name: str, stored: StoredObject, path: str, *, metadata: Mapping[str, str]) -> Written:
    """Write the object ``name`` (``stored``, from :func:`~elastic_ddp.checkpoint.objects.open_objects`)
    to ``path`` in the format ``fmt``, reading it from the checkpoint as it goes; ``metadata`` goes
    into the safetensors header (other formats ignore it).

    Raises :class:`ExportError` when the object cannot be written in that format (safetensors: it
    holds no tensors, two of its paths join to the same key, or a dtype safetensors lacks; dcp: its
    state dict is not a dict) or a checkpoint file it reads fails verification (nothing is left at
    ``path`` then), ``OSError`` when writing fails.
    """
    if fmt not in FORMATS:
        raise ExportError(f"The export format {fmt!r} is not one of {', '.join(FORMATS)}.")
    left_out: tuple[str, ...] = ()
    partial = f"{path}.partial"
    try:
        if fmt == "torch":
            torch_save.write(stored, partial)
        elif fmt == "safetensors":
            left_out = safetensors.write(name, stored, partial, metadata)
        else:
            dcp.write(name, stored, partial)
        if fmt == "dcp" and os.path.isdir(path):
            os.rmdir(path)  # an empty directory (the caller refuses a non-empty one): replaced by the export
        os.replace(partial, path)
    except CheckpointError as exc:  # a file failed verification (or could not be read) mid-export
        raise ExportError(f"Reading {name!r} from {stored.url} failed: {exc}") from exc
    finally:
        if os.path.isdir(partial):
            shutil.rmtree(partial)
        elif os.path.exists(partial):
            os.remove(partial)
    return Written(len(stored.tensors), stored.nbytes, left_out)
