"""Static checks of everything under deploy/ (Docker, Kubernetes, Slurm, the deploy README).

Nothing here needs a cluster: manifests are validated offline against Kubernetes' published
schemas (kubernetes-validate), every torchrun line is parsed by torchrun's own argument parser and
its recipe flags by the config model, and the overlays are rendered with `kubectl kustomize` when
kubectl is installed. The whole module runs in a few seconds.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from elastic_ddp.config import load_config

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
SBATCH = DEPLOY / "slurm" / "train.sbatch"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
README = DEPLOY / "README.md"

# The newest Kubernetes release whose schemas kubernetes-validate bundles (1.37.0 in 1.37.x); the
# manifests use nothing newer than successPolicy (GA in 1.33), so any recent cluster accepts them.
K8S_VERSION = "1.37.0"
# Custom resources have no bundled schema; their structure is checked by hand below.
CRD_GROUPS = ("kubeflow.org/",)
RECIPE = "recipes/train.py"
# What torchrun gives a worker between SIGTERM and SIGKILL, measured by benchmarks/bench_grace.py
# (torch 2.13.0 and 2.14.1; deploy/README.md, "Timeouts that must nest"): --shutdown-timeout when
# the agent itself is signalled (30 s when neither flag nor env is set), and a fixed 30 s when it
# restarts its workers for a membership change (a node joins or leaves), whatever the flag says.
DEFAULT_TORCHRUN_SHUTDOWN_S = 30
TORCHRUN_RESTART_GRACE_S = 30
# A worker whose checkpoint.grace_s ran out still has to exit: margin before torchrun's SIGKILL.
WORKER_EXIT_MARGIN_S = 5
# The agent exits about a second after its workers' SIGKILL (measured); leaving the rendezvous,
# flushing logs and a loaded node get the rest before the orchestrator's SIGKILL.
AGENT_EXIT_MARGIN_S = 15
# After the agents exit: srun winding the step down and `scontrol requeue`, before the time limit.
SLURM_REQUEUE_MARGIN_S = 30

# Plausible values for the shell variables that torchrun lines in deploy/ refer to (the Slurm
# script and README examples). Kubernetes' $(VAR) references are resolved from the container's
# own env list instead. A variable that is in neither fails the test: add it here, explicitly.
SHELL_VALUES = {
    "ETCD_ENDPOINT": "etcd1.cluster.example:2379",
    "ETCD_TLS_DIR": "/home/alice/.elastic-ddp/etcd-tls",
    "ETCD_USER": "elastic-ddp",
    "MIN_NODES": "2",
    "SLURM_JOB_NUM_NODES": "4",
    "SLURM_JOB_ID": "123456",
    "GPUS_PER_NODE": "8",
    "CHECKPOINT_URL": "s3://elastic-ddp-checkpoints/runs/slurm-123456",
    "TENSORBOARD_DIR": "/home/alice/elastic-ddp/tensorboard/slurm-123456",
    "ETCD": "etcd-client:2379",
    "RUN_ID": "example-run",
    "TLS": "/etc/elastic-ddp/etcd-tls",
    "IMAGE": "ghcr.io/example/elastic-ddp:0.1.0",
}

# Env names that carry credentials: only ever from a Secret (secretKeyRef) in manifests.
SECRET_ENV = re.compile(r"(PASSWORD|SECRET|TOKEN|ACCESS_KEY|_KEY$|^AWS_SESSION)", re.IGNORECASE)


# ---------------------------------------------------------------------------------------------
# Loading


def _yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file())


def _load_all(path: Path) -> list[Any]:
    with path.open() as stream:
        return [doc for doc in yaml.safe_load_all(stream) if doc is not None]


def _is_k8s_object(doc: Any) -> bool:
    return isinstance(doc, dict) and "apiVersion" in doc and "kind" in doc


def _is_kustomization(doc: Any) -> bool:
    return isinstance(doc, dict) and doc.get("kind") in ("Kustomization", "Component")


def _source_objects() -> list[tuple[str, dict]]:
    """Every Kubernetes object written in deploy/k8s (not kustomizations, not patches)."""
    objects = []
    for path in _yaml_files():
        if path.name in ("kustomization.yaml", "kustomization.yml"):
            continue
        for index, doc in enumerate(_load_all(path)):
            if _is_k8s_object(doc) and not _is_kustomization(doc):
                objects.append((f"{path.relative_to(REPO)}#{index}", doc))
    return objects


def _kustomization_dirs() -> list[Path]:
    return sorted(p.parent for p in K8S.rglob("kustomization.yaml"))


@functools.lru_cache(maxsize=None)
def _render(directory: Path) -> tuple[dict, ...]:
    """`kubectl kustomize DIR`, parsed; skips when kubectl is not installed."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with its built-in kustomize) is not installed")
    result = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, f"kubectl kustomize {directory} failed:\n{result.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc is not None)


