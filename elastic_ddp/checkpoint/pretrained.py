"""Start a run from pretrained weights (``checkpoint.init_from``): read once, checked strictly, broadcast.

A run that resumes nothing -- no checkpoint of its own in either tier -- loads its model's weights
from ``checkpoint.init_from`` before step 1; a run that resumes never reads it (a resume always
wins). The source is a local path or an fsspec URL of one of:

* a ``torch.save`` file of a state dict, or of a dict holding one under the model's name
  (``{"model": {...}}``), read with ``torch.load(weights_only=True)``: no code is unpickled;
* a safetensors file (what ``elastic-ddp ckpt export --format safetensors`` writes);
* a DCP directory (``torch.distributed.checkpoint``, as ``ckpt export --format dcp`` writes); its
  pickled ``.metadata`` is read with an unpickler that builds only DCP's metadata classes;
* a checkpoint of this package (a ``step-NNNNNNNNN`` directory, or a checkpoint root: its newest
  committed checkpoint), whose model object is read with the verified object reader
  (``checkpoint/objects.py``).

Loading is strict: every tensor of the model must be in the source with its shape and dtype, and
the source must hold nothing else; the errors name the parameters (both shapes, both dtypes).
Parameters matched by ``checkpoint.init_from_missing_ok`` (names or ``fnmatch`` patterns) may be
missing from the source -- a new head -- and keep the model's own initial values.

Other registered objects start from the source too where asked (``checkpoint.init_from_objects``):
each loads its own entry when the source is a checkpoint of this package holding an object of its
name (another run's EMA, its optimizer), strictly (the same tensor paths, shapes and dtypes); else
the model's weights just loaded, when its state dict holds every model key as it is or under one
prefix (an ``AveragedModel`` holds them under ``module.``), keeping its other entries (``n_averaged``)
and, for the model's keys kept from ``init_from_missing_ok``, its own values.

Cost: rank 0 alone reads the source (one read of the file per job, plus, for a DCP directory, one
more to hash it), holds it in host memory (for a file, its bytes and then its tensors: up to twice
the weights for a moment), and broadcasts it to every rank over the default process group (NCCL on
GPUs) in packs of at most :data:`PACK_BYTES`; every rank holds one extra copy of the weights on its
device until the model has loaded them.

:func:`source_record` describes a source for the manifests (``{"url", "format", "blake3"}``): the
BLAKE3 of the file's bytes, of the checkpoint's ``manifest.json`` (which names every file's checksum)
or, for a DCP directory, of the lines ``b3sum`` prints for its files in name order.
"""

from __future__ import annotations

import concurrent.futures
import difflib
import fnmatch
import io
import pickle
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastic_ddp.checkpoint import manifest as mf
from elastic_ddp.checkpoint.catalog import CheckpointInfo, list_checkpoints, read_index
from elastic_ddp.checkpoint.errors import CheckpointError
from elastic_ddp.checkpoint.objects import load_objects
from elastic_ddp.checkpoint.storage import Storage, StorageError, join, normalize_url
from elastic_ddp.checkpoint.tree import TreeError, flatten, path_text, unflatten
from elastic_ddp.state import ModelState

__all__ = [
    "FORMATS", "MODEL_WEIGHTS", "OWN_ENTRY", "InitFromError", "Loaded", "check_fit", "load_pretrained", "read_weights",
    "source_record",
]

TORCH, SAFETENSORS, DCP, CHECKPOINT = "torch", "safetensors", "dcp", "checkpoint"
# The values of a source record's "format" (what the manifests and `ckpt list` show).
FORMATS = (TORCH, SAFETENSORS, DCP, CHECKPOINT)
# The object a checkpoint of this package (and a torch.save dict of several) holds the model under:
# run.setup() registers it so, and `ckpt export` writes it by default.
MODEL_NAME = "model"
# Largest buffer one broadcast moves; smaller tensors are packed into it (thousands of small
# tensors then cost tens of collectives, not thousands), larger ones go in slices of it.
PACK_BYTES = 64 << 20
_DCP_METADATA = ".metadata"
# Names shown in an error before "and N more".
_SHOWN = 8
# How an object of checkpoint.init_from_objects was initialised (Loaded.objects).
OWN_ENTRY, MODEL_WEIGHTS = "its own entry", "the model's weights"
# Objects init_from_objects cannot name: the model always loads, the data position is the run's own.
NOT_OBJECTS = (MODEL_NAME, "data")


