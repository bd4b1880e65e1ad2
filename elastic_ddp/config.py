"""The one place every setting is declared, documented and validated -- the library's and the user's.

A run's configuration is a tree of pydantic models: a :class:`Config` whose fields are *sections*
(:class:`Section` subclasses), one per component. The library's sections are ``run``, ``train``,
``data``, ``checkpoint``, ``logging`` and ``dist``; a training script adds its own by subclassing
:class:`Config`, and may extend a library section by subclassing it (``class Train(TrainConfig):
lr: float = 0.1`` keeps ``train.max_steps`` and adds ``train.lr``)::

    class ModelSettings(Section):
        identity: ClassVar[bool] = True          # every field shapes the run (see below)
        hidden: int = Field(64, gt=0, description="Width of the hidden layer.")

    class Settings(Config):
        model: ModelSettings = Field(default_factory=ModelSettings)

Values come from, in increasing priority:

1. the defaults (CPU-friendly: a script with no flags at all trains),
2. an optional YAML file (``--config FILE``),
3. ``--section.field=value`` flags (values are parsed as YAML scalars, so ``--train.seed=7``,
   ``--checkpoint.async_save=false`` and ``--checkpoint.keep_every=null`` work).

Every problem is reported before any process group is created, as a :class:`ConfigError` whose
message names the field, the value and what is allowed; an unknown setting is named with the
nearest valid one ("did you mean train.max_steps?"), never with its value. :func:`describe` is the
``--help`` text: every section and field with its type, default and description.

**Identity.** Some settings must not change while a run resumes from its checkpoints: the seed
(data order, initialisation), the global batch size, the model's shape, anything the user says
shapes their run. A whole section is part of the identity when it sets ``identity: ClassVar[bool] =
True``; a single field when it is annotated ``Annotated[type, IDENTITY]``. :meth:`Config.identity`
collects them; every checkpoint records them and a resume with other values is refused, naming
the fields (``checkpoint.allow_identity_change=true`` allows it).
"""

from __future__ import annotations

import difflib
import enum
import hashlib
import json
import os
import sys
import textwrap
import types
import uuid
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from elastic_ddp.contract import ENV_CHECKPOINT_KEY

__all__ = [
    "IDENTITY", "CheckpointConfig", "Config", "ConfigError", "DataConfig",
    "DistConfig", "LoggingConfig", "RunConfig", "Section", "TrainConfig", "describe", "identity_differences",
    "load_config",
]  # fmt: skip

# torchrun sets this for every worker of a job; it names the run when the user did not.
ENV_TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"


class ConfigError(ValueError):
    """A configuration value, key or file is not acceptable. The message says which and why."""


class _IdentityMarker:
    """Marks a field as part of the run's identity: ``Annotated[int, IDENTITY]``."""

    def __repr__(self) -> str:
        return "IDENTITY"


IDENTITY = _IdentityMarker()


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated.

    ``identity = True`` (a ``ClassVar``) makes every field of the section part of the run's identity.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    identity: ClassVar[bool] = False


def default_run_name() -> str:
    """The run's name when ``run.name`` is empty: torchrun's ``--rdzv-id``, else the script's name.

    ``torchrun --standalone`` (and torchrun without ``--rdzv-id``) invents a random run id at every
    launch; a run named after it would start over on every relaunch instead of resuming. Such an id
    (a UUID) is ignored, as is a missing one: the run is then named after the script (``train`` for
    ``recipes/train.py``), the same at every launch.
    """
    run_id = os.environ.get(ENV_TORCHELASTIC_RUN_ID, "")
    if run_id and not _is_uuid(run_id):
        return run_id
    script = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] not in ("", "-c", "-m") else ""
    return script or "default"


def _is_uuid(text: str) -> bool:
    try:
        return str(uuid.UUID(text)) == text.lower()
    except ValueError:
        return False


# Where the memory tier's default directories are, one per working directory (default_memory_dir).
DEFAULT_MEMORY_BASE = "/dev/shm/elastic_ddp"


def default_memory_dir() -> str:
    """The memory tier's directory when ``checkpoint.memory_dir`` is empty: one per working directory
    under ``/dev/shm/elastic_ddp``. Agents on different machines each have their own ``/dev/shm``;
    agents started from different directories of one host (a test, a dev box) then keep separate
    memories too instead of finding each other's and turning the tier off."""
    where = hashlib.sha256(os.path.realpath(os.getcwd()).encode()).hexdigest()[:12]
    return f"{DEFAULT_MEMORY_BASE}/{where}"