def _rendered_objects() -> Iterator[tuple[str, dict]]:
    for directory in _kustomization_dirs():
        for index, doc in enumerate(_render(directory)):
            yield f"{directory.relative_to(REPO)} (rendered)#{index}", doc


def _pod_specs(doc: dict) -> Iterator[dict]:
    """Every pod spec inside an object (Job, StatefulSet, Deployment, PyTorchJob replica specs)."""

    def walk(node: Any) -> Iterator[dict]:
        if isinstance(node, dict):
            if isinstance(node.get("containers"), list):
                yield node
            for value in node.values():
                yield from walk(value)
        elif isinstance(node, list):
            for value in node:
                yield from walk(value)

    yield from walk(doc.get("spec", {}))


# ---------------------------------------------------------------------------------------------
# torchrun lines


class TorchrunLine:
    """One torchrun invocation found in deploy/: where, its argv after `torchrun`, and its env."""

    def __init__(self, where: str, argv: list[str], env: dict[str, str] | None = None):
        self.where = where
        self.argv = argv
        self.env = env or {}

    def __repr__(self) -> str:
        return self.where


_K8S_VAR = re.compile(r"\$\((\w+)\)")
_SHELL_VAR = re.compile(r"\$\{(\w+)\}|\$(\w+)")


def _substitute_k8s(token: str, env: dict[str, str], where: str) -> str:
    def value(match: re.Match) -> str:
        name = match.group(1)
        assert name in env, f"{where}: $({name}) is not a literal env value of the container"
        return env[name]

    return _K8S_VAR.sub(value, token)


def _substitute_shell(token: str, where: str) -> str:
    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        assert name in SHELL_VALUES, f"{where}: ${name} has no plausible value in SHELL_VALUES"
        return SHELL_VALUES[name]

    return _SHELL_VAR.sub(value, token)


def _torchrun_start(tokens: list[str]) -> int | None:
    """Index just after `torchrun` / `python -m torch.distributed.run` in tokens, else None."""
    for index, token in enumerate(tokens):
        if os.path.basename(token) == "torchrun":
            return index + 1
        if token == "-m" and index + 1 < len(tokens) and tokens[index + 1] == "torch.distributed.run":
            return index + 2
    return None


def _shell_torchrun_lines(text: str, where: str) -> list[TorchrunLine]:
    """torchrun commands in shell text: continuation lines joined, cut at the first operator."""
    found = []
    logical = re.sub(r"\\\n", " ", text)
    for number, line in enumerate(logical.splitlines(), 1):
        line = line.strip().removeprefix("$ ")
        if "torchrun" not in line and "torch.distributed.run" not in line:
            continue
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            continue
        start = _torchrun_start(tokens)
        if start is None:
            continue
        argv = []
        for token in tokens[start:]:
            if token in ("&", "&&", "|", "||", ";") or token.startswith((">", "2>")):
                break
            if token == "$@":  # the script's own extra recipe flags; none in the check
                continue
            argv.append(_substitute_shell(token, where))
        found.append(TorchrunLine(f"{where} (torchrun #{len(found) + 1})", argv))
    return found


def _k8s_torchrun_lines() -> list[TorchrunLine]:
    found = []
    for where, doc in _source_objects():
        for spec in _pod_specs(doc):
            for container in spec["containers"]:
                tokens = list(container.get("command", [])) + list(container.get("args", []))
                start = _torchrun_start(tokens)
                if start is None:
                    continue
                env = {e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e}
                label = f"{where} {doc['kind']}/{doc['metadata']['name']}:{container['name']}"
                argv = [_substitute_k8s(token, env, label) for token in tokens[start:]]
                found.append(TorchrunLine(label, argv, env))
    return found


def _readme_code_blocks() -> str:
    if not README.exists():
        return ""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", README.read_text(), flags=re.DOTALL)
    return "\n".join(blocks)


def _dockerfile_torchrun_lines() -> list[TorchrunLine]:
    # Only what a container runs (CMD / ENTRYPOINT); RUN lines are build steps.
    found = []
    for line in DOCKERFILE.read_text().splitlines():
        match = re.match(r"\s*(CMD|ENTRYPOINT)\s+(.*)", line)
        if match and "torchrun" in match.group(2):
            body = match.group(2).strip()
            tokens = yaml.safe_load(body) if body.startswith("[") else shlex.split(body)
            start = _torchrun_start(tokens)
            if start is not None:
                argv = [_substitute_shell(t, "Dockerfile") for t in tokens[start:]]
                found.append(TorchrunLine(f"Dockerfile {match.group(1)}", argv))
    return found