class InitFromError(CheckpointError):
    """``checkpoint.init_from`` cannot be read, or does not fit the model; the message names the
    source and the parameters. ``retryable``: the storage failed to answer (a restart may succeed);
    otherwise the source itself is wrong -- missing, of no known format, not fitting the model --
    and no restart can fix it."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass(frozen=True)
class Loaded:
    """What :func:`load_pretrained` did: the source's ``record`` (for the manifests), the model's
    tensors it loaded and their bytes, the model's parameters kept (``checkpoint.init_from_missing_ok``),
    and how each object of ``checkpoint.init_from_objects`` was initialised (``(name,``
    :data:`OWN_ENTRY` ``or`` :data:`MODEL_WEIGHTS` ``)``)."""

    record: dict[str, str]
    tensors: int
    bytes: int
    kept: tuple[str, ...]
    objects: tuple[tuple[str, str], ...] = ()


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(map(repr, names[:_SHOWN]))
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def _locate(storage: Storage, url: str) -> tuple[str, str]:
    """``(format, where)`` of the source at ``url``, from what is there (not from its name): ``where``
    is ``url`` itself, or for a checkpoint root its newest committed checkpoint."""
    try:
        if storage.exists(join(url, mf.MANIFEST_NAME)):
            return CHECKPOINT, url
        if storage.exists(join(url, _DCP_METADATA)):
            return DCP, url
        if storage.fs.isdir(storage._path(url)):
            committed = list_checkpoints(storage, url)
            if committed:
                return CHECKPOINT, committed[-1].url
            raise InitFromError(
                f"checkpoint.init_from ({url}) is a directory, but neither a checkpoint (no {mf.MANIFEST_NAME}, no "
                f"committed step-* directories) nor a DCP checkpoint (no {_DCP_METADATA}). Name a torch.save or "
                "safetensors file, a DCP directory or a checkpoint directory."
            )
        with storage.open_read(url) as stream:
            head = stream.read(9)
    except FileNotFoundError:
        raise InitFromError(f"checkpoint.init_from ({url}) does not exist.") from None
    except StorageError as exc:
        raise InitFromError(f"checkpoint.init_from ({url}) cannot be read: {exc}", retryable=True) from exc
    if head[:4] == b"PK\x03\x04":  # torch.save's zip container
        return TORCH, url
    if len(head) == 9 and head[8:9] == b"{":  # safetensors: an 8-byte header length, then its JSON
        return SAFETENSORS, url
    raise InitFromError(
        f"checkpoint.init_from ({url}) is neither a torch.save file (a zip archive) nor a safetensors file "
        "(a JSON header): expected one of these, a DCP directory or a checkpoint directory."
    )


def _checkpoint_of(storage: Storage, url: str) -> tuple[CheckpointInfo, bytes]:
    """The checkpoint at ``url`` (a checkpoint directory, as :func:`_locate` gives it) and the bytes
    of its manifest."""
    data = storage.read_bytes(join(url, mf.MANIFEST_NAME))
    try:
        return CheckpointInfo.from_manifest(url, mf.parse(data, f"{url}/{mf.MANIFEST_NAME}")), data
    except mf.ManifestError as exc:
        raise InitFromError(f"checkpoint.init_from ({url}): {exc}") from None


def source_record(url: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, str]:
    """``{"url", "format", "blake3"}`` of the source at ``url`` (see the module docstring), reading
    only what the digest covers. Raises :class:`InitFromError` naming the source."""
    url = normalize_url(url)
    storage = Storage(url, dict(storage_options or {}))
    kind, where = _locate(storage, url)
    try:
        return _record(storage, where, kind)
    except StorageError as exc:
        raise InitFromError(f"checkpoint.init_from ({url}) cannot be read: {exc}", retryable=True) from exc


def _record(storage: Storage, url: str, kind: str, data: bytes | None = None) -> dict[str, str]:
    """The record of the source at ``url`` (for a checkpoint: the checkpoint directory :func:`_locate`
    gives); ``data``: the file's bytes (or the checkpoint's manifest) when read already."""
    if kind == CHECKPOINT:
        if data is None:
            _, data = _checkpoint_of(storage, url)
        return {"url": url, "format": kind, "blake3": mf.hash_bytes(data, "blake3")}
    if kind == DCP:
        lines = []
        for name, _ in sorted(storage.list_files(url).items()):
            with storage.open_read(join(url, name), sequential=True) as stream:
                lines.append(f"{mf.hash_stream(stream, 'blake3')[1]}  {name}\n")
        return {"url": url, "format": kind, "blake3": mf.hash_bytes("".join(lines).encode(), "blake3")}
    if data is None:
        with storage.open_read(url, sequential=True) as stream:
            return {"url": url, "format": kind, "blake3": mf.hash_stream(stream, "blake3")[1]}
    return {"url": url, "format": kind, "blake3": mf.hash_bytes(data, "blake3")}


def read_weights(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The model weights the source at ``url`` holds (CPU tensors by state-dict key) and its
    :func:`source_record`; on this process alone. Raises :class:`InitFromError` naming the source
    and what is wrong with it."""
    weights, record, _ = _read_source(url, storage_options, ())
    return weights, record


