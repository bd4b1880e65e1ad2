"""Configuration: the library's and a script's own sections load from YAML and flags alike, errors name
the field and what was expected and never echo a credential, an unknown setting is named with the
nearest valid one, --help lists every setting with its type, default and description, the run's
identity is collected from sections and fields, the run's name survives torchrun --standalone, and
every shipped YAML file loads with its recipe's settings."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Annotated, ClassVar

import pytest
import yaml
from lm import CorpusConfig
from pydantic import Field, model_validator

from elastic_ddp.config import (
    ENV_TORCHELASTIC_RUN_ID,
    IDENTITY,
    CheckpointConfig,
    Config,
    ConfigError,
    Section,
    TrainConfig,
    default_run_name,
    describe,
    identity_differences,
    load_config,
)
REPO = Path(__file__).resolve().parents[2]

SECRET = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"


# A script's own settings, as a training script declares them.


class Optim(Section):
    lr: float = Field(default=0.1, gt=0, description="Learning rate.")
    momentum: float = Field(default=0.9, ge=0, lt=1, description="Momentum.")


class Model(Section):
    identity: ClassVar[bool] = True

    hidden: int = Field(default=64, gt=0, description="Width of the hidden layer.")
    layers: int = Field(default=2, gt=0, description="Number of layers.")


class Train(TrainConfig):
    """The library's train section plus a field of the script's, one of them part of the identity."""

    warmup_steps: int = Field(default=10, ge=0, description="Warm-up steps.")
    label_smoothing: Annotated[float, IDENTITY] = Field(default=0.0, ge=0, lt=1, description="Label smoothing.")

    @model_validator(mode="after")
    def _check_warmup(self) -> Train:
        if self.warmup_steps > self.max_steps:
            raise ValueError(
                f"train.warmup_steps ({self.warmup_steps}) must not exceed train.max_steps ({self.max_steps})."
            )
        return self


class Settings(Config):
    train: Train = Field(default_factory=Train)
    optim: Optim = Field(default_factory=Optim)
    model: Model = Field(default_factory=Model)


class Remote(Section):
    url: str = ""
    storage_options: dict = Field(default_factory=dict)


class RemoteSettings(Config):
    data: CorpusConfig = Field(default_factory=CorpusConfig)
    remote: Remote = Field(default_factory=Remote)


def write_yaml(tmp_path, data: dict) -> Path:
    path = tmp_path / f"job-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def error_lines(exc: pytest.ExceptionInfo) -> list[str]:
    """The message's lines after the heading (which names the source: a file, or flags)."""
    return str(exc.value).splitlines()[1:]


# --- errors ----------------------------------------------------------------------------------


def test_a_bad_value_is_named_with_the_value_it_got():
    with pytest.raises(ConfigError, match=r"train.max_steps: .*\(got 'many'\)"):
        load_config(["--train.max_steps=many"])


def test_an_unknown_setting_is_named_without_its_value(tmp_path):
    # A mistyped "storage_options" carries the same credentials as the real one.
    config = write_yaml(tmp_path, {"checkpoint": {"storage_option": {"secret": SECRET}}})
    with pytest.raises(ConfigError) as raised:
        load_config([f"--config={config}"])
    assert "checkpoint.storage_option: unknown setting; did you mean checkpoint.storage_options?" in str(raised.value)
    assert SECRET not in str(raised.value)


@pytest.mark.parametrize(
    "config,section", [(Config, "checkpoint"), (RemoteSettings, "data"), (RemoteSettings, "remote")]
)
def test_malformed_storage_options_are_named_without_their_value(config, section):
    with pytest.raises(ConfigError) as raised:
        load_config([f"--{section}.storage_options={SECRET}"], config)
    assert f"{section}.storage_options:" in str(raised.value) and "value not shown" in str(raised.value)
    assert SECRET not in str(raised.value)


def test_storage_options_of_a_section_without_them_are_an_unknown_setting_not_echoed():
    with pytest.raises(ConfigError) as raised:
        load_config([f"--data.storage_options={SECRET}"])  # the library's data section has none
    assert "data.storage_options: unknown setting; the settings of data are num_workers," in str(raised.value)
    assert SECRET not in str(raised.value)


