"""The cluster configurations in ``cluster/`` and their guide ``docs/cluster.md``.

Static checks: the files parse, have the structure their tools expect, turn Ray's token authentication on
everywhere, keep the dashboard off public interfaces, and the placeholders the guide lists are in them.
Nothing here starts Ray, a cluster or a container.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "cluster"
SBATCH = CLUSTER / "slurm" / "distmis-ray.sbatch"
RAYCLUSTER = CLUSTER / "kuberay" / "raycluster.yaml"
RAYJOB = CLUSTER / "kuberay" / "rayjob.yaml"
LAUNCHER = CLUSTER / "launcher" / "aws-gpu.yaml"
GUIDE = ROOT / "docs" / "cluster.md"
YAML_FILES = sorted([*(CLUSTER / "kuberay").glob("*.yaml"), *(CLUSTER / "launcher").glob("*.yaml")])
ALL_FILES = [SBATCH, *YAML_FILES]
TOKEN_SECRET = "distmis-ray-token"
# the distmis sub-commands that exist (or are being added: cluster, submit, jobs, status, logs, stop, ui)
COMMANDS = {"run", "validate", "compare", "results", "data", "cluster", "submit", "jobs", "status", "logs", "stop", "ui"}


def load_all(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def one(path: Path, kind: str) -> dict[str, Any]:
    docs = [doc for doc in load_all(path) if doc.get("kind") == kind]
    assert len(docs) == 1, f"{path.name}: expected one {kind}, found {len(docs)}"
    return docs[0]


def cluster_spec(path: Path) -> dict[str, Any]:
    """The RayCluster spec of raycluster.yaml, or the rayClusterSpec of a RayJob."""
    docs = load_all(path)
    for doc in docs:
        if doc.get("kind") == "RayCluster":
            return doc["spec"]
        if doc.get("kind") == "RayJob":
            return doc["spec"]["rayClusterSpec"]
    raise AssertionError(f"{path.name} holds no RayCluster or RayJob")


def pod_templates(spec: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    yield "head", spec["headGroupSpec"]["template"]["spec"]
    for group in spec["workerGroupSpecs"]:
        yield group["groupName"], group["template"]["spec"]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {item["name"]: item for item in container.get("env", [])}


def walk(node: Any) -> Iterator[tuple[str, Any]]:
    """Every (key, value) pair in a parsed YAML tree."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield str(key), value
            yield from walk(value)
    elif isinstance(node, list):
        for item in node:
            yield from walk(item)


# --------------------------------------------------------------------------- every YAML file
def test_the_expected_files_exist():
    assert {p.name for p in YAML_FILES} == {"raycluster.yaml", "rayjob.yaml", "aws-gpu.yaml"}
    for path in ALL_FILES + [GUIDE]:
        assert path.is_file(), path


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: p.name)
def test_yaml_parses(path):
    docs = load_all(path)
    assert docs and all(isinstance(doc, dict) for doc in docs)


# --------------------------------------------------------------------------- KubeRay
def test_raycluster_structure():
    rc = one(RAYCLUSTER, "RayCluster")
    assert rc["apiVersion"] == "ray.io/v1"
    spec = rc["spec"]
    assert "template" in spec["headGroupSpec"] and "rayStartParams" in spec["headGroupSpec"]
    assert spec["workerGroupSpecs"], "no worker group"


def test_rayjob_structure():
    job = one(RAYJOB, "RayJob")
    assert job["apiVersion"] == "ray.io/v1"
    spec = job["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    entry = spec["entrypoint"].split()
    assert entry[:3] == ["distmis", "run", "/specs/search.yaml"]
    assert entry[entry.index("--output") + 1].startswith("/shared/runs/")
    cluster = spec["rayClusterSpec"]
    assert "headGroupSpec" in cluster and cluster["workerGroupSpecs"]
    # the spec comes from a ConfigMap mounted at /specs on the head, where the driver runs
    head = cluster["headGroupSpec"]["template"]["spec"]
    spec_volumes = {v["name"] for v in head["volumes"] if "configMap" in v}
    assert spec_volumes
    mounts = {m["mountPath"]: m["name"] for m in head["containers"][0]["volumeMounts"]}
    assert mounts.get("/specs") in spec_volumes


@pytest.mark.parametrize("path", [RAYCLUSTER, RAYJOB], ids=lambda p: p.name)
def test_kuberay_gpu_workers_and_one_shared_volume(path):
    spec = cluster_spec(path)
    for group in spec["workerGroupSpecs"]:
        container = group["template"]["spec"]["containers"][0]
        gpus = container["resources"]["limits"]["nvidia.com/gpu"]
        assert int(gpus) >= 1
        assert int(group["rayStartParams"]["num-gpus"]) == int(gpus)
    claims, paths = set(), set()
    for _, pod in pod_templates(spec):
        shared = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]
                  if "persistentVolumeClaim" in v}
        assert shared, "every pod mounts the shared volume"
        claims.update(shared.values())
        paths.update(m["mountPath"] for m in pod["containers"][0]["volumeMounts"] if m["name"] in shared)
    assert claims == {"distmis-shared"} and paths == {"/shared"}, "one volume, at the same path on every pod"


