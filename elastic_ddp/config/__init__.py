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

from elastic_ddp.config.help import describe
from elastic_ddp.config.loading import load_config
from elastic_ddp.config.sections import (
    DEFAULT_MEMORY_BASE, ENV_TORCHELASTIC_RUN_ID, IDENTITY, CheckpointConfig, Config, ConfigError, DataConfig,
    DistConfig, LoggingConfig, RunConfig, Section, TrainConfig, default_memory_dir, default_run_name,
    identity_differences,
)  # fmt: skip

__all__ = [
    "DEFAULT_MEMORY_BASE", "ENV_TORCHELASTIC_RUN_ID", "IDENTITY", "CheckpointConfig", "Config", "ConfigError",
    "DataConfig", "DistConfig", "LoggingConfig", "RunConfig", "Section", "TrainConfig", "default_memory_dir",
    "default_run_name", "describe", "identity_differences", "load_config",
]  # fmt: skip
