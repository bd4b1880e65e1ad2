"""deploy/local/run.sh, the README's main command: a bundled etcd and torchrun agents joined through it.

The script starts etcd and the agents itself; each launch runs as a node (:func:`start_node`) so a
hang or a failure leaves no process behind.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.helpers.job import REPO, TINY, env
from tests.helpers.nodes import start_node

RUN_SH = REPO / "deploy" / "local" / "run.sh"


def launch(tmp_path, name: str, *flags: str) -> str:
    """One launch of the local job (one node); its output, after checking it ended well."""
    environment = env(PYTHON=sys.executable, NODES="1", RUN_ID="demo", RUN_ROOT=str(tmp_path), MAX_RESTARTS="0")
    with start_node(["bash", str(RUN_SH), *TINY, "--checkpoint.every_steps=5", *flags], environment,
                    tmp_path / f"{name}.log") as node:  # fmt: skip
        code = node.wait(200)
        output = node.output()
    assert code == 0, output[-4000:]
    return output


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_launch_after_one_that_ran_to_the_end_resumes_where_it_stopped(tmp_path):
    # A job that ran to the end closes its rendezvous in etcd; the next launch is a new job and
    # must not be refused for it (the script gives each launch a fresh etcd).
    launch(tmp_path, "first", "--train.max_steps=10")
    launch(tmp_path, "second", "--train.max_steps=15")
    records = [json.loads(line) for line in (tmp_path / "demo" / "failures.jsonl").read_text().splitlines()]
    assert [(r["tier"], r["step"], r["steps_redone"]) for r in records if r.get("kind") == "resume"] == [("durable", 10, 0)]
