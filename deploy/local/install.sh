#!/usr/bin/env bash
# Install elastic_ddp and what it needs into the current Python environment.
#
#   deploy/local/install.sh [EXTRAS]     EXTRAS defaults to "s3,etcd"; the test suite uses "test".
#
# torch is installed only when it is missing, so a machine that already has a build (CPU or CUDA)
# keeps it; where none is installed, torch==2.13.0 is asked for by its exact version, which takes
# a local CPU wheel where the machine provides one instead of downloading a multi-GB CUDA build.
set -euo pipefail
extras=${1:-s3,etcd}
python=${PYTHON:-python3}
cd "$(dirname "$0")/../.."

stamp=".install-stamp"
want="$(sha256sum pyproject.toml | cut -c1-16) $extras $($python -c 'import sys; print(sys.prefix)')"
# The installed package must be this checkout (an editable install of a moved or deleted clone
# would otherwise pass): import it from outside the repository and compare where it lives.
installed_from() { (cd / && $python -c "import elastic_ddp, os, torch; print(os.path.dirname(elastic_ddp.__path__[0]))" 2>/dev/null); }
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ "$(installed_from)" = "$PWD" ]; then
    exit 0
fi
if ! $python -c "import torch" 2>/dev/null; then
    $python -m pip install --no-input "torch==2.13.0"
fi
$python -m pip install --no-input -e ".[$extras]"
echo "$want" > "$stamp"
