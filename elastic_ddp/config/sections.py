"""The settings' declarations: :class:`Section`, the library's sections, :class:`Config` and the run's
identity (see the package's docstring for how they are used).
"""

from __future__ import annotations

import hashlib
import os
import sys
import uuid
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from elastic_ddp.contract import ENV_CHECKPOINT_KEY

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
    stop_check_s: float = Field(
        default=1.0,
        ge=0,
        description=(
            "Seconds of steps between the ranks' checks for a stop request (a few bytes all-reduced on a gloo "
            "group beside the steps, each read at the next check): a SIGTERM stops the job at the same step on "
            "every rank at most twice this long plus two steps after it arrives. 0: at every step, which a step "
            "of a few ms pays for."
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


# Filled in by Config from the run name and root unless set: not part of an instance's own values.
_DERIVED = (("run", "name"), ("checkpoint", "url"), ("logging", "tensorboard_dir"))
