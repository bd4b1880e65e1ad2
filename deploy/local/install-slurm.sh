#!/usr/bin/env bash
# Install a single-host Slurm for tests/setup/test_slurm_e2e.py: slurmctld, slurmd, the client commands
# (sbatch, srun, scontrol, scancel, squeue, sinfo) and munge, from the distribution's packages (Debian 12:
# Slurm 22.05). The tests start and stop their own daemons with a throwaway configuration; this
# script only installs, and stops any daemon the packages started.
#
#   deploy/local/install-slurm.sh          deploy/local/test.sh calls it before the tests
#
# Needs root and apt-get; anything else ends with an error naming what to install by hand.
set -euo pipefail
commands=(sbatch srun scontrol scancel squeue sinfo slurmctld slurmd munged mungekey)
missing() { for c in "${commands[@]}"; do command -v "$c" >/dev/null || echo "$c"; done; }
[[ -z $(missing) ]] && { echo "Slurm is installed ($(slurmd -V))"; exit 0; }

if [[ $(id -u) != 0 || -z $(command -v apt-get) ]]; then
    echo "error: Slurm is missing ($(missing | tr '\n' ' ')) and installing it needs root and apt-get;" \
         "install slurmctld, slurmd, slurm-client and munge (e.g. apt-get install slurmctld slurmd" \
         "slurm-client munge) and run again." >&2
    exit 1
fi
echo "Installing Slurm (slurmctld slurmd slurm-client munge) with apt-get"
export DEBIAN_FRONTEND=noninteractive
# A package's post-install may start its daemon (where an init system runs one): the tests start
# their own, so refuse service starts during the install (policy-rc.d, exit 101: "action forbidden").
policy=/usr/sbin/policy-rc.d
own_policy=0
if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && own_policy=1
fi
trap '((own_policy)) && rm -f "$policy"' EXIT
apt-get update -qq
apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge </dev/null
[[ -z $(missing) ]] || { echo "error: still missing after the install: $(missing | tr '\n' ' ')" >&2; exit 1; }
echo "Slurm is installed ($(slurmd -V))"