def _all_torchrun_lines() -> list[TorchrunLine]:
    return (
        _k8s_torchrun_lines()
        + _shell_torchrun_lines(SBATCH.read_text(), "deploy/slurm/train.sbatch")
        + _shell_torchrun_lines(_readme_code_blocks(), "deploy/README.md")
        + _dockerfile_torchrun_lines()
    )


@functools.lru_cache(maxsize=None)
def _registered_handlers() -> frozenset[str]:
    """Rendezvous handler names this package registers with torchrun (group torchrun.handlers)."""
    try:
        importlib.metadata.distribution("elastic-ddp")
    except importlib.metadata.PackageNotFoundError:
        pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
        return frozenset(pyproject["project"]["entry-points"]["torchrun.handlers"])
    return frozenset(e.name for e in importlib.metadata.entry_points(group="torchrun.handlers"))


def _parse_torchrun(argv: list[str], monkeypatch: pytest.MonkeyPatch):
    from torch.distributed.run import get_args_parser

    # torchrun takes defaults from PET_* variables; the check must see only the command line.
    for name in list(os.environ):
        if name.startswith("PET_"):
            monkeypatch.delenv(name)
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    try:
        return get_args_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"torchrun's parser rejected {argv} (exit {exc.code})")


def _grace_s(recipe_flags: list[str]) -> float:
    return load_config(recipe_flags).checkpoint.grace_s


def _rdzv_conf(args) -> dict[str, str]:
    return dict(item.split("=", 1) for item in args.rdzv_conf.split(",") if item) if args.rdzv_conf else {}


TORCHRUN_LINES = _all_torchrun_lines()


# ---------------------------------------------------------------------------------------------
# YAML and kustomize


@pytest.mark.parametrize("path", _yaml_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_yaml_parses(path: Path):
    docs = _load_all(path)
    assert docs, f"{path} holds no YAML document"


@pytest.mark.parametrize("directory", _kustomization_dirs(), ids=lambda p: str(p.relative_to(REPO)))
def test_kustomization_lists_only_existing_files(directory: Path):
    (kustomization,) = _load_all(directory / "kustomization.yaml")
    referenced = list(kustomization.get("resources", [])) + list(kustomization.get("components", []))
    referenced += [p["path"] for p in kustomization.get("patches", []) if "path" in p]
    referenced += list(kustomization.get("patchesStrategicMerge", []))
    referenced += [p["path"] for p in kustomization.get("patchesJson6902", [])]
    for generator in kustomization.get("configMapGenerator", []) + kustomization.get("secretGenerator", []):
        referenced += [f.split("=", 1)[-1] for f in generator.get("files", [])]
        referenced += list(generator.get("envs", []))
    assert referenced, f"{directory}/kustomization.yaml references nothing"
    for entry in referenced:
        target = (directory / entry).resolve()
        assert target.exists(), f"{directory}/kustomization.yaml lists {entry!r}, which does not exist"
        if target.is_dir():
            assert (target / "kustomization.yaml").exists(), f"{entry!r} is a directory without a kustomization.yaml"
    # A generated Secret with literals would put credentials in the repository.
    for generator in kustomization.get("secretGenerator", []):
        assert not generator.get("literals"), f"{directory}: secretGenerator with inline literals"


@pytest.mark.parametrize("directory", _kustomization_dirs(), ids=lambda p: str(p.relative_to(REPO)))
def test_kustomization_renders_valid_objects(directory: Path):
    import kubernetes_validate

    docs = _render(directory)
    assert docs, f"kubectl kustomize {directory} produced nothing"
    for doc in docs:
        if not doc["apiVersion"].startswith(CRD_GROUPS):
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


# ---------------------------------------------------------------------------------------------
# Schemas and structure


@pytest.mark.parametrize("where,doc", _source_objects(), ids=[w for w, _ in _source_objects()])
def test_object_validates_against_kubernetes_schema(where: str, doc: dict):
    import kubernetes_validate

    if doc["apiVersion"].startswith(CRD_GROUPS):
        pytest.skip(f"{doc['kind']} is a custom resource; see test_pytorchjob_structure")
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{where} {doc['kind']}: {'.'.join(map(str, exc.path))}: {exc.message}")


def _objects(kind: str) -> list[dict]:
    return [doc for _, doc in _source_objects() if doc["kind"] == kind]


def _only_container(doc: dict) -> dict:
    (spec,) = list(_pod_specs(doc))
    (container,) = spec["containers"]
    return container


def _line_for(doc: dict) -> TorchrunLine:
    (line,) = [t for t in TORCHRUN_LINES if f" {doc['kind']}/{doc['metadata']['name']}:" in t.where]
    return line


def test_pytorchjob_structure(monkeypatch):
    (job,) = _objects("PyTorchJob")
    assert job["apiVersion"] == "kubeflow.org/v1"
    spec = job["spec"]
    policy = spec["elasticPolicy"]
    assert set(policy) <= {
        "minReplicas", "maxReplicas", "rdzvBackend", "rdzvPort", "rdzvHost", "rdzvId", "rdzvConf",
        "standalone", "nProcPerNode", "maxRestarts", "metrics",
    }, f"unknown elasticPolicy keys: {sorted(policy)}"
    assert policy["rdzvBackend"] in ("c10d", "etcd", "etcd-v2")  # the CRD's enum
    assert policy["rdzvBackend"] in _registered_handlers()
    assert 1 <= policy["minReplicas"] <= policy["maxReplicas"]
    # The operator's webhook refuses the deprecated elasticPolicy.nProcPerNode next to nprocPerNode.
    assert ("nprocPerNode" in spec) != ("nProcPerNode" in policy)
    nproc = str(spec.get("nprocPerNode", policy.get("nProcPerNode")))

    assert set(spec["pytorchReplicaSpecs"]) == {"Worker"}, "elastic mode: Worker replicas only"
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == policy["maxReplicas"]
    assert worker["restartPolicy"] in ("OnFailure", "ExitCode", "Always", "Never")
    # The pod template itself is a core PodTemplateSpec: validate it as a Pod.
    import kubernetes_validate

    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "worker"}, "spec": worker["template"]["spec"]}
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    containers = worker["template"]["spec"]["containers"]
    assert "pytorch" in [c["name"] for c in containers], "the operator needs a container named pytorch"

    # The explicit torchrun flags must say what elasticPolicy says.
    args = _parse_torchrun(_line_for(job).argv, monkeypatch)
    assert args.nnodes == f"{policy['minReplicas']}:{policy['maxReplicas']}"
    assert args.rdzv_backend == policy["rdzvBackend"]
    assert args.rdzv_endpoint == f"{policy['rdzvHost']}:{policy['rdzvPort']}"
    assert args.max_restarts == policy["maxRestarts"]
    assert args.nproc_per_node == nproc


