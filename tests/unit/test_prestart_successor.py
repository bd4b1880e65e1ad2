"""When a template starts its warm successor (elastic_ddp.prestart.template._Successor.due), in this
process: the template and its successor run in tests/integration/test_prestart.py."""

from __future__ import annotations

from elastic_ddp.prestart import template


def test_the_successor_starts_after_the_first_fork_when_asked_or_after_a_while_and_only_once(tmp_path, monkeypatch):
    def fresh(asked: list[bool]) -> template._Successor:
        return template._Successor(str(tmp_path / "prestart.sock"), 1, asked)

    monkeypatch.setattr(template, "START_AFTER_S", 3600.0)
    assert not fresh([]).due()  # just started serving: its first workers may be on their way
    assert fresh([True]).due()  # SIGUSR1: the agent of a node joining a running job asks
    forked = fresh([])
    forked.worker_forked()  # the node trains: the next restart should find the rest imported
    assert forked.due()
    monkeypatch.setattr(template, "START_AFTER_S", 0.0)
    assert fresh([]).due()  # nobody asked for a while: the agent waits for its peers
    forked.pid = 12345  # started
    assert not forked.due()
