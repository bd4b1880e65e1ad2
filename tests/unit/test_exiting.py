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
        from elastic_ddp.worker.exiting import exit_without_teardown, prepare_exit

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


def _leave(script: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=timeout)


def test_a_live_thread_pool_ends_at_the_exit_as_at_pythons_own(tmp_path):
    # Idle pool threads wait for work until concurrent.futures' threading exit hook wakes them:
    # joining them before the hook ran waited forever (torch.compile's inductor pool on CPUs, a
    # user's uploader, the memory tier's hashing pool on GPU nodes).
    done = _leave(f"""
        import atexit, concurrent.futures
        from elastic_ddp.worker.exiting import exit_without_teardown

        pool = concurrent.futures.ThreadPoolExecutor(4)
        assert pool.submit(lambda: 6 * 7).result() == 42
        atexit.register(lambda: open({str(tmp_path / "atexit.txt")!r}, "w").write("atexit ran"))
        exit_without_teardown(0, timeout_s=60)
    """, timeout=50)

    assert done.returncode == 0, done.stderr
    assert (tmp_path / "atexit.txt").read_text() == "atexit ran"
    assert "keep it alive" not in done.stderr


def test_the_hooks_run_newest_first_before_the_threads_are_joined_and_atexit_after(tmp_path):
    done = _leave("""
        import atexit, threading
        from elastic_ddp.worker.exiting import exit_without_teardown

        order = []
        release = threading.Event()
        worker = threading.Thread(target=lambda: (release.wait(), order.append("thread")))
        worker.start()
        threading._register_atexit(lambda: order.append("hook 1"))
        threading._register_atexit(lambda: (order.append("hook 2"), release.set()))
        atexit.register(lambda: print(" ".join(order + ["atexit"])))
        exit_without_teardown(0)
    """)

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "hook 2 hook 1 thread atexit"


def test_a_thread_that_never_ends_is_named_with_its_stack_and_the_exit_keeps_the_runs_status(tmp_path):
    done = _leave("""
        import atexit, threading, time
        from elastic_ddp.worker.exiting import exit_without_teardown

        def upload_forever():
            while True:
                time.sleep(0.05)

        threading.Thread(target=upload_forever, name="uploader").start()
        exit_without_teardown(5, timeout_s=1.0)
    """, timeout=60)

    assert done.returncode == 5, done.stderr
    assert "run.exit_timeout_s" in done.stderr
    assert 'Thread "uploader" (non-daemon thread)' in done.stderr
    assert "in upload_forever" in done.stderr