class RunConfig(Section):
    name: str = Field(
        default="",
        description=(
            "Name of the run. Empty: torchrun's --rdzv-id, else the training script's name (a random id "
            "from torchrun --standalone is not used: a relaunch must find the same run)."
        ),
    )
    root: str = Field(
        default="runs",
        description="Directory (or fsspec URL) under which each run gets a directory of its own.",
    )
    exit_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description=(
            "Seconds a worker's exit may take once the run's end is committed: the script's threads finishing "
            "(its thread pools told to end first, as Python's exit does), then its atexit handlers. Past it, "
            "the threads still alive are named with their stacks and the worker exits with the run's status."
        ),
    )

    @property
    def dir(self) -> str:
        """The run's own directory: checkpoints and TensorBoard logs default to places under it."""
        return f"{self.root.rstrip('/')}/{self.name}"


class TrainConfig(Section):
    max_steps: int = Field(default=300, gt=0, description="Number of optimizer steps of the whole run.")
    global_batch_size: Annotated[int, IDENTITY] = Field(
        default=32,
        gt=0,
        description="Samples per optimizer step, summed over all ranks. Fixed while ranks come and go.",
    )
    micro_batch_size: int = Field(
        default=0,
        ge=0,
        description=(
            "Most samples a rank puts through the model at once; a larger per-rank batch is split "
            "into the fewest micro-batches within this limit m, as equal as possible (11 -> 6 + 5 "
            "with m=10), with gradient accumulation. 0: no limit. The smallest micro-batch is "
            "min(f(floor(B/W)), f(ceil(B/W))), f(s) = floor(s / ceil(s/m)), for global batch B on W "
            "ranks; BatchNorm needs >= 2 at every W the job may run at (docs/data.md)."
        ),
    )
    seed: Annotated[int, IDENTITY] = Field(
        default=1337, ge=0, description="Seed of initialisation, data order and random generators."
    )
    exit_at_step: int = Field(
        default=0,
        ge=0,
        description=(
            "After this step, commit a checkpoint and exit 0 on every rank, e.g. to end an attempt "
            "inside a scheduler's time limit and resume in the next one. Ignored when the run resumes "
            "at or past it. 0: off."
        ),
    )

    @model_validator(mode="after")
    def _check_exit(self) -> TrainConfig:
        if self.exit_at_step > self.max_steps:
            raise ValueError(
                f"train.exit_at_step ({self.exit_at_step}) has no effect: the run ends at train.max_steps "
                f"({self.max_steps}) before it."
            )
        return self


class DataConfig(Section):
    num_workers: int = Field(default=0, ge=0, description="DataLoader worker processes per rank.")
    prefetch_batches: int = Field(
        default=2, ge=1, description="Steps a loader worker prepares ahead (only with data.num_workers > 0)."
    )
    ledger: bool = Field(
        default=False,
        description=(
            "Record every step's sample indices and loss per rank under <run dir>/ledger/ (an audit of "
            "exactly-once sample order; costs one host sync per step; see elastic_ddp/data/ledger.py)."
        ),
    )
    on_change: Literal["refuse", "next_epoch"] = Field(
        default="refuse",
        description=(
            "What a resume does when the dataset's size, fingerprint or order differs from the checkpoint's (shards "
            "added, a corpus tokenised again): 'refuse' ends the job with an error naming the difference (the saved "
            "position would name other samples); 'next_epoch' warns and continues at the start of the next epoch "
            "of the new data, leaving the rest of the saved epoch untrained (model, optimizer and step resume as "
            "usual). Unchanged data resumes exactly either way."
        ),
    )

    @model_validator(mode="after")
    def _check_workers(self) -> DataConfig:
        if "prefetch_batches" in self.model_fields_set and self.num_workers == 0:
            raise ValueError(
                f"data.prefetch_batches ({self.prefetch_batches}) has no effect with data.num_workers=0: batches are "
                "then made in the training process, one step at a time. Set data.num_workers, or drop it."
            )
        return self


