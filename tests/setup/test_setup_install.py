"""Set-up: installing the project keeps an installed torch, and the declared torch range is the tested one.

The torch range lives in three places that must agree: pyproject.toml's requirement, the torch
deploy/local/install.sh installs where none is present (the oldest of the range, the one the whole
suite runs on) and the Makefile's TORCH_NEWEST (the rendezvous and checkpoint tests run on it too).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
import venv
from importlib.metadata import distribution
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
EXTRAS: dict[str, list[Requirement]] = {
    name: [Requirement(r) for r in requirements]
    for name, requirements in PYPROJECT["project"]["optional-dependencies"].items()
}


def _torch_requirement() -> Requirement:
    (torch,) = [r for r in map(Requirement, PYPROJECT["project"]["dependencies"]) if r.name == "torch"]
    return torch


def _oldest_tested() -> Version:
    match = re.search(r'"torch==\$\{TORCH_VERSION:-([\d.]+)\}"', (REPO / "deploy/local/install.sh").read_text())
    assert match, "deploy/local/install.sh no longer installs torch==${TORCH_VERSION:-X} where torch is missing"
    return Version(match[1])


def _newest_tested() -> Version:
    match = re.search(r"^TORCH_NEWEST := ([\d.]+)$", (REPO / "Makefile").read_text(), flags=re.MULTILINE)
    assert match, "the Makefile no longer sets TORCH_NEWEST := X.Y.Z"
    return Version(match[1])


def test_no_extra_names_the_project_itself():
    # A self-referencing extra made pip replace an installed torch with the newest CUDA build.
    project = canonicalize_name(PYPROJECT["project"]["name"])
    for extra, requirements in EXTRAS.items():
        assert project not in {canonicalize_name(r.name) for r in requirements}, f"extra {extra!r} names the project"


def test_the_test_extra_includes_every_other_extra():
    test = {str(r) for r in EXTRAS["test"]}
    for extra, requirements in EXTRAS.items():
        missing = {str(r) for r in requirements} - test
        assert not missing, f"the test extra lacks {sorted(missing)} of the {extra!r} extra"


def test_the_examples_extra_brings_scikit_learn():
    (sklearn,) = [r for r in EXTRAS["examples"] if r.name == "scikit-learn"]
    assert sklearn.specifier.contains("1.3") and not sklearn.specifier.contains("1.2.2")


def test_the_declared_torch_range_is_exactly_the_tested_minor_releases():
    specifier = _torch_requirement().specifier
    oldest, newest = _oldest_tested(), _newest_tested()
    assert oldest < newest
    for tested in (oldest, newest):
        assert specifier.contains(tested), f"pyproject's torch{specifier} excludes the tested torch {tested}"
    before = f"{oldest.major}.{oldest.minor - 1}.99"
    after = f"{newest.major}.{newest.minor + 1}.0"
    assert not specifier.contains(before), f"torch{specifier} admits {before}, older than any tested release"
    assert not specifier.contains(after), f"torch{specifier} admits {after}, newer than any tested release"


def test_the_newest_torch_run_selects_rendezvous_and_checkpoint_tests():
    recipe = (REPO / "Makefile").read_text().split("test-torch-newest:", 1)[1]
    globs = re.findall(r"tests/\*/test_\w+\*\.py", recipe)
    assert sorted(globs) == ["tests/*/test_checkpoint_*.py", "tests/*/test_rendezvous_*.py"]
    for pattern in globs:
        assert sorted(REPO.glob(pattern)), f"{pattern} matches no test file"


def test_installing_every_extra_keeps_an_installed_torch(tmp_path):
    """pip's own plan (``--dry-run --report``) in a fresh virtualenv that holds this torch's metadata."""
    root = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
    python = root / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    # pip decides from the installed metadata alone: the dist-info is what "torch is installed" means to it.
    torch = distribution("torch")
    (metadata,) = [f for f in torch.files if f.name == "METADATA" and f.parent.name.endswith(".dist-info")]
    dist_info = Path(metadata.locate()).parent
    shutil.copytree(dist_info, Path(purelib) / dist_info.name)
    report = tmp_path / "report.json"
    extras = ",".join(EXTRAS)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--dry-run", "--quiet", "--no-input",
         "--report", str(report), f"{REPO}[{extras}]"],
        capture_output=True, text=True, timeout=280, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    planned = {item["metadata"]["name"]: item["metadata"]["version"] for item in json.loads(report.read_text())["install"]}
    assert "elastic-ddp" in planned
    assert "torch" not in planned, f"pip would replace torch {torch.version} with {planned['torch']}"
    assert not [name for name in planned if name.startswith("nvidia-")], sorted(planned)


def test_every_declared_entry_point_loads_and_the_console_command_runs():
    # The console command and torchrun's handler names point at modules by path: a module that moved
    # without its entry point would leave the installed command or `--rdzv-backend=etcd` broken.
    from importlib.metadata import EntryPoint

    declared = [("console_scripts", name, target) for name, target in PYPROJECT["project"]["scripts"].items()] + [
        (group, name, target)
        for group, entries in PYPROJECT["project"]["entry-points"].items()
        for name, target in entries.items()
    ]
    assert declared
    for group, name, target in declared:
        assert callable(EntryPoint(name, target, group).load()), f"{group} {name} = {target}"
    installed = {(e.group, e.name): e.value for e in distribution("elastic-ddp").entry_points}
    assert all(installed.get((group, name)) == target for group, name, target in declared), installed
    command = Path(sys.executable).parent / "elastic-ddp"
    done = subprocess.run([str(command), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ckpt" in done.stdout and "tensorboard" in done.stdout, done.stderr
