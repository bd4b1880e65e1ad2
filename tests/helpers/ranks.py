"""Run a script as the ranks of one gloo process group, without torchrun.

The script reads ``sys.argv[1]`` (its rank) and ``sys.argv[2]`` (a ``FileStore`` path for
``dist.init_process_group``), then any further arguments given to :func:`run_ranks`. Every rank
is its own process, so a test sees the real collectives; every process is gone when this returns.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

__all__ = ["run_ranks"]


def run_ranks(
    tmp_path: Path, script: str, world_size: int, *args: str, timeout: float = 120, check: bool = True
) -> list[subprocess.CompletedProcess]:
    """Start ``world_size`` ranks of ``script`` and wait for all of them; one result per rank.

    With ``check``, a rank that exited non-zero fails the test with its stderr. The ranks' stderr
    is kept apart from stdout, which is left to what the script prints.
    """
    path = tmp_path / f"ranks-{os.getpid()}-{len(list(tmp_path.glob('ranks-*.py')))}.py"
    path.write_text(textwrap.dedent(script))
    store = str(tmp_path / f"{path.stem}.store")
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    ranks = [
        subprocess.Popen([sys.executable, str(path), str(rank), store, *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for rank in range(world_size)
    ]  # fmt: skip
    try:
        outputs = [rank.communicate(timeout=timeout) for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
    results = [subprocess.CompletedProcess(rank.args, rank.returncode, out, err) for rank, (out, err) in zip(ranks, outputs)]
    if check:
        for number, result in enumerate(results):
            assert result.returncode == 0, f"rank {number} exited with {result.returncode}:\n{result.stderr[-4000:]}"
    return results