class CheckpointConfig(Section):
    url: str = Field(
        default="",
        description="Where checkpoints go: a path or fsspec URL (s3://bucket/prefix). Empty: <run dir>/checkpoints.",
    )
    every_steps: int = Field(default=50, ge=0, description="Save every N optimizer steps. 0: only on stop.")
    async_save: bool = Field(
        default=True,
        description="Block training only while the state is staged to host memory; write in the background.",
    )
    keep_last: int = Field(default=3, ge=1, description="Keep the newest N committed checkpoints.")
    keep_every: int | None = Field(
        default=None, gt=0, description="Also keep every checkpoint whose step is a multiple of this."
    )
    resume: str = Field(
        default="auto",
        description="'auto': newest committed, verified checkpoint under checkpoint.url; 'never'; a step number; or a checkpoint URL.",
    )
    overwrite: bool = Field(
        default=False,
        description=(
            "With checkpoint.resume=never on a checkpoint.url that already holds checkpoints: delete them "
            "and start a new run there. Without it, such a start is refused (it would mix two runs)."
        ),
    )
    allow_identity_change: bool = Field(
        default=False,
        description=(
            "Resume a checkpoint saved with other values of the run's identity settings (seed, global batch "
            "size, the model's shape, ...). Without it, such a resume is refused, naming the fields that differ."
        ),
    )
    max_failed_saves: int = Field(
        default=3,
        ge=1,
        description=(
            "Periodic saves that may fail in a row before the job stops with an error (a job must not "
            "train on for days while every save fails). A failed final or stop save always stops it."
        ),
    )
    grace_s: float = Field(
        default=20.0,
        gt=0,
        description=(
            "Seconds a stopping run may spend on its final checkpoint. Keep it below torchrun's "
            "--shutdown-timeout (30 s by default), after which torchrun kills the workers."
        ),
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec options (e.g. endpoint_url, profile) for checkpoint.url."
    )
    write_threads: int = Field(
        default=2,
        ge=1,
        description=(
            "Files each rank writes its share of a checkpoint into, in as many threads (each hashing its "
            "file as it goes); also the threads a rank reads its share of a resume with."
        ),
    )
    min_file_mb: float = Field(
        default=16.0,
        ge=0,
        description=(
            "Smallest data file a save plans (MiB). With many ranks and a small state, fewer ranks write "
            "(spread evenly over the nodes) rather than many tiny files, which object stores serve slowly. "
            "0: every rank writes write_threads files, however small."
        ),
    )
    timeout_s: float = Field(
        default=600.0,
        gt=0,
        description=(
            "Seconds a checkpoint collective (on the checkpoint's own gloo group) may wait for a peer "
            "before the save or load is declared failed."
        ),
    )
    memory_dir: str = Field(
        default="",
        description=(
            "Node-local directory (a tmpfs: it outlives the worker processes, not the machine) where each node "
            "keeps the state after recent steps, so a hard node loss costs at most the steps since the last "
            "memory save. Each node needs room for two states (2 x model + optimizer state). Empty: a directory "
            "under /dev/shm/elastic_ddp named after the working directory, so agents started from different "
            "directories of one host keep separate memories. Set explicitly, a directory that cannot hold two "
            "states is an error; by default the tier is then off, said in one line."
        ),
    )
    memory_overhead: float = Field(
        default=0.02,
        ge=0,
        le=1,
        description=(
            "Budget of the memory tier as a fraction of step time: saves to node memory happen every step when "
            "their measured cost fits (the stall, and on CPU jobs the background write), else as often as it "
            "allows. 0 turns the memory tier off (durable checkpoints only)."
        ),
    )
    memory_every_steps: int = Field(
        default=0,
        ge=0,
        description=(
            "Save to node memory every N steps whatever the cost. 0: as often as checkpoint.memory_overhead allows. "
            "Needs the tier on (checkpoint.memory_overhead > 0)."
        ),
    )
    # The three below are derived from the node (device and cores) by default; each forces the value another
    # node would derive, so a GPU node's paths run on CPUs (docs/memory-tier.md, "Derived from the node").
    memory_write_threads: int = Field(
        default=0,
        ge=0,
        description=(
            "Threads a rank's memory save hashes its part with. 1: hashed as it is written, one pass on one thread. "
            "More: a helper thread hashes beside the write with the rest. 0: derived -- 1 on a CPU device (the "
            "cores are the training step's), on a GPU half the rank's share of the host's cores, 1 to 4. Needs "
            "the tier on."
        ),
    )
    memory_read_threads: int = Field(
        default=0,
        ge=0,
        description=(
            "Threads a rank hashes a part with when it verifies a restore or keeps a failed step's state (nothing "
            "else runs then; more than 1 writes a kept part with its hash beside the write). 0: derived -- the "
            "rank's share of the host's cores. Needs the tier on."
        ),
    )
    memory_direct_cost: Literal["auto", "write_cpu", "copies"] = Field(
        default="auto",
        description=(
            "What a memory save's background work is taken to cost training besides what the step times show: "
            "'write_cpu' the write's CPU time (training runs on the cores the write takes); 'copies' the "
            "device-to-host copies' time on the training stream (training runs on a GPU; 0 without one). auto: "
            "write_cpu on a CPU device, copies on a GPU. Needs the tier on."
        ),
    )

    share_compiled: Literal["auto", "on", "off"] = Field(
        default="auto",
        description=(
            "Share what torch.compile built between nodes, beside the checkpoints (torch.compiler's portable "
            "cache artifacts under <checkpoint.url>/compile/), so that a node that joins does not compile from "
            f"scratch. The artifacts hold code: auto shares them only signed with {ENV_CHECKPOINT_KEY}; on "
            "shares them unsigned too (whoever can write the storage can then run code on every node); off "
            "never. Only for a compiled model."
        ),
    )

    # Not identity: the weights a run starts from are read only at its first start; once it has a checkpoint
    # of its own, that holds them, so a relaunch naming another source (or none: the file moved) resumes it.
    init_from: str = Field(
        default="",
        description=(
            "Pretrained weights the model starts from when the run resumes nothing (no checkpoint of its own in "
            "either tier; a resume always wins): a path or fsspec URL of a torch.save file (a state dict, or a dict "
            "holding one under 'model'; read with weights_only=True), a safetensors file, a DCP directory or a "
            "checkpoint directory of this package (its 'model' object). Loaded strictly: every parameter and buffer "
            "with its shape and dtype, nothing else. Recorded with its BLAKE3 in every checkpoint's manifest. "
            "Empty: the model's own initialisation."
        ),
    )
    init_from_missing_ok: list[str] = Field(
        default_factory=list,
        description=(
            "Names of the model's parameters and buffers, or fnmatch patterns ('head.*'), that may be missing "
            "from checkpoint.init_from (a new head): they keep the model's own initial values. A YAML list, or "
            "one comma-separated string. Any other missing name is an error."
        ),
    )
    init_from_objects: list[str] = Field(
        default_factory=list,
        description=(
            "Objects registered with run.setup() (their keyword names, e.g. 'ema') that start from "
            "checkpoint.init_from too: each loads its own entry when the source is a checkpoint of this package "
            "holding an object of that name (strictly: the same tensors, shapes and dtypes), else the model's "
            "pretrained weights -- its state dict must hold the model's keys as they are or under one prefix "
            "(an AveragedModel's 'module.'), its other entries keep their values. A YAML list, or one "
            "comma-separated string. An unknown name, or an object that fits neither, ends the job naming it."
        ),
    )

    @property
    def memory_path(self) -> str:
        """``memory_dir``, or where it defaults to (see its description)."""
        return self.memory_dir or default_memory_dir()

    @property
    def memory_asked(self) -> bool:
        """Whether a memory-tier setting was given explicitly: the tier is then required (a directory that
        cannot hold it is an error), not just on by default (off, said in one line)."""
        return bool({"memory_dir", "memory_overhead", "memory_every_steps"} & self.model_fields_set)

    @model_validator(mode="after")
    def _check_memory(self) -> CheckpointConfig:
        if self.memory_overhead > 0:
            return self
        # A setting that cannot take effect is an error, never a silent no-op.
        for name in ("memory_every_steps", "memory_dir", "memory_write_threads", "memory_read_threads",
                     "memory_direct_cost"):  # fmt: skip
            if name in self.model_fields_set and getattr(self, name) not in (0, "", "auto"):
                raise ValueError(
                    f"checkpoint.{name} ({getattr(self, name)!r}) has no effect: checkpoint.memory_overhead=0 turns "
                    "the memory tier off. Drop one of the two settings."
                )
        return self

    @field_validator("init_from_missing_ok", "init_from_objects", mode="before")
    @classmethod
    def _split_missing_ok(cls, value: Any) -> Any:
        # --checkpoint.init_from_missing_ok=head.*,fc.bias (or init_from_objects=ema,teacher) arrives as one string.
        return [part.strip() for part in value.split(",") if part.strip()] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check_init_from(self) -> CheckpointConfig:
        for name in ("init_from_missing_ok", "init_from_objects"):
            if getattr(self, name) and not self.init_from:
                raise ValueError(
                    f"checkpoint.{name} ({getattr(self, name)}) has no effect without checkpoint.init_from. Set "
                    "checkpoint.init_from, or drop it."
                )
        for name in self.init_from_objects:
            if name in ("model", "data"):
                raise ValueError(
                    f"checkpoint.init_from_objects names {name!r}, which it cannot start: the model always starts from "
                    "checkpoint.init_from, and the data position is the run's own. Drop it from the list."
                )
        resume = self.resume.strip()
        if self.init_from and resume not in ("auto", "never"):
            raise ValueError(
                f"checkpoint.init_from ({self.init_from!r}) has no effect with checkpoint.resume={resume!r}: that "
                "checkpoint is always resumed. Use checkpoint.resume=auto (or never), or drop checkpoint.init_from."
            )
        return self

    @model_validator(mode="after")
    def _check_resume(self) -> CheckpointConfig:
        value = self.resume
        if not (value in ("auto", "never") or value.isdigit() or "/" in value or "://" in value):
            raise ValueError(
                f"checkpoint.resume ({value!r}) must be 'auto', 'never', a step number or a checkpoint URL."
            )
        # Settings that only matter for one kind of start are errors for the other, never silent no-ops.
        if value == "never" and self.allow_identity_change:
            raise ValueError(
                "checkpoint.allow_identity_change=true has no effect with checkpoint.resume=never: nothing is resumed."
            )
        if value != "never" and self.overwrite:
            raise ValueError(
                f"checkpoint.overwrite=true has no effect with checkpoint.resume={value!r}: it deletes old checkpoints "
                "only for a run that starts afresh (checkpoint.resume=never)."
            )
        return self


