# Sourced by install.sh, test.sh and run.sh: sets $python, the interpreter the project is installed
# into and run with, the first of
#
#   1. $PYTHON                        an interpreter you name (make test PYTHON=/opt/py/bin/python);
#   2. $VENV                          a virtualenv directory, created when missing;
#   3. $VIRTUAL_ENV, $CONDA_PREFIX    the environment you activated;
#   4. .venv in the checkout          created on first use from python3.
#
# The machine's own Python is never written to. A virtualenv created here sees the machine's
# packages (--system-site-packages) only when that Python already has torch and no other
# $TORCH_VERSION is asked for, so a CUDA build (several GB) is used instead of installed a second
# time; otherwise it is isolated.
# Needs: bash, and python3 with its venv module (Debian/Ubuntu: apt-get install python3-venv).
# Also defines torch_version (the installed torch's version for $python, or "none") and
# put_scripts_on_path (what activating the environment would do: its console scripts, e.g. etcd,
# etcdctl and torchrun, first on PATH for the commands run after it).

_make_venv() {
    local dir=$1 base=python3 flags=()
    if [[ -z ${TORCH_VERSION:-} ]] && "$base" -c 'import torch' 2>/dev/null; then
        flags=(--system-site-packages)
    fi
    echo "Creating the virtualenv $dir from $("$base" -c 'import sys; print(sys.executable)') ${flags[*]}"
    "$base" -m venv "${flags[@]}" "$dir"
}

if [[ -n ${PYTHON:-} ]]; then
    python=$PYTHON
elif [[ -n ${VENV:-} ]]; then
    [[ -x $VENV/bin/python ]] || _make_venv "$VENV"
    python=$(cd "$VENV" && pwd)/bin/python
elif [[ -n ${VIRTUAL_ENV:-} && -x $VIRTUAL_ENV/bin/python ]]; then
    python=$VIRTUAL_ENV/bin/python
elif [[ -n ${CONDA_PREFIX:-} && -x $CONDA_PREFIX/bin/python ]]; then
    python=$CONDA_PREFIX/bin/python
else
    [[ -x .venv/bin/python ]] || _make_venv .venv
    python=$PWD/.venv/bin/python
fi

torch_version() { "$python" -c 'from importlib.metadata import version; print(version("torch"))' 2>/dev/null || echo none; }

put_scripts_on_path() {
    local scripts
    scripts=$("$python" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
    export PATH="$scripts:$PATH"
}