def _read_source(
    url: str, storage_options: Mapping[str, Any] | None, entries: Sequence[str]
) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, Any]]:
    """:func:`read_weights`, and the state dicts of the objects ``entries`` that the source holds
    (a checkpoint of this package only; other formats hold a model's weights alone)."""
    url = normalize_url(url)
    # One storage for every read of the source: a checkpoint root's newest checkpoint is on the same
    # filesystem, reached with the same options.
    storage = Storage(url, dict(storage_options or {}))
    kind, where = _locate(storage, url)
    found: dict[str, Any] = {}
    try:
        if kind in (TORCH, SAFETENSORS):
            data = storage.read_bytes(url)
            record = _record(storage, url, kind, data)
            weights = _from_torch(data, url) if kind == TORCH else _from_safetensors(data, url)
        elif kind == DCP:
            record = _record(storage, url, kind)
            weights = _from_dcp(url, storage)
        else:
            info, manifest = _checkpoint_of(storage, where)
            record = _record(storage, info.url, kind, manifest)
            weights, found = _from_checkpoint(storage, info, entries)
    except StorageError as exc:
        raise InitFromError(f"checkpoint.init_from ({url}) cannot be read: {exc}", retryable=True) from exc
    return weights, record, found


def _tensors_only(tree: Any, url: str, what: str) -> dict[str, torch.Tensor]:
    if not isinstance(tree, Mapping):
        raise InitFromError(f"checkpoint.init_from ({url}) holds {what} a {type(tree).__name__}, not a state dict.")
    plain = [str(key) for key, value in tree.items() if not isinstance(value, torch.Tensor)]
    if plain:
        raise InitFromError(
            f"checkpoint.init_from ({url}): {what} is not a model's state dict: {_names(plain)} "
            f"{'are not tensors' if len(plain) > 1 else 'is not a tensor'}."
        )
    return {str(key): value for key, value in tree.items()}


def _from_torch(data: bytes, url: str) -> dict[str, torch.Tensor]:
    try:
        # weights_only: tensors and plain containers only; a file that would run code is refused.
        tree = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise InitFromError(
            f"checkpoint.init_from ({url}) is a torch.save file that torch.load(weights_only=True) refuses (it "
            f"holds more than tensors and plain values): {exc}"
        ) from None
    except (RuntimeError, EOFError, ValueError) as exc:
        raise InitFromError(f"checkpoint.init_from ({url}) is not a readable torch.save file: {exc}") from None
    if isinstance(tree, Mapping) and isinstance(tree.get(MODEL_NAME), Mapping):
        return _tensors_only(tree[MODEL_NAME], url, f"its {MODEL_NAME!r} entry")
    return _tensors_only(tree, url, "the file")