class LoggingConfig(Section):
    every_steps: int = Field(default=10, gt=0, description="Log metrics and a console line every N steps.")
    tensorboard_dir: str = Field(
        default="", description="TensorBoard event directory. Empty: <run dir>/tensorboard."
    )
    console: bool = Field(default=True, description="Print a progress line on rank 0.")
    flush_s: float = Field(
        default=10.0,
        gt=0,
        description=(
            "Seconds between flushes of TensorBoard events to disk by the background writer "
            "(a preempted worker loses at most this much of the curves; close() flushes all)."
        ),
    )


class DistConfig(Section):
    backend: Literal["auto", "gloo", "nccl"] = Field(
        default="auto", description="Collective backend. auto: nccl when CUDA is available, else gloo."
    )
    timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="Seconds a collective may wait for a peer before the group is declared broken.",
    )
    restart_wait_s: float = Field(
        default=60.0,
        gt=0,
        description=(
            "After a stop checkpoint, seconds a rank that was not itself asked to stop waits for its "
            "agent to restart it at the new membership; then it exits with an error, so the agent "
            "restarts it anyway."
        ),
    )
    stable_buckets: bool = Field(
        default=True,
        description=(
            "Reduce every step's gradients in one DDP bucket layout, the first step of each attempt included, so "
            "that a resume at the same world size stays bitwise identical at 3 ranks and more (see "
            "elastic_ddp/worker/ddp_buckets.py). It is a DDP communication hook: turn it off to register your own "
            "(ddp_model.register_comm_hook) after run.setup()."
        ),
    )


