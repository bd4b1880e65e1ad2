"""The channel on which a worker tells its agent that the node leaves: every report reaches the
agent's callback, a failing callback does not end the listener, and closing it removes the socket."""

from __future__ import annotations

import threading

import pytest

from elastic_ddp.processes import agent_pid
from elastic_ddp.rendezvous.leaving import LeavingListener
from elastic_ddp.worker.stop import ENV_AGENT_PID, ENV_SETTINGS_ERROR_DIR, LEAVING_SOCKET, report_leaving


def test_reports_reach_the_agent_until_it_stops_listening(tmp_path, monkeypatch):
    heard: list[str] = []
    arrived = threading.Semaphore(0)

    def on_leaving(why: str) -> None:
        heard.append(why)
        arrived.release()
        if len(heard) == 1:
            raise RuntimeError("etcd refused")  # the listener goes on

    listener = LeavingListener(str(tmp_path), on_leaving)
    monkeypatch.setenv(ENV_SETTINGS_ERROR_DIR, str(tmp_path))
    monkeypatch.setenv(ENV_AGENT_PID, str(agent_pid()))
    try:
        assert report_leaving("rank 0 stopped at step 5")
        assert report_leaving("rank 1 stopped at step 5")
        assert arrived.acquire(timeout=10) and arrived.acquire(timeout=10)
        assert heard == ["rank 0 stopped at step 5", "rank 1 stopped at step 5"]
    finally:
        listener.close()
    assert not (tmp_path / LEAVING_SOCKET).exists()
    assert not report_leaving("rank 0 stopped at step 6")  # nobody listens: nothing to tell


@pytest.mark.parametrize("env", [{}, {ENV_AGENT_PID: "1"}], ids=["no-agent-directory", "another-agent"])
def test_a_process_that_is_not_the_agents_worker_reports_nothing(tmp_path, monkeypatch, env):
    heard: list[str] = []
    listener = LeavingListener(str(tmp_path), heard.append)
    monkeypatch.delenv(ENV_SETTINGS_ERROR_DIR, raising=False)
    monkeypatch.delenv(ENV_AGENT_PID, raising=False)
    if env:  # a subprocess of a worker inherits the variables, but its parent is not the agent
        monkeypatch.setenv(ENV_SETTINGS_ERROR_DIR, str(tmp_path))
        for name, value in env.items():
            monkeypatch.setenv(name, value)
    try:
        assert not report_leaving("rank 0 stopped at step 5")
    finally:
        listener.close()
    assert heard == []