def test_indexed_job_runs_one_agent_per_node(monkeypatch):
    (job,) = _objects("Job")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    args = _parse_torchrun(_line_for(job).argv, monkeypatch)
    min_nodes, max_nodes = (int(n) for n in args.nnodes.split(":"))
    assert 1 <= min_nodes <= max_nodes == spec["parallelism"] == spec["completions"]
    pod = spec["template"]["spec"]
    # podFailurePolicy (preemptions do not count as failures) needs restartPolicy Never.
    assert pod["restartPolicy"] == "Never"
    assert any(
        rule["action"] == "Ignore" and rule["onPodConditions"][0]["type"] == "DisruptionTarget"
        for rule in spec["podFailurePolicy"]["rules"]
    )


@pytest.mark.parametrize("kind", ["Job", "PyTorchJob"])
def test_training_pod_requests_gpus_and_matches_nproc(kind: str, monkeypatch):
    (job,) = _objects(kind)
    container = _only_container(job)
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    assert container["resources"]["requests"]["nvidia.com/gpu"] == gpus
    args = _parse_torchrun(_line_for(job).argv, monkeypatch)
    assert int(args.nproc_per_node) == gpus, "one worker process per GPU"
    assert container["image"], "an image"


def test_etcd_statefulset():
    (sts,) = _objects("StatefulSet")
    spec = sts["spec"]
    assert spec["replicas"] == 3 and spec["podManagementPolicy"] == "Parallel"
    services = {s["metadata"]["name"]: s for s in _objects("Service")}
    headless = services[spec["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"]
    assert "etcd-client" in services, "a client Service for --rdzv-endpoint"

    pod = spec["template"]["spec"]
    container = _only_container(sts)
    flags = dict(arg.removeprefix("--").partition("=")[::2] for arg in container["args"])
    members = dict(item.split("=", 1) for item in flags["initial-cluster"].split(","))
    name = sts["metadata"]["name"]
    service = spec["serviceName"]
    assert members == {
        f"{name}-{i}": f"https://{name}-{i}.{service}.$(POD_NAMESPACE).svc:2380" for i in range(3)
    }
    for flag in (
        "client-cert-auth", "trusted-ca-file", "cert-file", "key-file", "peer-client-cert-auth",
        "peer-trusted-ca-file", "peer-cert-file", "peer-key-file", "auto-compaction-retention",
        "quota-backend-bytes",
    ):
        assert flag in flags, f"etcd needs --{flag}"
    assert flags["listen-client-urls"].startswith("https://")
    assert flags["initial-advertise-peer-urls"].startswith("https://")
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert probe in container
    # TLS files come from mounted Secrets.
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    secret_volumes = {v["name"] for v in pod["volumes"] if "secret" in v}
    for flag in ("cert-file", "key-file", "trusted-ca-file", "peer-cert-file", "peer-key-file"):
        directory = os.path.dirname(flags[flag])
        assert mounts.get(directory) in secret_volumes, f"--{flag} is not on a Secret volume"
    assert spec["volumeClaimTemplates"][0]["metadata"]["name"] in mounts.values()
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname"


def test_tensorboard_reads_the_log_volume_the_trainers_write(monkeypatch):
    (deployment,) = _objects("Deployment")
    tensorboard = _only_container(deployment)
    logdir = next(a for a in tensorboard["args"] if a.startswith("--logdir=")).split("=", 1)[1]
    tb_claims = {v["persistentVolumeClaim"]["claimName"] for v in list(_pod_specs(deployment))[0]["volumes"] if "persistentVolumeClaim" in v}
    (pvc,) = _objects("PersistentVolumeClaim")
    assert pvc["metadata"]["name"] in tb_claims and "ReadWriteMany" in pvc["spec"]["accessModes"]
    for kind in ("Job", "PyTorchJob"):
        (job,) = _objects(kind)
        args = _parse_torchrun(_line_for(job).argv, monkeypatch)
        cfg = load_config(args.training_script_args)
        assert cfg.logging.tensorboard_dir.startswith(logdir.rstrip("/") + "/")
        (pod,) = list(_pod_specs(job))
        claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
        assert pvc["metadata"]["name"] in claims
    assert any(s["metadata"]["name"] == "tensorboard" for s in _objects("Service"))


# ---------------------------------------------------------------------------------------------
# torchrun lines


def test_torchrun_lines_are_found_in_every_kind_of_source():
    sources = {line.where.split(" ")[0] for line in TORCHRUN_LINES}
    assert any("training/job/" in s for s in sources)
    assert any("training/kubeflow/" in s for s in sources)
    assert "deploy/slurm/train.sbatch" in sources
    assert "deploy/README.md" in sources


@pytest.mark.parametrize("line", TORCHRUN_LINES, ids=repr)
def test_torchrun_line_parses_and_its_recipe_flags_validate(line: TorchrunLine, monkeypatch):
    args = _parse_torchrun(line.argv, monkeypatch)
    assert args.rdzv_backend in ("etcd", "etcd-v3"), f"{line}: backend {args.rdzv_backend!r}"
    assert args.rdzv_backend in _registered_handlers(), (
        f"{line}: {args.rdzv_backend!r} is not among the torchrun.handlers entry points "
        f"{sorted(_registered_handlers())}"
    )
    host, _, port = args.rdzv_endpoint.rpartition(":")
    assert host and port.isdigit(), f"{line}: --rdzv-endpoint {args.rdzv_endpoint!r} is not HOST:PORT"
    assert args.rdzv_id and args.rdzv_id != "none", f"{line}: needs a --rdzv-id"
    assert ":" in args.nnodes, f"{line}: --nnodes={args.nnodes} is not elastic (MIN:MAX)"
    assert args.training_script == RECIPE
    conf = _rdzv_conf(args)
    assert "password" not in conf, f"{line}: the etcd password must come from ELASTIC_DDP_ETCD_PASSWORD"
    if conf.get("protocol") == "https":
        assert {"cacert", "cert", "key"} <= set(conf), f"{line}: https needs cacert, cert and key"
    load_config(args.training_script_args)  # raises ConfigError naming the bad flag


@pytest.mark.parametrize("line", TORCHRUN_LINES, ids=repr)
def test_torchrun_waits_for_the_final_checkpoint(line: TorchrunLine, monkeypatch):
    # The stop checkpoint must fit both of torchrun's windows: --shutdown-timeout when the agent is
    # signalled, and the fixed membership-change window, which no flag widens.
    args = _parse_torchrun(line.argv, monkeypatch)
    shutdown = args.shutdown_timeout or DEFAULT_TORCHRUN_SHUTDOWN_S
    grace = _grace_s(args.training_script_args)
    assert grace + WORKER_EXIT_MARGIN_S <= shutdown, (
        f"{line}: --shutdown-timeout ({shutdown}) must exceed checkpoint.grace_s ({grace}) by {WORKER_EXIT_MARGIN_S} s"
    )
    assert grace + WORKER_EXIT_MARGIN_S <= TORCHRUN_RESTART_GRACE_S, (
        f"{line}: checkpoint.grace_s ({grace}) does not fit torchrun's {TORCHRUN_RESTART_GRACE_S} s membership-change "
        f"window with {WORKER_EXIT_MARGIN_S} s to spare"
    )


def _training_pod_specs() -> list[tuple[str, dict, TorchrunLine]]:
    found = []
    for where, doc in _source_objects():
        for spec in _pod_specs(doc):
            for container in spec["containers"]:
                if _torchrun_start(list(container.get("command", [])) + list(container.get("args", []))):
                    found.append((where, spec, _line_for(doc)))
    return found


def test_training_pods_outlive_the_final_checkpoint(monkeypatch):
    pods = _training_pod_specs()
    assert len(pods) >= 2
    for where, spec, line in pods:
        args = _parse_torchrun(line.argv, monkeypatch)
        grace = _grace_s(args.training_script_args)
        shutdown = args.shutdown_timeout or DEFAULT_TORCHRUN_SHUTDOWN_S
        period = spec.get("terminationGracePeriodSeconds", 30)
        assert period > grace, f"{where}: terminationGracePeriodSeconds {period} <= checkpoint.grace_s {grace}"
        assert period >= shutdown + AGENT_EXIT_MARGIN_S, (
            f"{where}: terminationGracePeriodSeconds {period} leaves the agent less than {AGENT_EXIT_MARGIN_S} s "
            f"after --shutdown-timeout {shutdown}"
        )


def test_training_pods_take_credentials_from_secrets(monkeypatch):
    for where, spec, line in _training_pod_specs():
        (container,) = [c for c in spec["containers"] if _torchrun_start(list(c.get("command", [])))]
        env = {e["name"]: e for e in container.get("env", [])}
        for name in ("ELASTIC_DDP_ETCD_PASSWORD", "ELASTIC_DDP_CHECKPOINT_KEY"):
            assert "secretKeyRef" in env[name].get("valueFrom", {}), f"{where}: {name} not from a Secret"
        assert any("secretRef" in source for source in container.get("envFrom", [])), f"{where}: S3 credentials"
        # The etcd client certificate files named in --rdzv-conf are on a Secret volume.
        conf = _rdzv_conf(_parse_torchrun(line.argv, monkeypatch))
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        secret_volumes = {v["name"] for v in spec["volumes"] if "secret" in v}
        for key in ("cacert", "cert", "key"):
            assert mounts.get(os.path.dirname(conf[key])) in secret_volumes, f"{where}: {key} not from a Secret"


# ---------------------------------------------------------------------------------------------
# Slurm


def test_slurm_script_is_valid_bash():
    result = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True, timeout=10)
    assert result.returncode == 0, result.stderr


