#!/usr/bin/env bash
# Install elastic_ddp (editable) and what it needs into the interpreter deploy/local/python.sh picks.
#
#   deploy/local/install.sh [EXTRAS]     EXTRAS defaults to "s3,etcd"; the test suite uses "test".
#
# torch is installed only when it is missing: torch==$TORCH_VERSION (default 2.13.0, the oldest
# torch this project is tested with; by exact version, which takes a local CPU wheel where the
# machine provides one instead of downloading a multi-GB CUDA build). An installed torch is then
# pinned by a constraint generated here, so no extra can replace it; pip fails instead.
# deploy/local/constraints.txt pins the S3 client stack, which resolves slowly when left open.
set -euo pipefail
extras=${1:-s3,etcd}
cd "$(dirname "$0")/../.."
source deploy/local/python.sh
constraints=deploy/local/constraints.txt

stamp=".install-stamp-$("$python" -c 'import sys; print(sys.prefix)' | sha256sum | cut -c1-12)"  # one per environment
stamp_key() { echo "$(cat pyproject.toml "$constraints" | sha256sum | cut -c1-16) $extras $("$python" -c 'import sys; print(sys.prefix)') $(torch_version)"; }
# The installed package must be this checkout (an editable install of a moved or deleted clone
# would otherwise pass): import it from outside the repository and compare where it lives.
installed_from() { (cd / && "$python" -c "import elastic_ddp, os; print(os.path.dirname(elastic_ddp.__path__[0]))" 2>/dev/null); }
if [[ -f $stamp && $(cat "$stamp") == "$(stamp_key)" && $(installed_from) == "$PWD" ]]; then
    echo "elastic_ddp[$extras] is installed for $python (torch $(torch_version))"
    exit 0
fi

if [[ $(torch_version) == none ]]; then
    "$python" -m pip install --no-input --progress-bar off "torch==${TORCH_VERSION:-2.13.0}"
fi
torch=$(torch_version)
[[ $torch != none ]] || { echo "error: torch is not installed for $python although pip installed it." >&2; exit 1; }
if [[ -n ${TORCH_VERSION:-} && ${torch%%+*} != "$TORCH_VERSION" ]]; then
    echo "error: TORCH_VERSION=$TORCH_VERSION was asked for, but $python has torch $torch; use a fresh VENV." >&2
    exit 1
fi
pin=$(mktemp)
trap 'rm -f "$pin"' EXIT
echo "torch==$torch" > "$pin"
echo "Installing elastic_ddp[$extras] for $python, keeping torch $torch"
"$python" -m pip install --no-input --progress-bar off -c "$pin" -c "$constraints" -e ".[$extras]"
if [[ $(torch_version) != "$torch" ]]; then
    echo "error: installing elastic_ddp[$extras] changed torch from $torch to $(torch_version)." >&2
    exit 1
fi
stamp_key > "$stamp"