class Config(Section):
    """The library's sections; a training script subclasses it to add (or extend) sections."""

    run: RunConfig = Field(default_factory=RunConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    dist: DistConfig = Field(default_factory=DistConfig)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        for name, info in cls.model_fields.items():
            kind = info.annotation
            if not (isinstance(kind, type) and issubclass(kind, Section)):
                raise TypeError(
                    f"{cls.__name__}.{name}: every field of a Config must be a section (a subclass of "
                    "elastic_ddp.Section), because settings are given as --section.field=value; put "
                    f"{name!r} into a section."
                )

    @model_validator(mode="after")
    def _fill_run_paths(self) -> Config:
        # Derived defaults are filled in here, once, so every component sees concrete values. They
        # stay "unset": a config used as the defaults of load_config derives them again from the
        # final run name and root.
        derive = {
            ("run", "name"): default_run_name,
            ("checkpoint", "url"): lambda: f"{self.run.dir}/checkpoints",
            ("logging", "tensorboard_dir"): lambda: f"{self.run.dir}/tensorboard",
        }
        for section_name, field in _DERIVED:
            section = getattr(self, section_name)
            if not getattr(section, field):
                setattr(section, field, derive[section_name, field]())
                section.__pydantic_fields_set__.discard(field)
        return self

    def identity(self) -> dict[str, Any]:
        """The run's identity: ``{"section.field": value}`` of every setting a resume must not change.

        Fields of sections with ``identity = True`` and fields annotated with :data:`IDENTITY`; values
        as JSON. Recorded in every checkpoint (see the module docstring).
        """
        out: dict[str, Any] = {}
        for section_name in type(self).model_fields:
            section = getattr(self, section_name)
            values = section.model_dump(mode="json")
            for field_name, info in type(section).model_fields.items():
                if type(section).identity or any(meta is IDENTITY for meta in info.metadata):
                    out[f"{section_name}.{field_name}"] = values[field_name]
        return out

    def to_yaml(self) -> str:
        """The whole configuration as YAML, with storage options (which may hold keys) redacted."""
        data = self.model_dump(mode="json")
        for section in data.values():
            if isinstance(section, dict) and isinstance(section.get("storage_options"), dict):
                section["storage_options"] = {key: "<redacted>" for key in section["storage_options"]}
        return yaml.safe_dump(data, sort_keys=False)


def identity_differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``"field: checkpoint X, now Y"`` for every identity field that differs (or exists on one side only)."""
    missing = object()
    lines = []
    for key in sorted(set(saved) | set(now)):
        before, after = saved.get(key, missing), now.get(key, missing)
        if before != after:
            def show(value: Any) -> str:
                return "(not set)" if value is missing else repr(value)

            lines.append(f"{key}: checkpoint {show(before)}, now {show(after)}")
    return lines


def describe(config: type[Config] | Config = Config, prog: str | None = None, width: int = 100) -> str:
    """The ``--help`` text of a script whose settings are ``config``: every section, and for each
    field its flag, type, default and description; identity fields marked.

    ``config`` is the :class:`Config` subclass (its own sections beside the library's, extended
    library sections with their added fields) or an instance whose values are the defaults, as
    :func:`load_config` takes it. Derived defaults show what they derive from
    (``<run.root>/<run.name>/checkpoints``), not a path resolved now; storage options show their
    keys only. ``prog``: the script's name in the usage line (default: ``sys.argv[0]``'s).
    """
    cls, given = _class_and_values(config)
    if prog is None:
        prog = Path(sys.argv[0]).name if sys.argv and sys.argv[0] not in ("", "-c", "-m") else "script.py"
    out = [
        f"usage: {prog} [--config FILE] [--section.field=VALUE ...]",
        "",
        *textwrap.wrap(
            "Each setting is its default, else its value in the YAML file given with --config FILE "
            "(section: {field: value}), else --section.field=VALUE; values are YAML (--train.seed=7, "
            "--checkpoint.async_save=false, --checkpoint.keep_every=null). [identity]: must not change "
            "while a run resumes from its checkpoints (--checkpoint.allow_identity_change=true allows it).",
            width,
            break_on_hyphens=False,
        ),
    ]
    for section_name, info in cls.model_fields.items():
        section_cls = info.annotation
        defaults = _section_defaults(info, given.get(section_name))
        out += ["", f"{section_name}:" + (f" {info.description}" if info.description else "")]
        for field_name, field in section_cls.model_fields.items():
            kind = _type_text(field.annotation)
            bounds = [f"{op} {getattr(meta, attr)}" for meta in field.metadata
                      for attr, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
                      if getattr(meta, attr, None) is not None]  # fmt: skip
            if bounds:
                kind += " " + ", ".join(bounds)
            identity = section_cls.identity or any(meta is IDENTITY for meta in field.metadata)
            default = _default_text(section_name, field_name, field, defaults)
            mark = "  [identity]" if identity else ""
            out.append(f"  --{section_name}.{field_name}  {kind}  (default: {default}){mark}")
            if field.description:
                out += textwrap.wrap(field.description, width, initial_indent=" " * 6, subsequent_indent=" " * 6,
                                     break_on_hyphens=False)  # fmt: skip
    return "\n".join(out) + "\n"


_MISSING = object()


def _settings(cls: type[Config]) -> list[tuple[str, type[Section], str]]:
    """``(section.field, section class, field)`` of every setting of ``cls``, in declaration order."""
    return [
        (f"{section}.{field}", info.annotation, field)
        for section, info in cls.model_fields.items()
        for field in info.annotation.model_fields
    ]


def _section_defaults(info: Any, given: dict[str, Any] | None) -> dict[str, Any]:
    """A section's default values: those of the instance given as defaults, else of the section
    the Config's field makes (its default factory may set values of its own)."""
    if given is not None:
        return given
    try:
        section = info.get_default(call_default_factory=True)
    except ValidationError:  # a section with required fields: each field says so
        return {}
    return section.model_dump() if isinstance(section, BaseModel) else {}