def test_slurm_script_requeues_on_sigterm_before_the_time_limit(monkeypatch):
    text = SBATCH.read_text()
    directives = re.findall(r"^#SBATCH\s+(\S+)", text, flags=re.MULTILINE)
    assert "--requeue" in directives
    (signal,) = [d for d in directives if d.startswith("--signal=")]
    match = re.fullmatch(r"--signal=(B:)?(TERM|SIGTERM|15)@(\d+)", signal)
    assert match, f"{signal}: want --signal=B:TERM@SECONDS"
    assert re.search(r"^\s*trap\s+\S+.*\bTERM\b", text, flags=re.MULTILINE), "no trap on TERM"
    assert re.search(r"scontrol requeue \"?\$SLURM_JOB_ID", text)
    assert re.search(r"\bsrun\b[^\n]*--ntasks-per-node=1", text), "one agent per node"
    # The warning must leave time for the whole shutdown: checkpoint, torchrun exit, requeue.
    (line,) = _shell_torchrun_lines(text, "deploy/slurm/train.sbatch")
    args = _parse_torchrun(line.argv, monkeypatch)
    shutdown = args.shutdown_timeout or DEFAULT_TORCHRUN_SHUTDOWN_S
    assert int(match.group(3)) >= shutdown + AGENT_EXIT_MARGIN_S + SLURM_REQUEUE_MARGIN_S
    assert int(match.group(3)) > _grace_s(args.training_script_args)