def _from_safetensors(data: bytes, url: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return dict(load(data))
    except (SafetensorError, ValueError) as exc:
        raise InitFromError(f"checkpoint.init_from ({url}) is not a readable safetensors file: {exc}") from None


# Every global a DCP ``.metadata`` pickle names (torch's dtypes besides): its metadata classes, sizes, paths.
_DCP_GLOBALS = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING",
    )),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.serialization", "_get_layout"),
    ("torch", "Size"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("collections", "OrderedDict"),
})  # fmt: skip


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes, torch sizes and dtypes, and nothing else: a DCP ``.metadata``
    is a pickle (DCP itself reads it with ``pickle.load``), and an untrusted one could run any code."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which is not part of DCP's metadata")


def _from_dcp(url: str, storage: Storage) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = _MetadataUnpickler(io.BytesIO(storage.read_bytes(join(url, _DCP_METADATA)))).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as exc:
        raise InitFromError(f"checkpoint.init_from ({url}): its {_DCP_METADATA} is not DCP metadata: {exc}") from None
    entries = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(entries, Mapping):
        raise InitFromError(f"checkpoint.init_from ({url}): its {_DCP_METADATA} lists no state (no state_dict_metadata).")
    plain = [key for key, entry in entries.items() if not isinstance(entry, TensorStorageMetadata)]
    if plain:
        raise InitFromError(
            f"checkpoint.init_from ({url}) is a DCP checkpoint of more than a model's state dict: {_names(plain)} "
            f"{'are not tensors' if len(plain) > 1 else 'is not a tensor'}."
        )
    weights = {key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype) for key, entry in entries.items()}
    reader = (dcp.FileSystemReader(storage._path(url)) if storage.is_local
              else dcp.FsspecReader(url, **storage.storage_options))  # fmt: skip
    # The metadata DCP reads itself is the one checked above: the same bytes, already proven harmless.
    reader.read_metadata = lambda *args, **kwargs: metadata  # type: ignore[method-assign]
    try:
        with warnings.catch_warnings():
            # no_dist=True is the point (rank 0 reads alone, then broadcasts); DCP warns about it regardless.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(weights, storage_reader=reader, no_dist=True)
    except Exception as exc:  # DCP raises assorted types (CheckpointException, OSError, RuntimeError)
        raise InitFromError(f"checkpoint.init_from ({url}): reading the DCP checkpoint failed: {exc}") from exc
    return weights