@pytest.mark.parametrize("path", [RAYCLUSTER, RAYJOB], ids=lambda p: p.name)
def test_kuberay_token_auth_on_every_ray_container(path):
    spec = cluster_spec(path)
    assert spec["authOptions"] == {"mode": "token", "secretName": TOKEN_SECRET}
    containers = [(name, pod["containers"][0]) for name, pod in pod_templates(spec)]
    if path == RAYJOB:
        containers.append(("submitter", one(RAYJOB, "RayJob")["spec"]["submitterPodTemplate"]["spec"]["containers"][0]))
    for name, container in containers:
        env = env_of(container)
        assert env["RAY_AUTH_MODE"]["value"] == "token", name
        ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": TOKEN_SECRET, "key": "auth_token"}, name
        assert "value" not in env["RAY_AUTH_TOKEN"], f"{name}: the token must come from the Secret"


@pytest.mark.parametrize("path", [RAYCLUSTER, RAYJOB], ids=lambda p: p.name)
def test_kuberay_dashboard_stays_inside_the_cluster(path):
    spec = cluster_spec(path)
    head = spec["headGroupSpec"]
    assert head["serviceType"] == "ClusterIP"
    assert head.get("enableIngress") is False
    docs = load_all(path)
    kinds = {doc["kind"] for doc in docs}
    assert not kinds & {"Ingress", "Service"}, "KubeRay makes the head Service; nothing else is exposed"
    for doc in docs:
        for key, value in walk(doc):
            if key in ("type", "serviceType"):
                assert value not in ("LoadBalancer", "NodePort"), f"{path.name}: {key}: {value}"
    # a NetworkPolicy limits who reaches the Ray pods
    policy = one(path, "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"] == {"ray.io/is-ray-node": "yes"}
    assert policy["spec"]["policyTypes"] == ["Ingress"]


def test_raycluster_dashboard_on_loopback():
    assert cluster_spec(RAYCLUSTER)["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "127.0.0.1"


def test_rayjob_does_not_widen_the_dashboard_binding():
    """The operator must reach the RayJob's Jobs API through the head Service, so its dashboard keeps
    KubeRay's in-pod default; the file must not set a wider binding explicitly."""
    params = cluster_spec(RAYJOB)["headGroupSpec"]["rayStartParams"]
    assert params.get("dashboard-host") in (None, "127.0.0.1")


def test_kuberay_secret_is_never_in_the_files():
    for path in (RAYCLUSTER, RAYJOB):
        assert "kind: Secret" not in path.read_text()
        assert all(doc["kind"] != "Secret" for doc in load_all(path))


# --------------------------------------------------------------------------- cluster launcher
def test_launcher_structure():
    config = yaml.safe_load(LAUNCHER.read_text())
    assert config["cluster_name"]
    assert config["provider"]["type"] == "aws" and config["provider"]["region"]
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    workers = [name for name in types if name != config["head_node_type"]]
    assert workers, "a worker node type"
    assert any(types[name]["node_config"]["InstanceType"].startswith(("g", "p")) for name in workers), "a GPU type"
    assert any("pip install" in command for command in config["setup_commands"])


def test_launcher_passes_rays_schema():
    pytest.importorskip("jsonschema")
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(yaml.safe_load(LAUNCHER.read_text())))