@pytest.mark.parametrize(
    "values,expected",
    [
        ({"optim": {"lr": -1}}, ["  optim.lr: Input should be greater than 0 (got -1)."]),
        ({"optim": {"nesterov": True}}, ["  optim.nesterov: unknown setting; the settings of optim are lr, momentum."]),
        ({"optim": {"moment": 0.5}}, ["  optim.moment: unknown setting; did you mean optim.momentum?"]),
        ({"trian": {"warmup_steps": 5}}, ["  trian.warmup_steps: unknown setting; did you mean train.warmup_steps?"]),
        ({"model": {"hidden": "wide"}}, ["  model.hidden: Input should be a valid integer, unable to parse string "
                                         "as an integer (got 'wide')."]),
        ({"train": {"label_smoothing": 1.5}}, ["  train.label_smoothing: Input should be less than 1 (got 1.5)."]),
        ({"train": {"max_steps": 0}}, ["  train.max_steps: Input should be greater than 0 (got 0)."]),
        ({"train": {"max_steps": 5, "warmup_steps": 8}},
         ["  train.warmup_steps (8) must not exceed train.max_steps (5)."]),
    ],
    ids=["user-bound", "user-unknown", "user-typo", "section-typo", "user-type", "extended-identity-field",
         "library-field", "extended-cross-check"],
)  # fmt: skip
def test_user_and_extended_sections_report_the_same_errors_from_yaml_and_flags(tmp_path, values, expected):
    flags = [f"--{section}.{field}={value}" for section, fields in values.items() for field, value in fields.items()]
    config = write_yaml(tmp_path, values)
    with pytest.raises(ConfigError, match=r"^Invalid configuration \(flags\):") as from_flags:
        load_config(flags, Settings)
    heading = rf"^Invalid configuration \({re.escape(str(config))} and flags\):"
    with pytest.raises(ConfigError, match=heading) as from_yaml:
        load_config(["--config", str(config)], Settings)
    assert error_lines(from_flags) == error_lines(from_yaml) == expected


@pytest.mark.parametrize(
    "flag,expected",
    [
        ("--trian.max_steps=5", "trian.max_steps: unknown setting; did you mean train.max_steps?"),
        ("--train.max_step=5", "train.max_step: unknown setting; did you mean train.max_steps?"),
        ("--checkpoint.every=5", "checkpoint.every: unknown setting; did you mean checkpoint.keep_every?"),
        ("--dist.backnd=gloo", "dist.backnd: unknown setting; did you mean dist.backend?"),
        ("--foo.bar=1", "foo.bar: unknown setting: no section 'foo'; the sections are run, train, data, checkpoint, "
                        "logging, dist."),
        ("--trian.foo=1", "trian.foo: unknown setting: no section 'trian' (did you mean train?); the sections are "
                          "run, train, data, checkpoint, logging, dist."),
        ("--train.foo=1", "train.foo: unknown setting; the settings of train are max_steps, global_batch_size, "
                          "micro_batch_size, seed, exit_at_step."),
    ],
)  # fmt: skip
def test_an_unknown_setting_is_named_with_the_nearest_valid_one_or_what_there_is(flag, expected):
    with pytest.raises(ConfigError) as raised:
        load_config([flag])
    assert error_lines(raised) == [f"  {expected}"]


def test_the_nearest_valid_setting_is_found_in_a_scripts_own_sections_and_from_a_yaml_file(tmp_path):
    config = write_yaml(tmp_path, {"modle": {"hidden": 3}, "train": {"warmup_step": 2}, "optim": {"lr": 0.5}})
    with pytest.raises(ConfigError) as raised:
        load_config([f"--config={config}"], Settings)
    assert sorted(error_lines(raised)) == [
        "  modle.hidden: unknown setting; did you mean model.hidden?",
        "  train.warmup_step: unknown setting; did you mean train.warmup_steps?",
    ]


def test_an_unknown_section_or_setting_never_echoes_its_value(tmp_path):
    config = write_yaml(tmp_path, {"chekpoint": {"storage_options": {"secret": SECRET}}, "vault": SECRET})
    with pytest.raises(ConfigError) as raised:
        load_config([f"--config={config}", f"--checkpoint.storage_option={SECRET}"])
    message = str(raised.value)
    assert "chekpoint.storage_options: unknown setting; did you mean checkpoint.storage_options?" in message
    assert "vault: unknown section: no section 'vault'; the sections are run, train" in message
    assert "checkpoint.storage_option: unknown setting; did you mean checkpoint.storage_options?" in message
    assert SECRET not in message


