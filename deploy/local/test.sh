#!/usr/bin/env bash
# The README's test command (`make test`): install the `test` extra (deploy/local/install.sh) into
# the interpreter deploy/local/python.sh picks, run pytest with the given arguments (default: the
# whole suite), and prove that the run ended with the torch it started with.
#
#   deploy/local/test.sh [PYTEST_ARGS ...]
#
# torch is printed at the start, after the install and at the end. The command fails when an
# installed torch was replaced, when torch changed during the tests, or when pytest fails
# (including pytest's "no tests collected", exit 5).
set -euo pipefail
cd "$(dirname "$0")/../.."
source deploy/local/python.sh

started=$(torch_version)
echo "torch at the start: $started ($python)"
bash deploy/local/install.sh test
installed=$(torch_version)
echo "torch after the install: $installed"
if [[ $started != none && $started != "$installed" ]]; then
    echo "error: the install replaced torch $started with $installed." >&2
    exit 1
fi

# A one-host Slurm for tests/setup/test_slurm_e2e.py (needs root and apt-get; without them those tests
# fail, saying what to install).
# `make test-fast` (ELASTIC_DDP_TEST_SLURM=0) runs no Slurm test and skips it.
[[ ${ELASTIC_DDP_TEST_SLURM:-1} == 0 ]] ||
    bash deploy/local/install-slurm.sh || echo "warning: Slurm is not installed; tests/setup/test_slurm_e2e.py will fail." >&2

# Two pytest workers (pytest-xdist), each a whole test file at a time (a module's fixtures, such as
# a job several tests inspect, run once). On a 2-core host the suite took 37 minutes one test after
# another, 28 on two workers -- one fills the other's waits for a lease to expire, a timeout a test
# provokes, a peer's start -- and 31 on three, with the cores 98 % busy: past two, workers only
# slow each other down. At most 2 by default, the count the suite's timeouts were sized with;
# ELASTIC_DDP_TEST_WORKERS=N sets it, and 0 or 1 runs every test in pytest's own process (a
# debugger's breakpoints need that).
cores=$(nproc)
workers=${ELASTIC_DDP_TEST_WORKERS:-$((cores < 2 ? cores : 2))}
[[ $workers =~ ^[0-9]+$ ]] || {
    echo "error: ELASTIC_DDP_TEST_WORKERS=$workers: expected a whole number of pytest workers (0 or 1: none)." >&2
    exit 2
}
parallel=()
((workers < 2)) || parallel=(-n "$workers" --dist loadfile)

status=0
put_scripts_on_path  # tests and the processes they start find etcdctl, moto_server, ... as when activated
"$python" -m pytest "${parallel[@]}" "$@" || status=$?

ended=$(torch_version)
echo "torch at the end: $ended"
if [[ $ended != "$installed" ]]; then
    echo "error: torch changed from $installed to $ended while the tests ran." >&2
    exit 1
fi
exit "$status"