def test_launcher_token_auth_on_every_ray_start():
    config = yaml.safe_load(LAUNCHER.read_text())
    starts = [c for key in ("head_start_ray_commands", "worker_start_ray_commands") for c in config[key]
              if "ray start" in c]
    assert len(starts) == 2
    for command in starts:
        assert "RAY_AUTH_MODE=token" in command
        assert "RAY_AUTH_TOKEN_PATH=" in command
    head = [c for c in config["head_start_ray_commands"] if "ray start" in c][0]
    assert "--head" in head and "--dashboard-host=127.0.0.1" in head
    worker = [c for c in config["worker_start_ray_commands"] if "ray start" in c][0]
    assert "--address=$RAY_HEAD_IP:" in worker
    # the token file travels to every node with file_mounts, and is made private there
    token_file = config["head_start_ray_commands"][-1].split("RAY_AUTH_TOKEN_PATH=")[1].split()[0]
    assert token_file.replace("$HOME", "~") in config["file_mounts"]
    assert any("chmod 600" in c for c in config["setup_commands"])


# --------------------------------------------------------------------------- SLURM
def test_sbatch_is_valid_bash():
    bash = shutil.which("bash")
    assert bash is not None, "bash runs the SLURM script (and .ci/run)"
    result = subprocess.run([bash, "-n", str(SBATCH)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


def test_sbatch_token_auth_and_layout():
    text = SBATCH.read_text()
    assert re.search(r"^export RAY_AUTH_MODE=token$", text, re.M)
    assert re.search(r"^export RAY_AUTH_TOKEN_PATH$", text, re.M)
    assert "chmod 600" in text and "umask 077" in text
    head = re.search(r'srun [^\n]*-w "\$head_node" \\\n(.*?)&\n', text, re.S)
    assert head, "the head is started with srun on the head node"
    head_cmd = " ".join(head.group(1).split())
    assert head_cmd.startswith("ray start --head --block")
    assert "--dashboard-host=127.0.0.1" in head_cmd
    worker = re.search(r'srun [^\n]*-w "\$node" \\\n(.*?)&\n', text, re.S)
    assert worker, "workers are started with srun on the other nodes"
    worker_cmd = " ".join(worker.group(1).split())
    assert "--address=\"$head_address\"" in worker_cmd and "--block" in worker_cmd
    assert 'head_address="$HEAD_IP:$RAY_PORT"' in text
    assert re.search(r'distmis run "\$SPEC" --address "\$head_address" --output "\$OUTPUT"', text)
    assert 'ACTION="${ACTION:-run}"' in text, "running the spec is the default"
    assert "SLURM_GPUS_ON_NODE" in text and "SLURM_CPUS_PER_TASK" in text


def test_sbatch_placeholders_are_commented_variables_at_the_top():
    lines = SBATCH.read_text().splitlines()
    first_command = next(i for i, line in enumerate(lines) if line.startswith("die()"))
    for name in ("MODULES", "DISTMIS_VENV", "SPEC", "SHARED_DIR", "OUTPUT", "ACTION", "RAY_AUTH_TOKEN_PATH"):
        where = [i for i, line in enumerate(lines[:first_command]) if line.startswith(f"{name}=")]
        assert where, f"{name} is not set at the top"
        assert lines[where[0] - 1].startswith("#"), f"{name} has no comment"


def run_sbatch(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """Run the script outside SLURM with a bare environment: it must stop at its checks, start nothing."""
    bash = shutil.which("bash")
    assert bash is not None, "bash runs the SLURM script (and .ci/run)"
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path)}
    return subprocess.run([bash, str(SBATCH)], capture_output=True, text=True, timeout=30, env={**base, **env},
                          cwd=tmp_path)


def test_sbatch_refuses_to_run_outside_slurm(tmp_path):
    result = run_sbatch(tmp_path)
    assert result.returncode == 2
    assert "sbatch" in result.stderr


def test_sbatch_refuses_placeholders(tmp_path):
    result = run_sbatch(tmp_path, SLURM_JOB_ID="1")
    assert result.returncode == 2
    assert "set MODULES" in result.stderr
    result = run_sbatch(tmp_path, SLURM_JOB_ID="1", MODULES="", DISTMIS_VENV=str(tmp_path), SHARED_DIR=str(tmp_path))
    assert result.returncode == 2 and "set SPEC" in result.stderr
    result = run_sbatch(tmp_path, SLURM_JOB_ID="1", MODULES="", DISTMIS_VENV=str(tmp_path),
                        SHARED_DIR=str(tmp_path), ACTION="serve")
    assert result.returncode == 2 and f"no distmis in {tmp_path}" in result.stderr
    assert not (tmp_path / ".ray").exists(), "no token is written before the checks pass"


# --------------------------------------------------------------------------- all files
DASHBOARD_HOST = re.compile(r"dashboard[-_]host[\"']?\s*[=:]\s*[\"']?([^\s\"',}]+)")


@pytest.mark.parametrize("path", ALL_FILES, ids=lambda p: p.name)
def test_no_file_binds_the_dashboard_to_all_interfaces(path):
    hosts = DASHBOARD_HOST.findall(path.read_text())
    assert "0.0.0.0" not in hosts and "::" not in hosts
    assert set(hosts) <= {"127.0.0.1"}, hosts
    if path in (SBATCH, LAUNCHER, RAYCLUSTER):
        assert hosts, f"{path.name} binds the dashboard explicitly"


DISTMIS_COMMAND = re.compile(r"(?:^[ \t#]*|[`'])distmis (\w+)", re.M)  # at a line's start, or quoted


@pytest.mark.parametrize("path", ALL_FILES, ids=lambda p: p.name)
def test_files_name_existing_distmis_commands_only(path):
    used = set(DISTMIS_COMMAND.findall(path.read_text()))
    assert used <= COMMANDS, used - COMMANDS


# --------------------------------------------------------------------------- the guide
def guide_sections() -> dict[str, str]:
    sections: dict[str, str] = {}
    for block in re.split(r"^## ", GUIDE.read_text(), flags=re.M)[1:]:
        heading, _, body = block.partition("\n")
        sections[heading] = body
    return sections


def placeholder_tables() -> list[tuple[str, list[Path], list[str]]]:
    """(section, the files its heading names, the placeholders of its 'What to change' table)."""
    found = []
    for heading, body in guide_sections().items():
        files = [ROOT / f for f in re.findall(r"`(cluster/[^`]+)`", heading)]
        if not files:
            continue
        table = body.split("### What to change", 1)[1].split("###", 1)[0]
        names = [m for m in re.findall(r"^\| `([^`]+)` \|", table, re.M)]
        found.append((heading, files, names))
    return found


def test_guide_has_a_section_per_configuration():
    sections = placeholder_tables()
    covered = {path for _, files, _ in sections for path in files}
    assert covered == set(ALL_FILES)
    assert all(names for _, _, names in sections)
    headings = list(guide_sections())
    assert headings[0].startswith("One machine"), "the single-machine path comes first"
    assert any(h.startswith("Security") for h in headings)


@pytest.mark.parametrize("section", placeholder_tables(), ids=lambda s: s[0].split(":")[0])
def test_every_listed_placeholder_is_in_its_files(section):
    heading, files, names = section
    texts = [path.read_text() for path in files]
    missing = [name for name in names if not any(name in text for text in texts)]
    assert not missing, f"{heading}: not in {[p.name for p in files]}: {missing}"


def test_every_change_me_is_listed_in_the_guide():
    guide = GUIDE.read_text()
    for path in ALL_FILES:
        for token in set(re.findall(r"CHANGE_ME_\w+", path.read_text())):
            assert token in guide, f"{token} ({path.name}) is not explained in docs/cluster.md"


def test_guide_shows_how_to_reach_the_dashboard_and_share_the_token():
    guide = GUIDE.read_text()
    assert "ssh -N -L 8265:localhost:8265" in guide
    assert "kubectl port-forward svc/distmis-head-svc 8265:8265" in guide
    assert "ray dashboard cluster/launcher/aws-gpu.yaml" in guide
    assert ("kubectl create secret generic distmis-ray-token \\\n"
            "  --from-literal=auth_token=$(python -c 'import secrets;print(secrets.token_hex(32))')") in guide
    assert "tracking.uri" in guide and "0.0.0.0" in guide and "ShadowRay" in guide
    used = set(DISTMIS_COMMAND.findall(guide))
    assert {"cluster", "submit", "jobs", "status", "logs", "stop", "ui", "run"} <= used
    assert used <= COMMANDS, used - COMMANDS