def test_user_and_extended_sections_load_from_yaml_and_flags_with_flags_last(tmp_path):
    config = write_yaml(tmp_path, {"optim": {"lr": 0.5, "momentum": 0.0}, "train": {"warmup_steps": 3, "max_steps": 40},
                                   "model": {"hidden": 128}})  # fmt: skip
    cfg = load_config([f"--config={config}", "--optim.lr=0.25", "--train.label_smoothing=0.1"], Settings)
    assert isinstance(cfg, Settings) and isinstance(cfg.train, Train)
    assert (cfg.optim.lr, cfg.optim.momentum) == (0.25, 0.0)
    assert (cfg.train.warmup_steps, cfg.train.max_steps, cfg.train.label_smoothing) == (3, 40, 0.1)
    assert cfg.train.global_batch_size == TrainConfig().global_batch_size  # the library's field kept its default
    assert (cfg.model.hidden, cfg.model.layers) == (128, 2)


def test_a_config_file_that_is_missing_or_not_a_mapping_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"Config file '.*nope.yaml' cannot be read"):
        load_config(["--config", str(tmp_path / "nope.yaml")])
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping of sections, not list"):
        load_config([f"--config={listing}"])
    with pytest.raises(ConfigError, match="--config needs a file name"):
        load_config(["--config"])
    with pytest.raises(ConfigError, match=r"'--max_steps=3': the key must be section.field"):
        load_config(["--max_steps=3"])
    with pytest.raises(ConfigError, match=r"'train.seed=3' is not of the form --section.field=value"):
        load_config(["train.seed=3"])


# --- --help --------------------------------------------------------------------------------


def setting_lines(text: str) -> dict[str, str]:
    """``{"--section.field": "its line"}`` of a --help text."""
    return {line.split()[0]: line for line in text.splitlines() if line.startswith("  --")}


def test_help_lists_every_setting_of_every_section_with_type_default_and_identity():
    text = describe(Settings, prog="my_train.py")
    assert text.startswith("usage: my_train.py [--config FILE] [--section.field=VALUE ...]\n")
    lines = setting_lines(text)
    expected = {f"--{section}.{field}" for section, info in Settings.model_fields.items()
                for field in info.annotation.model_fields}  # fmt: skip
    assert set(lines) == expected  # the library's, the script's own, and the extended section's added fields
    assert re.findall(r"^(\w+):$", text, re.MULTILINE) == ["run", "train", "data", "checkpoint", "logging", "dist",
                                                          "optim", "model"]  # fmt: skip
    assert lines["--train.max_steps"] == "  --train.max_steps  int > 0  (default: 300)"
    assert lines["--train.warmup_steps"] == "  --train.warmup_steps  int >= 0  (default: 10)"
    assert lines["--train.seed"].endswith("(default: 1337)  [identity]")
    assert lines["--train.label_smoothing"] == "  --train.label_smoothing  float >= 0, < 1  (default: 0.0)  [identity]"
    assert lines["--model.hidden"].endswith("[identity]") and not lines["--optim.lr"].endswith("[identity]")
    assert lines["--optim.momentum"] == "  --optim.momentum  float >= 0, < 1  (default: 0.9)"
    assert lines["--dist.backend"] == "  --dist.backend  'auto'|'gloo'|'nccl'  (default: \"auto\")"
    assert lines["--checkpoint.keep_every"] == "  --checkpoint.keep_every  int|null > 0  (default: null)"
    assert lines["--checkpoint.storage_options"] == "  --checkpoint.storage_options  dict  (default: {})"
    assert lines["--checkpoint.async_save"] == "  --checkpoint.async_save  bool  (default: true)"
    assert lines["--run.root"] == "  --run.root  str  (default: \"runs\")"
    # Derived defaults say where they come from, not a path resolved in this process.
    assert lines["--checkpoint.url"] == "  --checkpoint.url  str  (default: <run.root>/<run.name>/checkpoints)"
    assert lines["--logging.tensorboard_dir"].endswith("(default: <run.root>/<run.name>/tensorboard)")
    assert lines["--run.name"].endswith("(default: torchrun's --rdzv-id, else the script's name)")


