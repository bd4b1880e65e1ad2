"""A fork of the template watches its script's environment until it is settled: a change of what
the template's imports read ends it with the reason on the relay's pipe (prestart/environment.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def _armed_script(body: str) -> tuple[subprocess.CompletedProcess, str]:
    """Run ``body`` in a process armed as a fork would be (names read at import: EDP_TEST_READ);
    return the process and what it wrote to the relay's pipe."""
    note, note_for_script = os.pipe()
    script = textwrap.dedent("""
        import os, sys
        os.environ["EDP_TEST_READ"] = "before"  # the worker's environment, set before arming
        os.environ.pop("KMP_DUPLICATE_LIB_OK", None)
        from elastic_ddp.prestart.environment import arm, settle
        arm(frozenset({"EDP_TEST_READ"}), int(sys.argv[1]))
    """) + textwrap.dedent(body)
    try:
        done = subprocess.run([sys.executable, "-c", script, str(note_for_script)], pass_fds=[note_for_script],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
    finally:
        os.close(note_for_script)
    with os.fdopen(note, "rb") as pipe:
        return done, pipe.read().decode()


def test_a_change_of_a_variable_read_at_import_ends_the_fork_with_the_reason():
    done, note = _armed_script("""
        os.environ["EDP_TEST_OWN"] = "1"         # nothing imported read it: no fresh start needed
        import threadpoolctl                     # an installed package sets KMP_DUPLICATE_LIB_OK: not the script
        assert os.environ["KMP_DUPLICATE_LIB_OK"] == "True"
        os.environ["EDP_TEST_READ"] = "before"   # the same value: nothing changes
        print("reached", flush=True)
        os.environ["EDP_TEST_READ"] = "after"
        print("not reached", flush=True)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "reached\n"
    assert "the script sets EDP_TEST_READ before torch is imported" in note


def test_a_variable_native_libraries_read_as_they_load_counts_and_so_does_a_removal():
    done, note = _armed_script("""
        os.environ.pop("OMP_NUM_THREADS", None)
        os.environ.setdefault("OMP_NUM_THREADS", "3")
        print("not reached", flush=True)
    """)
    assert "not reached" not in done.stdout
    assert "sets OMP_NUM_THREADS" in note and "a library torch loads reads it" in note

    done, note = _armed_script("""
        del os.environ["EDP_TEST_READ"]
        print("not reached", flush=True)
    """)
    assert "not reached" not in done.stdout
    assert "removes EDP_TEST_READ" in note


def test_once_settled_or_in_a_forked_child_changes_are_the_scripts_own():
    done, note = _armed_script("""
        pid = os.fork()
        if pid == 0:  # a DataLoader worker, say
            os.environ["EDP_TEST_READ"] = "in the child"
            os._exit(7)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 7
        settle()  # what edp.launch() does first
        os.environ["EDP_TEST_READ"] = "after launch"
        print("reached", flush=True)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "reached\n"
    assert note == ""