def _from_checkpoint(
    storage: Storage, info: CheckpointInfo, entries: Sequence[str] = ()
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The checkpoint's model weights, and the state dicts of those of the objects ``entries`` it holds."""
    try:
        index = read_index(storage, info).as_shared(0)
        if MODEL_NAME not in index.state:
            raise InitFromError(
                f"checkpoint.init_from ({info.url}) holds no object named {MODEL_NAME!r}; it holds "
                f"{_names(list(index.state))}."
            )
        names = [MODEL_NAME] + [name for name in entries if name in index.state]
        # Only the files holding these objects' pieces are read, each verified against the manifest as
        # it streams; what differed across the saving ranks (BatchNorm statistics) is rank 0's.
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            trees = load_objects(storage, info.url, index, mf.file_records(info.manifest), names, pool)
    except InitFromError:
        raise
    except (CheckpointError, TreeError) as exc:
        raise InitFromError(f"checkpoint.init_from ({info.url}) failed verification: {exc}") from None
    model = _tensors_only(trees.pop(MODEL_NAME), info.url, f"its {MODEL_NAME!r} object")
    return model, trees


def check_fit(
    weights: Mapping[str, torch.Tensor], model: Mapping[str, Any], missing_ok: Sequence[str], url: str
) -> list[str]:
    """The model's keys missing from ``weights`` that ``missing_ok`` (names or fnmatch patterns)
    allows; raises :class:`InitFromError` naming every other missing key, every key the model lacks,
    and the first parameter whose shape or dtype differs (both shapes, both dtypes)."""
    missing = [key for key in model if key not in weights]
    kept = [key for key in missing if any(fnmatch.fnmatchcase(key, pattern) for pattern in missing_ok)]
    refused = [key for key in missing if key not in kept]
    unexpected = [key for key in weights if key not in model]
    problems = []
    if refused:
        problems.append(
            f"the model's {_names(refused)} {'are' if len(refused) > 1 else 'is'} missing from it (list the names or "
            "patterns that may be, e.g. a new head, in checkpoint.init_from_missing_ok)"
        )
    if unexpected:
        problems.append(f"it holds {_names(unexpected)}, which the model has not")
    if problems:
        raise InitFromError(f"checkpoint.init_from ({url}) does not fit the model: {'; '.join(problems)}.")
    for key, template in model.items():
        if key not in weights:
            continue
        if not isinstance(template, torch.Tensor):
            raise InitFromError(f"checkpoint.init_from: the model's {key!r} is not a tensor; only tensors can be loaded.")
        have = weights[key]
        if tuple(have.shape) != tuple(template.shape) or have.dtype != template.dtype:
            raise InitFromError(
                f"checkpoint.init_from ({url}) does not fit the model: {key!r} is {tuple(have.shape)} {have.dtype} "
                f"there, {tuple(template.shape)} {template.dtype} in the model."
            )
    return kept


def _targets(objects: Sequence[str], registered: Mapping[str, Any]) -> dict[str, Any]:
    """``{name: object}`` of ``checkpoint.init_from_objects``; raises :class:`InitFromError` naming an
    object the run did not register (every rank alike: each holds the same registry)."""
    found: dict[str, Any] = {}
    for name in dict.fromkeys(objects):
        if name in NOT_OBJECTS:
            raise InitFromError(
                f"checkpoint.init_from_objects names {name!r}, which is not an object it can start: the model always "
                "starts from checkpoint.init_from, the data position is the run's own."
            )
        if name not in registered:
            others = [n for n in registered if n not in NOT_OBJECTS]
            close = difflib.get_close_matches(name, others, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise InitFromError(
                f"checkpoint.init_from_objects names {name!r}, which run.setup() did not register{hint}; it registered "
                f"{_names(others) if others else 'no object besides the model'}."
            )
        found[name] = registered[name]
    return found


def _object_plan(
    name: str, template: Any, entry: Any, model: Mapping[str, Any], keys: Sequence[str], url: str, *, checkpoint: bool
) -> tuple[tuple[Any, ...], list[torch.Tensor]]:
    """How the object ``name`` (its current state dict ``template``) starts from the source, checked:
    ``(("entry", encoded tree, [(dtype, shape)]), tensors)`` from ``entry``, its own state dict in the
    source, when there is one; else ``(("model", prefix), [])``: the model's loaded ``keys`` (of the
    model's state dict ``model``) go to ``prefix + key``. Raises :class:`InitFromError` naming the
    object and what does not fit."""
    where = f"checkpoint.init_from ({url}) does not fit the object {name!r} (checkpoint.init_from_objects)"
    if entry is not None:
        try:
            encoded, tensors, paths = flatten(entry)
            _, mine, my_paths = flatten(template)
        except TreeError as exc:
            raise InitFromError(f"{where}: {exc}") from None
        theirs, ours = dict(zip(paths, tensors)), dict(zip(my_paths, mine))
        missing = [path_text(p) for p in ours if p not in theirs]
        unexpected = [path_text(p) for p in theirs if p not in ours]
        problems = []
        if missing:
            are = "are" if len(missing) > 1 else "is"
            problems.append(f"{name!r}'s {_names(missing)} {are} missing from the source's {name!r}")
        if unexpected:
            problems.append(f"the source's {name!r} holds {_names(unexpected)}, which {name!r} has not")
        if problems:
            raise InitFromError(f"{where}: {'; '.join(problems)}.")
        for at, have in theirs.items():
            want = ours[at]
            if tuple(have.shape) != tuple(want.shape) or have.dtype != want.dtype:
                raise InitFromError(
                    f"{where}: {path_text(at)!r} is {tuple(have.shape)} {have.dtype} there, {tuple(want.shape)} "
                    f"{want.dtype} in {name!r}."
                )
        return ("entry", encoded, [(t.dtype, tuple(t.shape)) for t in tensors]), tensors
    if not keys:
        return ("model", ""), []
    first = keys[0]
    names = [k for k in template if isinstance(k, str)] if isinstance(template, Mapping) else []
    prefixes = sorted({k[: len(k) - len(first)] for k in names if k.endswith(first)}, key=len)
    prefix = next((p for p in prefixes if (not p or p.endswith(".")) and all(p + k in template for k in keys)), None)
    if prefix is None:
        why = (
            "the checkpoint holds no object of that name" if checkpoint
            else "only a checkpoint of this package holds objects besides the model"
        )  # fmt: skip
        raise InitFromError(
            f"{where}: the source holds no {name!r} of its own ({why}), and {name!r} holds no copy of the model to take "
            f"the model's weights: its state dict has no {first!r}, as it is or under one prefix (an AveragedModel "
            "holds the model's keys under 'module.')."
        )
    for key in keys:
        have, want = model[key], template[prefix + key]
        if not isinstance(want, torch.Tensor) or tuple(have.shape) != tuple(want.shape) or have.dtype != want.dtype:
            what = f"{tuple(want.shape)} {want.dtype}" if isinstance(want, torch.Tensor) else f"a {type(want).__name__}"
            raise InitFromError(
                f"{where}: the model's {key!r} is {tuple(have.shape)} {have.dtype}, {name!r}'s {prefix + key!r} is {what}."
            )
    return ("model", prefix), []


def load_pretrained(
    url: str, state: Any, *, missing_ok: Sequence[str] = (), objects: Sequence[str] = (),
    registered: Mapping[str, Any] | None = None, storage_options: Mapping[str, Any] | None = None,
    device: torch.device | None = None, control_group: Any = None,
) -> Loaded:  # fmt: skip
    """Load the weights at ``url`` into ``state`` (the run's registered model: ``state_dict()`` /
    ``load_state_dict()``) -- and into the objects ``objects`` of ``registered`` (the run's registered
    objects by name; ``checkpoint.init_from_objects``) -- on every rank; collective over the default
    process group when one exists.

    Rank 0 reads and checks the source (:func:`read_weights`, :func:`check_fit`, and for each object
    its own entry or the model's weights, see the module docstring); a problem raises the same
    :class:`InitFromError` on every rank, before anything is loaded. Then every tensor is broadcast
    from rank 0 over the default group on ``device`` (the rank's device: NCCL needs CUDA tensors),
    and every rank loads the same state dict -- the source's tensors, and the model's own values for
    the keys ``missing_ok`` let it keep (the same on every rank: DDP broadcast rank 0's at its
    construction); then each object loads its entry (broadcast likewise) or the model's weights.
    ``control_group``: a gloo group for the small messages (default: the default group).
    """
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    targets = _targets(objects, registered or {})
    templates = state.state_dict()
    device = device or torch.device("cpu")
    outcome: Any = None
    weights: dict[str, torch.Tensor] = {}
    entry_tensors: dict[str, torch.Tensor] = {}
    if rank == 0:
        try:
            weights, record, entries = _read_source(url, storage_options, list(targets))
            kept = check_fit(weights, templates, missing_ok, url)
            loaded_keys = [key for key in templates if key not in kept]
            plans = {}
            for name, obj in targets.items():
                plans[name], tensors = _object_plan(
                    name, obj.state_dict(), entries.pop(name, None), templates, loaded_keys, url,
                    checkpoint=record["format"] == CHECKPOINT,
                )  # fmt: skip
                entry_tensors.update({f"{name}/{i}": t for i, t in enumerate(tensors)})
            outcome = (record, kept, plans)
        except InitFromError as exc:
            outcome = {"error": str(exc), "retryable": exc.retryable}
    if distributed:
        box = [outcome]
        dist.broadcast_object_list(box, src=0, group=control_group)
        outcome = box[0]
    if isinstance(outcome, dict):  # rank 0's error, raised alike on every rank
        raise InitFromError(outcome["error"], retryable=outcome["retryable"])
    record, kept, plans = outcome
    keys = [key for key in templates if key not in kept]
    values = {key: torch.empty(tuple(templates[key].shape), dtype=templates[key].dtype, device=device) for key in keys}
    _fill(keys, values, weights, distributed=distributed, rank=rank, device=device)
    weights.clear()
    state.load_state_dict({**{key: templates[key] for key in kept}, **values})
    specs = {f"{name}/{i}": spec for name, plan in plans.items() if plan[0] == "entry" for i, spec in enumerate(plan[2])}
    entry_values = {key: torch.empty(shape, dtype=dtype, device=device) for key, (dtype, shape) in specs.items()}
    _fill(list(specs), entry_values, entry_tensors, distributed=distributed, rank=rank, device=device)
    entry_tensors.clear()
    done = []
    for name, plan in plans.items():
        obj = targets[name]
        if plan[0] == "entry":
            obj.load_state_dict(unflatten(plan[1], lambda i, _, name=name: entry_values[f"{name}/{i}"], where=f"{url}: {name}"))
            done.append((name, OWN_ENTRY))
            continue
        # A ModelState copies what it loads; another object may keep the tensors it is given, so it
        # gets its own (the model and each object never share memory).
        own = not isinstance(obj, ModelState)
        taken = {plan[1] + key: values[key].clone() if own else values[key] for key in keys}
        obj.load_state_dict({**obj.state_dict(), **taken})
        done.append((name, MODEL_WEIGHTS))
    nbytes = sum(v.numel() * v.element_size() for v in values.values())
    return Loaded(record, len(keys), nbytes, tuple(kept), tuple(done))


def _fill(keys: list[str], values: dict[str, torch.Tensor], source: dict[str, torch.Tensor], *, distributed: bool,
          rank: int, device: torch.device) -> None:  # fmt: skip
    """Fill ``values`` on every rank from ``source`` (rank 0's; empty elsewhere)."""
    if distributed:
        _broadcast(keys, values, source if rank == 0 else None, device)
    else:
        for key in keys:
            values[key].copy_(source[key])


def _broadcast(keys: list[str], values: dict[str, torch.Tensor], source: dict[str, torch.Tensor] | None,
               device: torch.device) -> None:  # fmt: skip
    """Fill ``values`` on every rank from ``source`` on rank 0 (None elsewhere): tensors of at least
    PACK_BYTES straight into their destination in slices of it, runs of smaller ones packed."""
    pack = torch.empty(0, dtype=torch.uint8, device=device)
    batch: list[str] = []

    def flat(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().reshape(-1).view(torch.uint8)

    def flush() -> None:
        nonlocal pack
        if not batch:
            return
        sizes = [values[key].numel() * values[key].element_size() for key in batch]
        if pack.numel() < sum(sizes):
            pack = torch.empty(PACK_BYTES, dtype=torch.uint8, device=device)
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        if source is not None:
            for key, off, size in zip(batch, offsets, sizes):
                pack[off : off + size].copy_(flat(source[key].contiguous()))
        dist.broadcast(pack[: sum(sizes)], src=0)
        for key, off, size in zip(batch, offsets, sizes):
            flat(values[key]).copy_(pack[off : off + size])
        batch.clear()

    for key in keys:
        size = values[key].numel() * values[key].element_size()
        if size >= PACK_BYTES:
            flush()
            whole = flat(values[key])
            if source is not None:
                whole.copy_(flat(source[key].contiguous()))
            for lo in range(0, size, PACK_BYTES):
                dist.broadcast(whole[lo : lo + PACK_BYTES], src=0)
            continue
        if batch and sum(values[k].numel() * values[k].element_size() for k in batch) + size > PACK_BYTES:
            flush()
        batch.append(key)
    flush()
