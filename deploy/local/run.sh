#!/usr/bin/env bash
# A local elastic job on one machine: a bundled single-member etcd and NODES torchrun agents
# (default 2) joined through `--rdzv-backend=etcd`, exactly as separate machines would join.
#
#   deploy/local/run.sh [--section.field=value ...]      recipe flags are passed through
#
# Environment: NODES (2), NPROC_PER_NODE (1), RUN_ID (demo), ETCD_PORT (a free port),
# MAX_RESTARTS (3), RECIPE (recipes/train.py, the script every agent runs), RUN_ROOT (runs).
# Everything lands under $RUN_ROOT/$RUN_ID/: checkpoints, TensorBoard events, the agents' logs
# (node-*.log) and etcd's data. Ctrl-C stops the agents (they checkpoint first), then etcd.
set -euo pipefail
cd "$(dirname "$0")/../.."
source deploy/local/python.sh  # the interpreter install.sh installed into
put_scripts_on_path            # as if its environment were activated
nodes=${NODES:-2}
nproc=${NPROC_PER_NODE:-1}
run_id=${RUN_ID:-demo}
max_restarts=${MAX_RESTARTS:-3}
recipe=${RECIPE:-recipes/train.py}
port=${ETCD_PORT:-$("$python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
run_root=${RUN_ROOT:-runs}
run_dir="$run_root/$run_id"
mkdir -p "$run_dir"

pids=()
cleanup() {
    trap - EXIT INT TERM
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    wait "${pids[@]}" 2>/dev/null || true
    [ -n "${etcd_pid:-}" ] && kill -TERM "$etcd_pid" 2>/dev/null && wait "$etcd_pid" 2>/dev/null || true
}
trap cleanup EXIT INT TERM

# Each launch is a new job: etcd holds only the rendezvous, which a finished job closed (a launch
# after one that ran to the end would otherwise be refused); checkpoints live elsewhere.
rm -rf "$run_dir/etcd"
"$python" -m elastic_ddp.tools.cli etcd --data-dir "$run_dir/etcd" --port "$port" --peer-port 0 > "$run_dir/etcd.log" 2>&1 &
etcd_pid=$!
"$python" - "$port" <<'PY'
import socket, sys, time
deadline = time.monotonic() + 30
while True:
    try:
        socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=1).close()
        break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit(f"etcd did not start on 127.0.0.1:{sys.argv[1]}; see the etcd log.")
        time.sleep(0.2)
PY
echo "etcd on 127.0.0.1:$port; $nodes nodes; logs in $run_dir/"

for ((node = 0; node < nodes; node++)); do
    "$python" -m torch.distributed.run \
        --nnodes="1:$nodes" --nproc-per-node="$nproc" --max-restarts="$max_restarts" \
        --rdzv-backend=etcd --rdzv-endpoint="127.0.0.1:$port" --rdzv-id="$run_id" \
        "$recipe" --run.root="$run_root" --run.name="$run_id" "$@" > "$run_dir/node-$node.log" 2>&1 &
    pids+=($!)
done
tail -n +1 -f "$run_dir/node-0.log" --pid="${pids[0]}" &
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
