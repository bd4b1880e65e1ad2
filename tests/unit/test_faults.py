"""ELASTIC_DDP_FAULT: one grammar for a fault at a training step and at a named point of a save."""

from __future__ import annotations

import threading

import pytest

from elastic_ddp.faults import ENV_FAULT, Fault, InjectedFault, at_point, at_step, parse_faults


def test_a_step_and_a_point_parse_with_their_options():
    assert parse_faults("raise@12:rank=1:restart=0") == (Fault("raise", 12, rank=1, restart=0),)
    assert parse_faults("kill@before_manifest") == (Fault("kill", "before_manifest"),)
    assert parse_faults("wait@mid_write:rank=2:until=/tmp/a:b,hang@6:restart=0") == (
        Fault("wait", "mid_write", rank=2, until="/tmp/a:b"),
        Fault("hang", 6, restart=0),
    )


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("explode@3", "is not"),
        ("raise@somewhere", "points: before_write"),
        ("raise@3:rnak=1", "unknown option 'rnak=1'"),
        ("wait@before_write", "'wait' needs ':until=PATH'"),
        ("kill@3:until=/x", "only 'wait' takes it"),
    ],
)
def test_a_malformed_value_is_a_value_error_naming_what_is_wrong(text, named):
    with pytest.raises(ValueError, match=ENV_FAULT) as caught:
        parse_faults(text)
    assert named in str(caught.value)


def test_unset_or_elsewhere_does_nothing(monkeypatch):
    monkeypatch.delenv(ENV_FAULT, raising=False)
    at_step(3, 0)
    at_point("before_write", 0)
    monkeypatch.setenv(ENV_FAULT, "raise@3:rank=1,raise@after_write:restart=2")
    at_step(3, 0)  # another rank
    at_step(4, 1)  # another step
    at_point("before_write", 0)  # another point
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    at_point("after_write", 0)  # another attempt


def test_raise_at_a_step_and_at_a_point(monkeypatch):
    monkeypatch.setenv(ENV_FAULT, "raise@8,raise@after_manifest:rank=1")
    with pytest.raises(InjectedFault, match="injected failure at step 8 on rank 0"):
        at_step(8, 0)
    with pytest.raises(InjectedFault, match="injected failure at after_manifest on rank 1"):
        at_point("after_manifest", 1)


def test_wait_holds_until_its_file_exists(monkeypatch, tmp_path):
    release = tmp_path / "release"
    monkeypatch.setenv(ENV_FAULT, f"wait@before_manifest:until={release}")
    held = threading.Thread(target=at_point, args=("before_manifest", 0), daemon=True)
    held.start()
    held.join(0.3)
    assert held.is_alive()
    release.touch()
    held.join(5)
    assert not held.is_alive()