_FAKE_SRUN = """#!/bin/bash
printf '%s\\n' "$@" > "$FAKE_LOG/srun.args"
if [[ $FAKE_SRUN_EXIT != wait ]]; then exit "$FAKE_SRUN_EXIT"; fi
echo $$ > "$FAKE_LOG/srun.pid"
# A SIGTERM to srun itself: a real srun SIGKILLs its tasks (recorded, and ignored here).
trap 'echo TERM >> "$FAKE_LOG/srun.signals"' TERM
# USR1 stands for Slurm signalling the step's tasks (the fake scancel): the agents stop, torchrun
# exits 1 after a signal, and srun returns that.
trap 'echo tasks >> "$FAKE_LOG/srun.signals"; exit 1' USR1
touch "$FAKE_LOG/srun.started"
while true; do sleep 0.05; done
"""
_FAKE_SCANCEL = """#!/bin/bash
echo "$*" >> "$FAKE_LOG/scancel.calls"
kill -USR1 "$(cat "$FAKE_LOG/srun.pid")"
"""
_FAKE_SCONTROL = """#!/bin/bash
echo "$*" >> "$FAKE_LOG/scontrol.calls"
if [[ $1 == show ]]; then echo "JobId=$SLURM_JOB_ID JobState=$FAKE_JOB_STATE PreemptTime=$FAKE_PREEMPT_TIME"; fi
"""


