"""Configuration errors name the field and what was expected, and never echo a credential."""

from __future__ import annotations

import pytest
import yaml

from elastic_ddp.config import ConfigError, load_config

SECRET = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"


def test_a_bad_value_is_named_with_the_value_it_got():
    with pytest.raises(ConfigError, match=r"train.max_steps: .*\(got 'many'\)"):
        load_config(["--train.max_steps=many"])


def test_an_unknown_setting_is_named_without_its_value(tmp_path):
    # A mistyped "storage_options" carries the same credentials as the real one.
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({"checkpoint": {"storage_option": {"secret": SECRET}}}))
    with pytest.raises(ConfigError) as raised:
        load_config([f"--config={config}"])
    assert "checkpoint.storage_option: unknown setting." in str(raised.value)
    assert SECRET not in str(raised.value)


@pytest.mark.parametrize("section", ["checkpoint", "data"])
def test_malformed_storage_options_are_named_without_their_value(section):
    with pytest.raises(ConfigError) as raised:
        load_config([f"--{section}.storage_options={SECRET}"])
    assert f"{section}.storage_options:" in str(raised.value) and "value not shown" in str(raised.value)
    assert SECRET not in str(raised.value)
