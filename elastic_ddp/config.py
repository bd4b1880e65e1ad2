"""The one place every setting is declared, documented and validated.

A run's configuration is a tree of pydantic models, one section per component. Each component
takes its own section (``cfg.checkpoint`` for the checkpoint manager, ``cfg.data`` for the data
pipeline, ...). Values come from, in increasing priority:

1. the defaults below (CPU-friendly: a recipe with no flags at all trains a small model),
2. an optional YAML file (``--config FILE``),
3. ``--section.field=value`` flags (values are parsed as YAML scalars, so ``--train.lr=1e-3``,
   ``--checkpoint.async_save=false`` and ``--checkpoint.keep_every=null`` work).

Every problem is reported before any process group is created, as a :class:`ConfigError` whose
message names the field, the value and what is allowed.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# torchrun sets this for every worker of a job; it names the run when the user did not.
ENV_TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"


class ConfigError(ValueError):
    """A configuration value, key or file is not acceptable. The message says which and why."""


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(Section):
    name: str = Field(
        default="",
        description="Name of the run. Empty: torchrun's --rdzv-id (TORCHELASTIC_RUN_ID), else 'default'.",
    )
    root: str = Field(
        default="runs",
        description="Directory (or fsspec URL) under which each run gets a directory of its own.",
    )

    @property
    def dir(self) -> str:
        """The run's own directory: checkpoints and TensorBoard logs default to places under it."""
        return f"{self.root.rstrip('/')}/{self.name}"


class TrainConfig(Section):
    max_steps: int = Field(default=300, gt=0, description="Number of optimizer steps of the whole run.")
    global_batch_size: int = Field(
        default=32,
        gt=0,
        description="Samples per optimizer step, summed over all ranks. Fixed while ranks come and go.",
    )
    micro_batch_size: int = Field(
        default=0,
        ge=0,
        description=(
            "Most samples a rank puts through the model at once; a larger per-rank batch is split "
            "into micro-batches with gradient accumulation. 0: no limit."
        ),
    )
    lr: float = Field(default=3e-3, gt=0, description="Peak learning rate (AdamW).")
    min_lr: float = Field(default=3e-4, ge=0, description="Learning rate at the end of the cosine decay.")
    warmup_steps: int = Field(default=20, ge=0, description="Steps of linear learning-rate warm-up.")
    weight_decay: float = Field(default=0.1, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(default=1.0, ge=0, description="Clip the global gradient norm to this. 0: off.")
    seed: int = Field(default=1337, ge=0, description="Seed of model init, data order and dropout.")
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
    def _check_lr(self) -> TrainConfig:
        if self.min_lr > self.lr:
            raise ValueError(f"train.min_lr ({self.min_lr}) must not exceed train.lr ({self.lr}).")
        return self


class ModelConfig(Section):
    """Shape of the byte-level transformer. Every field here shapes the checkpoint: a checkpoint
    saved with other values is refused on resume (see :meth:`Config.model_digest`)."""

    block_size: int = Field(default=64, gt=0, description="Context length in bytes.")
    n_layer: int = Field(default=2, gt=0, description="Number of transformer blocks.")
    n_head: int = Field(default=4, gt=0, description="Attention heads per block.")
    n_embd: int = Field(default=128, gt=0, description="Embedding width; a multiple of model.n_head.")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="Dropout probability.")

    @model_validator(mode="after")
    def _check_heads(self) -> ModelConfig:
        if self.n_embd % self.n_head:
            raise ValueError(
                f"model.n_embd ({self.n_embd}) must be a multiple of model.n_head ({self.n_head})."
            )
        return self


class DataConfig(Section):
    path: str = Field(
        default="",
        description=(
            "Text files to train on: a file, a directory (read recursively) or an fsspec URL "
            "(s3://bucket/prefix). Empty: the Python standard library's own source files."
        ),
    )
    glob: str = Field(default="**/*.py", description="Which files of a directory data.path to read.")
    max_bytes: int = Field(
        default=8_000_000, gt=0, description="Read at most this many bytes of text (files in sorted order)."
    )
    num_workers: int = Field(default=0, ge=0, description="DataLoader worker processes per rank.")
    prefetch_batches: int = Field(
        default=2, ge=1, description="Batches a loader worker prepares ahead (only with data.num_workers > 0)."
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec options for a remote data.path."
    )
    ledger: bool = Field(
        default=False,
        description=(
            "Record every step's sample indices and loss per rank under <run dir>/ledger/ "
            "(an audit of exactly-once sample order; see elastic_ddp/data/ledger.py)."
        ),
    )


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
        description="Threads (and so files) each rank writes its shards with; hashing runs in the same threads.",
    )
    timeout_s: float = Field(
        default=600.0,
        gt=0,
        description=(
            "Seconds a checkpoint collective (on the checkpoint's own gloo group) may wait for a peer "
            "before the save or load is declared failed."
        ),
    )

    @model_validator(mode="after")
    def _check_resume(self) -> CheckpointConfig:
        value = self.resume
        if value in ("auto", "never") or value.isdigit() or "/" in value or "://" in value:
            return self
        raise ValueError(
            f"checkpoint.resume ({value!r}) must be 'auto', 'never', a step number or a checkpoint URL."
        )


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


class Config(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    dist: DistConfig = Field(default_factory=DistConfig)

    @model_validator(mode="after")
    def _fill_run_paths(self) -> Config:
        # Derived defaults are filled in here, once, so every component sees concrete values.
        if not self.run.name:
            self.run.name = os.environ.get(ENV_TORCHELASTIC_RUN_ID) or "default"
        if not self.checkpoint.url:
            self.checkpoint.url = f"{self.run.dir}/checkpoints"
        if not self.logging.tensorboard_dir:
            self.logging.tensorboard_dir = f"{self.run.dir}/tensorboard"
        return self

    def model_digest(self) -> str:
        """A digest of every setting that shapes the model's tensors (the ``model`` section).

        Saved in each checkpoint; a resume with a different digest is refused.
        """
        canonical = json.dumps(self.model.model_dump(), sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def to_yaml(self) -> str:
        """The whole configuration as YAML, with storage options (which may hold keys) redacted."""
        data = self.model_dump()
        for section in ("data", "checkpoint"):
            data[section]["storage_options"] = {
                key: "<redacted>" for key in data[section]["storage_options"]
            }
        return yaml.safe_dump(data, sort_keys=False)


def _format_validation_error(exc: ValidationError, source: str) -> str:
    lines = [f"Invalid configuration ({source}):"]
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"])
        # Values are echoed only where they cannot be credentials: not for storage options, and
        # not for unknown settings (a mistyped "storage_options" holds the same keys).
        if error["type"] == "extra_forbidden":
            lines.append(f"  {field}: unknown setting.")
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


def load_config(argv: list[str] | None = None) -> Config:
    """Build the run's :class:`Config` from command-line arguments.

    ``argv`` holds ``--config FILE`` / ``--config=FILE`` and ``--section.field=value`` items.
    Raises :class:`ConfigError` naming the field (or file), the value and what is allowed.
    """
    argv = list(argv or [])
    data: dict[str, Any] = {}
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
        data = _read_yaml(config_file)
    for flag in overrides:
        (section, field), value = _parse_flag(flag)
        section_data = data.setdefault(section, {})
        if not isinstance(section_data, dict):
            raise ConfigError(f"Section {section!r} in the config must be a mapping.")
        section_data[field] = value
    source = f"{config_file} and flags" if config_file else "flags"
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, source)) from None


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
