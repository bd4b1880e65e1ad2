"""Run the chaos suite and the silent-loss tests and write what they show to docs/reliability.md.

    python benchmarks/reliability.py                      # everything, ~12 min; rewrites docs/reliability.md
    python benchmarks/reliability.py -k partition --out /tmp/rel.md   # some tests, elsewhere

Each scenario of the chaos suites is an integration test with real torchrun agents, etcd and
storage; when it passes it reports one JSON record (``tests/helpers/job.py:report``), after checking
that every committed checkpoint of its run still verifies. This script runs those tests with
``ELASTIC_DDP_RELIABILITY_OUT`` pointing at a temporary file and renders the records as a table.
The second table lists every way a job used to lose work without saying so, what it does now, and
the tests that show it -- with their result in this run.
Exit status: pytest's, so a failed test fails the run (and is listed in the document).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `elastic_ddp` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine_info  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CHAOS_SUITES = ("tests/chaos/test_chaos.py", "tests/chaos/test_memory_tier_e2e.py")

# (what could be lost silently, the behaviour before, the behaviour now, the tests that show it)
SILENT_LOSS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    (
        "a failed final save",
        "logged, then `done` and exit 0: the trained model was gone",
        "exit non-zero with one error naming the URL, the step and the cause (`ENOSPC`: the disk is full)",
        ("tests/chaos/test_silent_loss_e2e.py::test_a_full_disk_at_the_final_save_exits_nonzero_naming_url_step_and_full",
         "tests/integration/test_checkpoint_disk_full.py::test_disk_full_save_fails_cleanly_keeps_committed_and_recovers"),
    ),
    (
        "periodic saves that all fail",
        "a counter went up; a job could train for days with no checkpoint",
        "`checkpoint.max_failed_saves` (3) failures in a row stop the job non-zero",
        ("tests/chaos/test_silent_loss_e2e.py::test_periodic_saves_failing_in_a_row_stop_the_job",),
    ),
    (
        "nodes with their own disks behind a local `checkpoint.url`",
        "every checkpoint failed verification; training restarted from step 1 and replaced them",
        "every rank proves it sees the same storage at start; otherwise all stop before step 1",
        ("tests/chaos/test_silent_loss_e2e.py::test_nodes_with_their_own_disks_behind_a_local_url_stop_before_step_1",
         "tests/integration/test_checkpoint_shared_storage.py"),
    ),
    (
        "a new run on a URL holding another run's checkpoints",
        "its saves were skipped with a warning (or it resumed the old run)",
        "refused unless `checkpoint.overwrite=true`, which deletes the old ones first",
        ("tests/chaos/test_silent_loss_e2e.py::test_a_fresh_start_on_a_url_with_checkpoints_is_refused_and_overwrite_replaces_them",),
    ),
    (
        "a resume with changed seed, batch size, data or model shape",
        "the old run resumed under the new settings",
        "refused, naming each differing field and `checkpoint.allow_identity_change`",
        ("tests/chaos/test_silent_loss_e2e.py::test_a_resume_with_other_identity_settings_is_refused_naming_the_fields",),
    ),
    (
        "`torchrun --standalone` relaunched",
        "a new run directory per launch (torchrun's random run id): never resumed",
        "the run is named after the script; the same command resumes",
        ("tests/integration/test_your_model_e2e.py::test_standalone_trains_and_the_same_command_launched_again_resumes",),
    ),
    (
        "a killed worker under `torchrun --standalone`",
        "every restart failed to connect (shared agent store); --max-restarts spent, job died",
        "each round gets its own worker store; the group restarts, resumes and finishes",
        ("tests/integration/test_your_model_e2e.py::test_standalone_recovers_a_killed_worker_and_finishes",
         "tests/integration/test_rendezvous_plugin.py::test_loading_torchs_registry_gives_each_round_its_own_worker_store"),
    ),
    (
        "a second SIGTERM during the stop checkpoint",
        "the default action came back: the worker died mid-checkpoint",
        "later signals are logged and ignored; the stop checkpoint commits",
        ("tests/chaos/test_silent_loss_e2e.py::test_repeated_sigterms_to_the_worker_process_group_do_not_kill_the_stop_checkpoint",
         "tests/unit/test_stop.py::test_a_second_and_third_sigterm_while_stopping_are_logged_and_ignored"),
    ),
    (
        "a stop checkpoint longer than torchrun's window",
        "manifests assumed 60 s; torchrun gives 30 s on a membership change, whatever the flag",
        "`checkpoint.grace_s` 20 s fits both windows with margin; manifests nest their timeouts",
        ("tests/setup/test_deploy.py::test_torchrun_waits_for_the_final_checkpoint",
         "tests/setup/test_deploy.py::test_training_pods_outlive_the_final_checkpoint"),
    ),
    (
        "cleanup by a stale rank 0",
        "it could delete the new group's in-flight checkpoint",
        "cleanup and retention check the fence first",
        ("tests/unit/test_checkpoint_unit.py::test_a_stale_group_whose_save_fails_leaves_the_new_groups_directory_alone",
         "tests/unit/test_checkpoint_unit.py::test_a_stale_group_that_commits_before_a_takeover_skips_retention_and_the_leftover_sweep"),
    ),
    (
        "misleading endings",
        "\"Failure recovered\" on a continued run; Ctrl-C and joins printed `done steps=26/60`",
        "the summary says how the run ended (finished, stopped, paused, continued)",
        ("tests/chaos/test_silent_loss_e2e.py::test_extending_a_finished_run_continues_it_and_ctrl_c_says_stopped",),
    ),
    (
        "`elastic-ddp tensorboard` stopped by a signal",
        "its TensorBoard child kept serving, orphaned",
        "the signal is passed on; a child that ignores it is killed",
        ("tests/setup/test_setup_tensorboard_command.py",),
    ),
    (
        "set-up replacing the machine's torch",
        "`pip install -e .[test]` upgraded torch 2.13 to 2.14.1 with 4 GB of CUDA wheels",
        "installs pin the installed torch; `make test` fails if torch changed",
        ("tests/setup/test_setup_install.py",),
    ),
    (
        "the bundled etcd beside an unactivated venv",
        "\"The etcd binary was not found on PATH\"",
        "found next to the running interpreter",
        ("tests/setup/test_setup_etcd_lookup.py",),
    ),
)
ENV_OUT = "ELASTIC_DDP_RELIABILITY_OUT"
# Columns beyond the fixed ones: what a scenario measured besides recovery and lost steps.
EXTRA_LABELS = {
    "checkpoint_every": "checkpoint every {} steps",
    "dist_timeout_s": "dist.timeout_s={}",
    "detected_s": "detected after {} s",
    "survivor_training_again_s": "survivor training again after {} s",
    "steps_during_outage": "{} steps trained during the outage",
    "join_after_outage_s": "join after the outage trained in {} s",
    "rejoin_after_heal_s": "rejoined {} s after the link healed",
}


def _silent_loss_targets() -> list[str]:
    return sorted({test for *_, tests in SILENT_LOSS for test in tests})


def run_suite(records_file: Path, pytest_args: list[str]) -> tuple[int, str, set[str]]:
    """Run the chaos and silent-loss tests; pytest's exit status, its summary lines and the passed test ids."""
    suites = [suite for suite in CHAOS_SUITES if (REPO / suite).exists()]
    command = [sys.executable, "-m", "pytest", *suites, *_silent_loss_targets(), "-p", "no:cacheprovider", "-q", "-rA",
               *pytest_args]  # fmt: skip
    env = {**os.environ, ENV_OUT: str(records_file)}
    print("+", " ".join(command), flush=True)
    proc = subprocess.run(command, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    sys.stdout.write(proc.stdout)
    lines = proc.stdout.splitlines()
    passed = {line.split()[1] for line in lines if line.startswith("PASSED ")}
    summary = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    tail = proc.stdout.strip().splitlines()[-1:] if proc.stdout.strip() else []
    return proc.returncode, "\n".join([*summary, *tail]), passed


def _outcome(tests: tuple[str, ...], passed: set[str]) -> str:
    """"passes" when every listed test (a file: every test in it) passed in this run."""
    def ok(test: str) -> bool:
        return any(p == test or p.startswith(test + "[") or p.startswith(test + "::") for p in passed)

    return "passes" if all(ok(test) for test in tests) else "**did not pass**"


def _cell(value: Any, unit: str = "") -> str:
    if value is None:
        return "—"
    return f"{value}{unit}"


def render(
    records: list[dict[str, Any]], status: int, summary: str, passed: set[str], machine: dict[str, Any], command: str
) -> str:
    suites = ", ".join(f"`{suite}`" for suite in CHAOS_SUITES)
    lines = [
        "# Reliability: what each failure costs",
        "",
        f"Regenerated by `{command}` — every row is a passing integration test of {suites} with real",
        "torchrun agents (one per node), a real etcd and real storage (local disk; S3 API via moto), on",
        f"{machine['cores']} cores / {machine['mem_gib']} GiB, {machine['cpu']}, torch {machine['torch']}, "
        f"etcd {machine['etcd']}, {machine['date']}.",
        "",
        "* **recovery s**: from the failure (signal sent, link cut) to the first training step after it, as",
        "  seen in rank 0's log (for orphans: until the orphaned workers are gone).",
        "* **steps lost**: steps trained before the failure that are trained again after it.",
        "* **data lost**: after the scenario every node is killed (mid-save, perhaps) and every committed",
        "  checkpoint of the run is verified against its manifest; a damaged one fails the test, so a row",
        "  exists only when nothing committed was lost.",
        "",
        "| scenario | behaviour | recovery s | steps lost | data lost | also measured |",
        "|---|---|---|---|---|---|",
    ]
    for r in records:
        extra = [EXTRA_LABELS[k].format(r[k]) for k in EXTRA_LABELS if r.get(k) is not None]
        count = r['checkpoints_verified']
        extra.append(f"{count} committed checkpoint{'' if count == 1 else 's'} verified")
        lines.append(
            f"| {r['scenario']} | {r['behaviour']} | {_cell(r['recovery_s'])} | {_cell(r['steps_lost'])} "
            f"| {r['data_lost']} | {'; '.join(extra)} |"
        )
    lines.append("")
    if status != 0:
        lines += ["**Not all scenarios passed in this run** (pytest exit status %d):" % status, "", "```", summary, "```", ""]
    lines += [
        "Why the figures are what they are: a preemption or a join is a cooperative stop (a checkpoint of",
        "the agreed step, then a restart at the new size), so nothing is redone; a hard loss redoes the",
        "steps since the newest committed checkpoint (at most two intervals, as a save of step N runs in",
        "the background while the next ones train); a hang and a partition are detected by the collective",
        "timeout (`dist.timeout_s`, 10 s in those tests), and torchrun then waits a fixed 30 s before it",
        "SIGKILLs a worker that ignores SIGTERM. Rendezvous timings: [rendezvous.md](rendezvous.md).",
        "",
        "## Silent loss",
        "",
        "Every way a job could lose work while saying nothing (exit 0, or a warning), what it does now,",
        "and the tests that show it, with their result in this run. A failure the user must know about",
        "ends in a non-zero exit and one clear message.",
        "",
        "| what | before | now | tests | result |",
        "|---|---|---|---|---|",
    ]
    for what, before, now, tests in SILENT_LOSS:
        names = "<br>".join(f"`{test}`" for test in tests)
        lines.append(f"| {what} | {before} | {now} | {names} | {_outcome(tests, passed)} |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "docs" / "reliability.md"), help="Markdown file to write.")
    parser.add_argument("-k", dest="select", help="pytest -k expression: only these scenarios.")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        records_file = Path(tmp) / "records.jsonl"
        records_file.touch()
        status, summary, passed = run_suite(records_file, ["-k", args.select] if args.select else [])
        records = [json.loads(line) for line in records_file.read_text().splitlines() if line.strip()]
    if not records:
        print("error: no scenario reported a measurement", file=sys.stderr)
        return status or 1
    command = "python benchmarks/reliability.py" + (f" -k {args.select!r}" if args.select else "")
    Path(args.out).write_text(render(records, status, summary, passed, machine_info(), command))
    print(f"wrote {args.out}: {len(records)} scenarios")
    return status


if __name__ == "__main__":
    sys.exit(main())