def _run_sbatch(
    tmp_path: Path, srun_exit: str, terminate: bool, *, job_state: str = "RUNNING", preempt_time: str = "None",
    env: dict[str, str] | None = None,
) -> tuple[int, Path, str]:
    """Run train.sbatch with fake srun/scancel/scontrol on PATH; optionally SIGTERM it once srun runs.
    ``job_state`` and ``preempt_time`` are what the fake `scontrol show job` says."""
    import signal
    import time

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("srun", _FAKE_SRUN), ("scancel", _FAKE_SCANCEL), ("scontrol", _FAKE_SCONTROL)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "FAKE_LOG": str(tmp_path),
        "FAKE_SRUN_EXIT": srun_exit,
        "FAKE_JOB_STATE": job_state,
        "FAKE_PREEMPT_TIME": preempt_time,
        "ELASTIC_DDP_HOME": str(tmp_path),
        "SLURM_JOB_ID": SHELL_VALUES["SLURM_JOB_ID"],
        "SLURM_JOB_NUM_NODES": "3",
        "SLURM_JOB_NODELIST": "node[1-3]",
        "ETCD_ENDPOINT": SHELL_VALUES["ETCD_ENDPOINT"],
        **(env or {}),
    }
    process = subprocess.Popen(
        ["bash", str(SBATCH), "--train.max_steps=7"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    if terminate:
        deadline = time.monotonic() + 10
        while not (tmp_path / "srun.started").exists():
            assert time.monotonic() < deadline and process.poll() is None, process.communicate()[0]
            time.sleep(0.02)
        process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=20)[0].decode()
    return process.returncode, tmp_path, output


def _calls(log: Path, command: str) -> list[str]:
    path = log / f"{command}.calls"
    return path.read_text().splitlines() if path.exists() else []


def test_slurm_script_passes_sigterm_to_the_steps_not_to_srun_then_requeues(tmp_path: Path):
    code, log, output = _run_sbatch(tmp_path, "wait", terminate=True)
    assert code == 0, output
    assert _calls(log, "scancel") == [f"--signal=TERM {SHELL_VALUES['SLURM_JOB_ID']}"], "SIGTERM not passed to the steps"
    # Through Slurm to the tasks only: srun itself, which would SIGKILL them, is never signalled.
    assert (log / "srun.signals").read_text().split() == ["tasks"]
    assert _calls(log, "scontrol")[-1] == f"requeue {SHELL_VALUES['SLURM_JOB_ID']}"
    srun_args = (log / "srun.args").read_text().splitlines()
    assert "--nnodes=1:3" in srun_args and srun_args[-1] == "--train.max_steps=7", srun_args


def test_slurm_script_does_not_requeue_a_job_slurm_is_ending(tmp_path: Path):
    # `scancel JOBID` (or `scontrol requeue`, or the time limit reached): SIGTERM to the shell while
    # Slurm already counts the job as COMPLETING; requeueing would undo a cancel.
    code, log, output = _run_sbatch(tmp_path, "wait", terminate=True, job_state="COMPLETING")
    assert code == 1, output  # srun's status: torchrun exits 1 after a signal
    assert not any(call.startswith("requeue") for call in _calls(log, "scontrol")), output


def test_slurm_script_never_asks_for_more_nodes_than_it_was_given(tmp_path: Path):
    code, log, output = _run_sbatch(tmp_path, "0", terminate=False, env={"MIN_NODES": "4"})
    assert code == 0, output
    assert "--nnodes=3:3" in (log / "srun.args").read_text().splitlines(), output


def test_slurm_script_requeues_a_preempted_job_whose_shell_got_no_signal(tmp_path: Path):
    code, log, output = _run_sbatch(tmp_path, "1", terminate=False, preempt_time="2026-01-01T00:00:00")
    assert code == 0, output
    assert _calls(log, "scontrol")[-1] == f"requeue {SHELL_VALUES['SLURM_JOB_ID']}"
    assert not _calls(log, "scancel")


@pytest.mark.parametrize("srun_exit", ["0", "3"])
def test_slurm_script_without_sigterm_does_not_requeue(tmp_path: Path, srun_exit: str):
    code, log, output = _run_sbatch(tmp_path, srun_exit, terminate=False)
    assert code == int(srun_exit), output
    assert not any(call.startswith("requeue") for call in _calls(log, "scontrol")), "requeued a job that was not terminated"


# ---------------------------------------------------------------------------------------------
# Secrets


def test_no_secret_objects_or_inline_secret_env():
    for where, doc in _source_objects():
        if doc["kind"] == "Secret":
            assert not doc.get("data") and not doc.get("stringData"), f"{where}: Secret with values"
        for spec in _pod_specs(doc):
            for container in spec.get("initContainers", []) + spec["containers"]:
                for env in container.get("env", []):
                    if SECRET_ENV.search(env["name"]):
                        assert "value" not in env, f"{where}: {env['name']} has an inline value"
                        assert "secretKeyRef" in env.get("valueFrom", {}), f"{where}: {env['name']} not from a Secret"


_SECRET_TEXT = [
    (re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"), "a private key"),
    (re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b"), "an AWS access key id"),
    # NAME=literal / NAME: literal for credential-like names, unless the value is a reference
    # ($VAR, $(cmd), <placeholder>, a secretKeyRef block on the next line).
    (
        re.compile(
            r"\b[A-Z_]*(PASSWORD|SECRET_ACCESS_KEY|SESSION_TOKEN|CHECKPOINT_KEY)\b\s*[=:]\s*"
            r"(?![\s\"']*(\$|<|\n|$))[\"']?[^\s\"'$<]{4,}"
        ),
        "a credential assignment",
    ),
    (re.compile(r"rdzv[-_]conf[=\s][^\s]*\bpassword="), "a password in an rdzv_conf"),
]


@pytest.mark.parametrize(
    "path",
    sorted(p for p in DEPLOY.rglob("*") if p.is_file()) + [REPO / ".dockerignore"],
    ids=lambda p: str(p.relative_to(REPO)),
)
def test_no_secret_values_in_files(path: Path):
    text = path.read_text(errors="replace")
    for pattern, what in _SECRET_TEXT:
        match = pattern.search(text)
        assert match is None, f"{path.relative_to(REPO)} seems to hold {what}: {match.group(0)!r}"


# ---------------------------------------------------------------------------------------------
# Docker


def test_dockerfile_builds_a_small_non_root_image_on_the_base_torch():
    text = DOCKERFILE.read_text()
    logical = re.sub(r"\\\n", " ", text)
    instructions = [line.strip() for line in logical.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    base_arg = re.search(r"^ARG BASE_IMAGE=(\S+)", text, flags=re.MULTILINE)
    assert base_arg and ":" in base_arg.group(1), "BASE_IMAGE build ARG with a pinned tag"
    froms = [i for i in instructions if i.startswith("FROM ")]
    assert froms and all(f.split()[1] == "${BASE_IMAGE}" for f in froms)
    for instruction in instructions:
        for pip in re.findall(r"pip (?:install|wheel)[^;&]*", instruction):
            assert "--no-cache-dir" in pip, f"pip without --no-cache-dir: {pip}"
            assert not re.search(r"\btorch\b(?![.\w])", pip.replace("torch==", "")), "torch must come from the base"
    assert re.search(r"\[s3\]", text), "the s3 extra"
    assert not re.search(r"apt-get install[^\n]*(build-essential|gcc|g\+\+)", text), "no build tools"
    (user,) = [i for i in instructions if i.startswith("USER ")]
    assert user.split()[1].split(":")[0] not in ("root", "0")
    assert instructions.index(user) > max(i for i, x in enumerate(instructions) if x.startswith("RUN "))
    # Everything the image copies from the build context exists and is not dockerignored.
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    for instruction in instructions:
        if instruction.startswith("COPY ") and "--from=" not in instruction:
            for source in instruction.split()[1:-1]:
                assert (REPO / source).exists() or source == "README.md", f"COPY {source}: missing"
                assert f"!{source.rstrip('/')}" in {line.rstrip("/") for line in ignore} or \
                    f"!{source.rstrip('/')}/" in ignore, f"{source} is excluded by .dockerignore"
    assert (REPO / RECIPE).parent.exists()