def test_help_wraps_each_description_under_its_setting():
    text = describe(Settings, prog="x.py", width=60)
    after = text.split("  --checkpoint.max_failed_saves ", 1)[1].splitlines()[1:4]
    assert all(line.startswith("      ") and len(line) <= 60 for line in after)
    assert " ".join(line.strip() for line in after).startswith("Periodic saves that may fail in a row before the job")
    assert "      Warm-up steps." in text.splitlines()


def test_help_of_an_instance_shows_its_values_as_defaults_and_never_storage_options_values():
    defaults = Settings(optim={"lr": 0.5}, checkpoint={"url": "s3://b/run", "storage_options": {"key": SECRET}})
    lines = setting_lines(describe(defaults))
    assert lines["--optim.lr"].endswith("(default: 0.5)")
    assert lines["--checkpoint.url"].endswith('(default: "s3://b/run")')
    assert lines["--logging.tensorboard_dir"].endswith("(default: <run.root>/<run.name>/tensorboard)")  # still derived
    assert lines["--checkpoint.storage_options"].endswith('(default: {"key": "<redacted>"})')
    assert SECRET not in describe(defaults)


def test_help_of_the_classifier_recipe_runs_without_torchrun_and_exits_0_quickly(tmp_path):
    # No torchrun, no process group: a plain python run from an empty directory writes nothing.
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(REPO / "recipes" / "train_classifier.py"), "--help"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    took = time.monotonic() - started
    print(f"recipes/train_classifier.py --help took {took:.1f} s")
    assert result.returncode == 0, result.stderr
    lines = setting_lines(result.stdout)
    assert lines["--model.dropout"] == "  --model.dropout  float >= 0, < 1  (default: 0.1)  [identity]"
    assert lines["--checkpoint.url"] == "  --checkpoint.url  str  (default: <run.root>/<run.name>/checkpoints)"
    assert "usage: train_classifier.py [--config FILE]" in result.stdout
    assert result.stderr == ""  # no logging set up, nothing started
    assert list(tmp_path.iterdir()) == []
    assert took < 60  # the imports of the recipe itself (torch, scikit-learn); nothing else starts


def test_a_config_field_that_is_not_a_section_is_a_type_error_at_class_definition_naming_it():
    with pytest.raises(TypeError, match=r"Loose.learning_rate: every field of a Config must be a section"):

        class Loose(Config):
            learning_rate: float = 0.1

    with pytest.raises(TypeError, match=r"MaybeOptim.optim: every field"):

        class MaybeOptim(Config):
            optim: Optim | None = None


# --- identity --------------------------------------------------------------------------------


def test_the_library_identity_is_the_seed_and_the_global_batch_size():
    assert Config().identity() == {"train.global_batch_size": 32, "train.seed": 1337}


def test_identity_collects_identity_sections_and_identity_fields_of_any_section():
    cfg = load_config(["--model.hidden=32", "--train.seed=7", "--optim.lr=0.3"], Settings)
    assert cfg.identity() == {
        "train.global_batch_size": 32,
        "train.seed": 7,
        "train.label_smoothing": 0.0,  # an IDENTITY field of the extended library section
        "model.hidden": 32,  # every field of an identity section
        "model.layers": 2,
    }


def test_identity_differences_name_changed_added_and_removed_fields():
    saved = {"train.seed": 1, "model.hidden": 64, "model.dropout": 0.1}
    now = {"train.seed": 2, "model.hidden": 64, "model.layers": 3}
    assert identity_differences(saved, now) == [
        "model.dropout: checkpoint 0.1, now (not set)",
        "model.layers: checkpoint (not set), now 3",
        "train.seed: checkpoint 1, now 2",
    ]
    assert identity_differences(now, dict(now)) == []
    assert identity_differences({"data.path": "a"}, {"data.path": "b"}) == ["data.path: checkpoint 'a', now 'b'"]


# --- an instance as the defaults -------------------------------------------------------------


def test_an_instance_passed_as_defaults_is_overridden_by_flags_and_derived_paths_follow_the_run_name():
    defaults = Settings(run={"name": "first", "root": "/runs"}, optim=Optim(lr=0.5), train={"max_steps": 77})
    assert defaults.checkpoint.url == "/runs/first/checkpoints"
    cfg = load_config(["--run.name=second", "--optim.momentum=0.5"], defaults)
    assert isinstance(cfg, Settings)
    assert (cfg.optim.lr, cfg.optim.momentum, cfg.train.max_steps) == (0.5, 0.5, 77)
    assert cfg.checkpoint.url == "/runs/second/checkpoints"
    assert cfg.logging.tensorboard_dir == "/runs/second/tensorboard"
    # The defaults are left as they were.
    assert (defaults.run.name, defaults.checkpoint.url) == ("first", "/runs/first/checkpoints")
    assert defaults.optim.momentum == 0.9


