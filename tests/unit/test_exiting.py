"""A worker's exit without the interpreter's teardown keeps what a script may rely on at its end:
other threads finish, ``atexit`` handlers run, and files left open are complete on disk."""

from __future__ import annotations

import gzip
import subprocess
import sys
import textwrap


import pytest


# prepare_exit: the open files searched for ahead of the exit (while a survivor waits for its
# restart); the files opened before it and those opened after it must both be complete.
@pytest.mark.parametrize("prepared", [False, True], ids=["searched-at-exit", "searched-ahead"])
def test_leaving_without_teardown_joins_threads_runs_atexit_and_completes_open_files(tmp_path, prepared):
    script = textwrap.dedent(f"""
        import atexit, gzip, threading, time, sys
        import torch  # the teardown being skipped is torch's
        from elastic_ddp.exiting import exit_without_teardown, prepare_exit

        root = {str(tmp_path)!r}
        text = open(root + "/text.txt", "w"); text.write("text left open")
        binary = open(root + "/binary.bin", "wb"); binary.write(b"binary left open")
        if {prepared}:
            prepare_exit()
        packed = gzip.open(root + "/packed.txt.gz", "wt"); packed.write("gzip left open " * 1000)
        appended = open(root + "/appended.txt", "a+"); appended.write("read-write left open")

        def late():
            time.sleep(0.5)
            with open(root + "/thread.txt", "w") as f:
                f.write("the thread finished")

        threading.Thread(target=late).start()  # not a daemon: Python waits for it at exit
        threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()  # a daemon: it does not
        atexit.register(lambda: open(root + "/atexit.txt", "w").write("atexit ran"))
        print("unflushed stdout", end="")
        sys.stderr.write("unflushed stderr")
        exit_without_teardown(3)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)

    assert done.returncode == 3, done.stderr
    assert done.stdout == "unflushed stdout"
    assert done.stderr.endswith("unflushed stderr")
    assert (tmp_path / "text.txt").read_text() == "text left open"
    assert (tmp_path / "binary.bin").read_bytes() == b"binary left open"
    assert (tmp_path / "appended.txt").read_text() == "read-write left open"
    with gzip.open(tmp_path / "packed.txt.gz", "rt") as packed:  # complete: its trailer was written
        assert packed.read() == "gzip left open " * 1000
    assert (tmp_path / "thread.txt").read_text() == "the thread finished"
    assert (tmp_path / "atexit.txt").read_text() == "atexit ran"