def _default_text(section: str, name: str, field: Any, defaults: dict[str, Any]) -> str:
    value = defaults.get(name, _MISSING)
    if (section, name) in _DERIVED_HELP and (value is _MISSING or not value):
        return _DERIVED_HELP[section, name]
    if value is _MISSING:
        if field.is_required():
            return "none, required"
        value = field.get_default(call_default_factory=True)
    if name == "storage_options" and isinstance(value, dict):
        value = {key: "<redacted>" for key in value}  # as in to_yaml: they may hold keys
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, (str, dict, list, tuple)):
        try:
            return json.dumps(value)
        except TypeError:
            return repr(value)
    return str(value)


def _type_text(annotation: Any) -> str:
    """A field's type as a user writes its value: ``int``, ``'auto'|'gloo'|'nccl'``, ``int|null``, ``dict``."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _type_text(args[0])
    if origin is Literal:
        return "|".join(repr(arg) for arg in args)
    if origin in (Union, types.UnionType):
        text = "|".join(_type_text(arg) for arg in args if arg is not type(None))
        return f"{text}|null" if type(None) in args else text
    if annotation is Any:
        return "any"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "|".join(repr(member.value) for member in annotation)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        if name in ("dict", "Mapping", "MutableMapping"):
            return "dict" if len(args) < 2 or args[1] is Any else f"dict[{_type_text(args[0])}, {_type_text(args[1])}]"
        items = [arg for arg in args if arg is not Ellipsis]
        return name if not items or items[0] is Any else f"{name}[{', '.join(_type_text(arg) for arg in items)}]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _format_validation_error(exc: ValidationError, source: str, cls: type[Config]) -> str:
    lines = [f"Invalid configuration ({source}):"]
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"])
        # Values are echoed only where they cannot be credentials: not for storage options, and
        # not for unknown settings (a mistyped "storage_options" holds the same keys). Names are.
        if error["type"] == "extra_forbidden":
            lines.extend(f"  {line}" for line in _unknown(error["loc"], error["input"], cls))
            continue
        message = error["msg"].removeprefix("Value error, ")
        if isinstance(error["input"], dict):
            # A cross-field check: its message already names the fields and their values.
            lines.append(f"  {message}")
        elif "storage_options" in error["loc"]:
            lines.append(f"  {field}: {message} (value not shown: storage options may hold credentials).")
        else:
            lines.append(f"  {field}: {message} (got {error['input']!r}).")
    return "\n".join(lines)


# How alike (difflib's ratio) an unknown setting's dotted name must be to a valid one to be suggested:
# typos and shortened names score 0.81-0.97 (train.max_step, logging.every); an unrelated field of
# the same section scores up to ~0.8 on the shared "section." alone (checkpoint.path ~ keep_last).
_SUGGEST_CUTOFF = 0.81


def _unknown(loc: tuple, value: Any, cls: type[Config]) -> list[str]:
    """What to say about an unknown key at ``loc``: the nearest valid setting (difflib on the full
    dotted names), else what there is. ``value`` is looked at only for the keys under an unknown
    section (``--trian.max_steps=5`` arrives as section ``trian`` holding ``{"max_steps": 5}``)."""
    sections = list(cls.model_fields)
    names = [name for name, _, _ in _settings(cls)]
    if len(loc) == 1:  # a section that does not exist
        section = str(loc[0])
        keys = [f"{section}.{key}" for key in value] if isinstance(value, dict) and value else []
        close = difflib.get_close_matches(section, sections, n=1)
        there = f"no section {section!r}" + (f" (did you mean {close[0]}?)" if close else "")
        listing = f"; the sections are {', '.join(sections)}."
        if not keys:
            return [f"{section}: unknown section: {there}{listing}"]
        lines = []
        for key in keys:
            match = difflib.get_close_matches(key, names, n=1, cutoff=_SUGGEST_CUTOFF)
            lines.append(f"{key}: unknown setting; did you mean {match[0]}?" if match
                         else f"{key}: unknown setting: {there}{listing}")  # fmt: skip
        return lines
    name = ".".join(str(part) for part in loc)
    match = difflib.get_close_matches(name, names, n=1, cutoff=_SUGGEST_CUTOFF)
    if match:
        return [f"{name}: unknown setting; did you mean {match[0]}?"]
    if len(loc) == 2:
        fields = [field.split(".", 1)[1] for field in names if field.startswith(f"{loc[0]}.")]
        return [f"{name}: unknown setting; the settings of {loc[0]} are {', '.join(fields)}."]
    return [f"{name}: unknown setting."]


def _parse_flag(flag: str) -> tuple[list[str], Any]:
    if not flag.startswith("--") or "=" not in flag:
        raise ConfigError(f"Argument {flag!r} is not of the form --section.field=value.")
    key, raw = flag[2:].split("=", 1)
    parts = key.split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"Argument {flag!r}: the key must be section.field, e.g. --train.max_steps=100.")
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        value = raw
    if value is None and raw.lower() not in ("null", "none", "~"):
        value = raw
    return parts, value


def load_config(argv: list[str] | None = None, config: type[Config] | Config = Config) -> Config:
    """Build the run's configuration from command-line arguments.

    ``config`` is the :class:`Config` subclass to build, or an instance whose values are the
    defaults the arguments override. ``argv`` holds ``--config FILE`` / ``--config=FILE`` and
    ``--section.field=value`` items. Raises :class:`ConfigError` naming the field (or file), the
    value and what is allowed.
    """
    cls, data = _class_and_values(config)
    argv = list(argv or [])
    overrides: list[str] = []
    config_file = ""
    index = 0
    while index < len(argv):
        arg = argv[index]
        if arg == "--config":
            if index + 1 >= len(argv):
                raise ConfigError("--config needs a file name.")
            config_file = argv[index + 1]
            index += 2
            continue
        if arg.startswith("--config="):
            config_file = arg.split("=", 1)[1]
        else:
            overrides.append(arg)
        index += 1

    if config_file:
        data = _merge(data, _read_yaml(config_file))
    for flag in overrides:
        (section, field), value = _parse_flag(flag)
        section_data = data.setdefault(section, {})
        if not isinstance(section_data, dict):
            raise ConfigError(f"Section {section!r} in the config must be a mapping.")
        section_data[field] = value
    source = f"{config_file} and flags" if config_file else "flags"
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, source, cls)) from None


# Filled in by Config from the run name and root unless set: not part of an instance's own values.
_DERIVED = (("run", "name"), ("checkpoint", "url"), ("logging", "tensorboard_dir"))
# What --help shows as their defaults: where they come from (see Config._fill_run_paths).
_DERIVED_HELP = {
    ("run", "name"): "torchrun's --rdzv-id, else the script's name",
    ("checkpoint", "url"): "<run.root>/<run.name>/checkpoints",
    ("logging", "tensorboard_dir"): "<run.root>/<run.name>/tensorboard",
    ("checkpoint", "memory_dir"): "/dev/shm/elastic_ddp/<a hash of the working directory>",
}


def _class_and_values(config: type[Config] | Config) -> tuple[type[Config], dict[str, Any]]:
    """The Config class of ``config`` (a subclass or an instance) and the values an instance sets."""
    if isinstance(config, Config):
        return type(config), _values_of(config)
    if isinstance(config, type) and issubclass(config, Config):
        return config, {}
    raise TypeError(f"config must be a Config subclass or instance, not {config!r}.")


def _values_of(config: Config) -> dict[str, Any]:
    """The values set in ``config`` (at construction or by assignment), section by section: what it
    changes from the defaults. The rest -- the derived defaults it filled in among them -- stays
    unset, so validation can tell a setting given from a default (see CheckpointConfig.memory_asked)."""
    return {name: getattr(config, name).model_dump(exclude_unset=True) for name in type(config).model_fields}


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = {key: dict(value) if isinstance(value, dict) else value for key, value in base.items()}
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key].update(value)
        else:
            merged[key] = value
    return merged


def _read_yaml(path: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"Config file {path!r} cannot be read: {exc.strerror}.") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"Config file {path!r} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"Config file {path!r} must hold a mapping of sections, not {type(data).__name__}.")
    return data