def test_an_explicit_path_in_the_defaults_does_not_follow_the_run_name():
    defaults = Config(run={"name": "first"}, checkpoint=CheckpointConfig(url="s3://bucket/kept"))
    cfg = load_config(["--run.name=second"], defaults)
    assert cfg.checkpoint.url == "s3://bucket/kept"
    assert cfg.logging.tensorboard_dir == "runs/second/tensorboard"


def test_an_assignment_to_a_defaults_section_survives_load_config():
    defaults = Settings()
    defaults.train.max_steps = 50
    assert load_config([], defaults).train.max_steps == 50


def test_config_is_neither_a_class_nor_an_instance_is_a_type_error():
    with pytest.raises(TypeError, match="config must be a Config subclass or instance"):
        load_config([], dict)


# --- the run's name --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "run_id,argv0,expected",
    [
        (None, "/jobs/recipes/train_classifier.py", "train_classifier"),
        ("", "/jobs/recipes/train.py", "train"),
        (str(uuid.uuid4()), "/jobs/recipes/train.py", "train"),  # torchrun --standalone: random each launch
        (str(uuid.uuid4()).upper(), "train.py", "train"),
        ("my-run", "/jobs/recipes/train.py", "my-run"),  # torchrun --rdzv-id=my-run
        (None, "-c", "default"),
    ],
    ids=["unset", "empty", "uuid", "uuid-upper", "rdzv-id", "no-script"],
)
def test_default_run_name_uses_a_given_run_id_and_otherwise_the_script_name(monkeypatch, run_id, argv0, expected):
    if run_id is None:
        monkeypatch.delenv(ENV_TORCHELASTIC_RUN_ID, raising=False)
    else:
        monkeypatch.setenv(ENV_TORCHELASTIC_RUN_ID, run_id)
    monkeypatch.setattr(sys, "argv", [argv0, "--train.max_steps=3"])
    assert default_run_name() == expected
    cfg = load_config([])
    assert cfg.run.name == expected and cfg.checkpoint.url == f"runs/{expected}/checkpoints"


# --- YAML out --------------------------------------------------------------------------------


def test_to_yaml_redacts_storage_options_in_every_section_and_round_trips_the_rest():
    cfg = RemoteSettings(
        checkpoint={"storage_options": {"key": "AKIA", "secret": SECRET}},
        data={"path": "s3://bucket/corpus", "storage_options": {"secret": SECRET}},
        remote={"url": "s3://bucket/x", "storage_options": {"token": SECRET}},
    )
    text = cfg.to_yaml()
    assert SECRET not in text and "AKIA" not in text
    expected = cfg.model_dump(mode="json")  # everything else as it is, keys of the options kept
    expected["checkpoint"]["storage_options"] = {"key": "<redacted>", "secret": "<redacted>"}
    expected["data"]["storage_options"] = {"secret": "<redacted>"}
    expected["remote"]["storage_options"] = {"token": "<redacted>"}
    assert yaml.safe_load(text) == expected
    assert cfg.checkpoint.storage_options["secret"] == SECRET  # the live config keeps its values


# --- the recipes' YAML files -----------------------------------------------------------------

CONFIGS = sorted((REPO / "recipes" / "configs").glob("*.yaml"))


def recipe_of(config: Path) -> Path:
    """The recipe a config file names in its comments (``recipes/<name>.py``)."""
    named = re.findall(r"recipes/(\w+)\.py", config.read_text())
    assert named, f"{config.name} does not name the recipe it is for (recipes/<name>.py) in a comment"
    return REPO / "recipes" / f"{named[0]}.py"


def import_recipe(path: Path, monkeypatch):
    # recipes/ is not a package: import the file by path, as a module of its own name.
    name = f"recipe_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def test_there_are_recipe_configs():
    assert {path.name for path in CONFIGS} >= {"classifier.yaml", "lm-gpu.yaml"}


def _flatten(data: dict) -> dict:
    return {f"{section}.{field}": value for section, fields in data.items() for field, value in fields.items()}


@pytest.mark.parametrize("config", CONFIGS, ids=[path.name for path in CONFIGS])
def test_every_recipe_config_loads_with_its_recipes_settings(config, monkeypatch):
    recipe = import_recipe(recipe_of(config), monkeypatch)
    cfg = load_config(["--config", str(config)], recipe.Settings)
    given = _flatten(yaml.safe_load(config.read_text()))
    loaded = _flatten(cfg.model_dump(mode="json"))
    assert {key: loaded[key] for key in given} == given
    # Flags after --config still win.
    assert load_config(["--config", str(config), "--train.max_steps=3"], recipe.Settings).train.max_steps == 3


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--data.prefetch_batches=4"], r"data.prefetch_batches \(4\) has no effect with data.num_workers=0"),
        (["--checkpoint.overwrite=true"], "checkpoint.overwrite=true has no effect with checkpoint.resume='auto'"),
        (["--checkpoint.resume=never", "--checkpoint.allow_identity_change=true"],
         "checkpoint.allow_identity_change=true has no effect with checkpoint.resume=never"),
        (["--train.max_steps=10", "--train.exit_at_step=20"], r"train.exit_at_step \(20\) has no effect"),
    ],
)
def test_a_setting_that_cannot_take_effect_is_an_error_naming_what_disables_it(flags, named):
    with pytest.raises(ConfigError, match=named):
        load_config(flags)


def test_values_given_by_a_defaults_instance_count_as_given_and_the_others_stay_defaults():
    defaults = Settings()
    defaults.checkpoint.memory_every_steps = 3
    cfg = load_config([], defaults)
    assert cfg.checkpoint.memory_every_steps == 3 and cfg.checkpoint.memory_asked
    assert not load_config([], Settings()).checkpoint.memory_asked


def test_data_on_change_refuses_unless_told_and_a_bad_value_names_the_field_and_the_choices():
    assert load_config([]).data.on_change == "refuse"
    assert load_config(["--data.on_change=next_epoch"]).data.on_change == "next_epoch"
    with pytest.raises(ConfigError) as raised:
        load_config(["--data.on_change=skip"])
    assert error_lines(raised) == ["  data.on_change: Input should be 'refuse' or 'next_epoch' (got 'skip')."]


def test_the_settings_that_belong_together_are_accepted_together():
    load_config(["--data.num_workers=2", "--data.prefetch_batches=4"])
    load_config(["--checkpoint.resume=never", "--checkpoint.overwrite=true"])
    load_config(["--train.max_steps=20", "--train.exit_at_step=20"])


def test_the_memory_tiers_node_derived_values_default_to_derived_and_each_can_be_forced():
    # A GPU node's values must run on CPUs (docs/memory-tier.md, "Derived from the node"): each
    # defaults to "derived" and takes the value a GPU node would derive.
    cfg = load_config([]).checkpoint
    assert (cfg.memory_write_threads, cfg.memory_read_threads, cfg.memory_direct_cost) == (0, 0, "auto")
    forced = load_config([
        "--checkpoint.memory_write_threads=4", "--checkpoint.memory_read_threads=2", "--checkpoint.memory_direct_cost=copies",
    ]).checkpoint  # fmt: skip
    assert (forced.memory_write_threads, forced.memory_read_threads, forced.memory_direct_cost) == (4, 2, "copies")
    assert not forced.memory_asked  # tuning, not a request for the tier: a node without room still turns it off
    for flag in ("--checkpoint.memory_write_threads=-1", "--checkpoint.memory_read_threads=-1",
                 "--checkpoint.memory_direct_cost=gpu"):  # fmt: skip
        with pytest.raises(ConfigError, match=flag.split("=")[0].removeprefix("--")):
            load_config([flag])
    # With the tier off they would do nothing: an error naming the field, never a silent no-op.
    for flag in ("--checkpoint.memory_write_threads=4", "--checkpoint.memory_read_threads=2",
                 "--checkpoint.memory_direct_cost=copies"):  # fmt: skip
        name = flag.split("=")[0].removeprefix("--")
        with pytest.raises(ConfigError, match=f"{name}.*has no effect: checkpoint.memory_overhead=0"):
            load_config([flag, "--checkpoint.memory_overhead=0"])
    # Their derived values are fine with the tier off.
    assert load_config(["--checkpoint.memory_write_threads=0", "--checkpoint.memory_overhead=0"]).checkpoint.memory_write_threads == 0
