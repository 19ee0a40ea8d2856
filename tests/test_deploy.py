"""deploy/: the Kubernetes manifests and the Dockerfile, checked offline (no cluster, no Docker).

Every kustomize target (base and the four overlays) is rendered with ``kubectl kustomize`` and
every object validated strictly against the Kubernetes schema (``kubernetes-validate``);
the Prometheus Operator's kinds, which it has no schema for, are checked here by hand.
Then the manifests are checked against the code they run: ports and probe paths against
the routes the FastAPI apps really serve and the ports of the ConfigMap's run.yaml, env
names against the config schema and the names the code reads, container args against the
CLI's parser, Secret references against what the README or the demo overlay creates, the
grace period against the worker's drain, and the Redis probes' shell against LOADING. The
multi-node learner (overlays/gpu-multinode) is checked against torchrun_command, every node's
/healthz (learner/node_health.py) and where its checkpoints are read and written.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import textwrap
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from launch.checks import validate_run
from rlpipe.config import ConfigError, build_config, load_config

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
TARGETS = ["base", "overlays/cpu-demo", "overlays/gpu", "overlays/smollm2-math", "overlays/gpu-multinode"]
K8S_VERSION = "1.32"  # the kubectl here; kubernetes-validate's bundled schema for it
CRD_KINDS = {"PodMonitor", "PrometheusRule"}  # no bundled schema: checked structurally below
SOURCES = ["rlpipe", "launch", "learner", "rollout_service", "weight_sync", "quant"]
ROLES = {"learner": ("StatefulSet", "rlpipe-learner"), "rollout": ("Deployment", "rlpipe-rollout")}
FAKE_POD_IP = "10.1.2.3"
POD_INDEX = "metadata.labels['apps.kubernetes.io/pod-index']"  # set by the StatefulSet controller (>= 1.28)


def _kubectl() -> str:
    try:
        from tests.ops_tools import tool
    except ImportError:  # the monitoring helpers not there: the same rule inline
        import shutil

        found = shutil.which("kubectl")
        if found:
            return found
        why = "kubectl not found on PATH (it comes with the machine; see scripts/install.sh)"
        if os.environ.get("RLPIPE_REQUIRE_OPS_TOOLS") == "1":
            pytest.fail(why + " (RLPIPE_REQUIRE_OPS_TOOLS=1)")
        pytest.skip(why)
    return tool("kubectl")


_rendered: dict[str, list[dict]] = {}


def render(target: str) -> list[dict]:
    if target not in _rendered:
        out = subprocess.run([_kubectl(), "kustomize", str(K8S / target)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, f"kubectl kustomize {target} failed:\n{out.stderr}"
        _rendered[target] = [d for d in yaml.safe_load_all(out.stdout) if d]
    return _rendered[target]


def objects(docs, kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs, kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def workload(docs, role: str) -> dict:
    kind, name = ROLES[role]
    return one(docs, kind, name)


def container(obj: dict, name: str) -> dict:
    found = [c for c in obj["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    assert len(found) == 1, f"{obj['metadata']['name']}: no container {name}"
    return found[0]


def all_containers(obj: dict) -> list[dict]:
    spec = obj["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def run_config_text(docs) -> str:
    """run.yaml of the ConfigMap the roles mount (its name carries kustomize's hash)."""
    cm_name = {v["configMap"]["name"] for role in ROLES for v in workload(docs, role)["spec"]["template"]["spec"]["volumes"]
               if v["name"] == "config"}
    assert len(cm_name) == 1, f"learner and workers mount different run configs: {cm_name}"
    return one(docs, "ConfigMap", cm_name.pop())["data"]["run.yaml"]


def run_config(docs, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(run_config_text(docs))
    return load_config(path)


def env_of(c: dict, pod_name: str = "rlpipe-rollout-abc-1", pod_index: int = 0) -> dict[str, str]:
    """A container's env as the process would see it (downward API and Secrets faked)."""
    env = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "fieldRef" in e["valueFrom"]:
            fields = {"status.podIP": FAKE_POD_IP, "metadata.name": pod_name, POD_INDEX: str(pod_index)}
            env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[e["name"]] = "secret-from-" + e["valueFrom"]["secretKeyRef"]["name"]
    return env


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion of args."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in args]


@pytest.fixture(scope="module")
def routes() -> dict[str, set[str]]:
    """The paths the two apps really serve (create_app builds the routes; no engine starts)."""
    from learner.app import create_app as learner_app
    from rollout_service.app import create_app as rollout_app

    return {"learner": {r.path for r in learner_app(None).routes},
            "rollout": {r.path for r in rollout_app(build_config()).routes}}


# -- schema -------------------------------------------------------------------------------
@pytest.mark.parametrize("target", TARGETS)
def test_renders_and_validates_strictly(target):
    import kubernetes_validate

    docs = render(target)
    no_schema = set()
    for d in docs:
        try:
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            no_schema.add(d["kind"])
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{target}: {d['kind']} {d['metadata']['name']} is invalid: {e}")
    assert no_schema == CRD_KINDS, f"{target}: kinds without a schema: {no_schema}"


@pytest.mark.parametrize("target", TARGETS)
def test_monitoring_custom_resources(target, routes):
    docs = render(target)
    jobs = {}
    for pm in objects(docs, "PodMonitor"):
        assert pm["apiVersion"] == "monitoring.coreos.com/v1"
        selector = pm["spec"]["selector"]["matchLabels"]
        role = selector.get("app.kubernetes.io/component")
        assert role in ROLES, f"PodMonitor {pm['metadata']['name']} selects no rlpipe role: {selector}"
        pod = workload(docs, role)["spec"]["template"]
        pod0_labels = {**pod["metadata"]["labels"], "apps.kubernetes.io/pod-index": "0"}  # pod 0 of a StatefulSet
        assert selector.items() <= pod0_labels.items(), f"PodMonitor {role} selects no pod"
        ports = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        for ep in pm["spec"]["podMetricsEndpoints"]:
            assert ep["port"] in ports, f"PodMonitor {role}: no container port named {ep['port']}"
            assert ep["path"] in routes[role]
            job = [r["replacement"] for r in ep.get("relabelings", []) if r.get("targetLabel") == "job"]
            assert len(job) == 1 and ep["relabelings"][0].get("action", "replace") == "replace"
            jobs[role] = job[0]
            # every target (`up` too) carries the run's run_id, from the pods' instance label; the series' own stands
            run_id = [r for r in ep["relabelings"] if r.get("targetLabel") == "run_id"]
            assert run_id == [{"action": "replace", "targetLabel": "run_id",
                               "sourceLabels": ["__meta_kubernetes_pod_label_app_kubernetes_io_instance"]}]
            assert ep["honorLabels"] is True
        assert pm["metadata"]["labels"]["release"] == "kube-prometheus-stack"  # its default Prometheus selects it
    # the job names the alerts, the dashboard and `rlpipe up` select on
    assert jobs == {"learner": "rlpipe-learner", "rollout": "rlpipe-rollout"}
    run = yaml.safe_load(run_config_text(docs))["run_id"]
    for role in ROLES:
        assert workload(docs, role)["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/instance"] == run

    (rule,) = objects(docs, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    groups = rule["spec"]["groups"]
    assert groups, "PrometheusRule without groups"
    for g in groups:
        assert g["name"] and g["rules"], f"rule group {g.get('name')} is empty"
        for r in g["rules"]:
            assert isinstance(r.get("expr"), str) and r["expr"].strip()
            assert ("alert" in r) != ("record" in r), f"a rule must be an alert or a record: {r}"


@pytest.mark.parametrize("target", TARGETS)
def test_dashboard_configmap(target):
    import json

    cm = one(render(target), "ConfigMap", "rlpipe-dashboard")  # a stable name: no hash suffix
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    (text,) = cm["data"].values()
    assert json.loads(text) == json.loads((K8S / "base" / "monitoring" / "dashboard.json").read_text())


# -- manifests vs code ---------------------------------------------------------------------
@pytest.mark.parametrize("target", TARGETS)
def test_ports_and_probes_match_the_apps(target, routes, tmp_path):
    docs = render(target)
    cfg = run_config(docs, tmp_path)
    port = {"learner": cfg.learner.port, "rollout": cfg.rollout.port}
    assert port["learner"] and port["rollout"], "run.yaml must fix both ports (0 = any port)"
    for role, (kind, name) in ROLES.items():
        obj = workload(docs, role)
        c = container(obj, role)
        named = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert list(named.values()) == [port[role]], f"{name}: container ports {named} != run.yaml {port[role]}"
        probes = {k: c[k] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
        assert len(probes) == 3, f"{name}: missing probes"
        for kind_, probe in probes.items():
            get = probe["httpGet"]
            assert get["path"] in routes[role], f"{name} {kind_}: {get['path']} is not a route of the {role} app"
            assert named.get(get["port"], get["port"]) == port[role]
        assert probes["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert probes["startupProbe"]["httpGet"]["path"] == "/healthz"
        if role == "rollout":
            assert probes["readinessProbe"]["httpGet"]["path"] == "/readyz"
        notes = obj["spec"]["template"]["metadata"]["annotations"]
        assert notes["prometheus.io/scrape"] == "true"
        assert int(notes["prometheus.io/port"]) == port[role]
        assert notes["prometheus.io/path"] in routes[role]
        # the Services reach that port
        services = [s for s in objects(docs, "Service")
                    if s["spec"]["selector"].get("app.kubernetes.io/component") == role]
        assert services, f"no Service for {role}"
        for s in services:
            for p in s["spec"]["ports"]:
                assert p["port"] == port[role] and named.get(p["targetPort"], p["targetPort"]) == port[role]


@pytest.mark.parametrize("target", TARGETS)
def test_env_names_are_config_keys_or_read_by_the_code(target, tmp_path):
    docs = render(target)
    code = "\n".join(p.read_text() for d in SOURCES for p in (ROOT / d).rglob("*.py"))
    data = yaml.safe_load(run_config_text(docs))
    for obj in objects(docs, "StatefulSet") + objects(docs, "Deployment"):
        for c in all_containers(obj):
            env = env_of(c)
            for name, value in env.items():
                if not name.startswith("RLPIPE_"):
                    continue
                if "__" in name:  # a config override: it must name a real key and take the value
                    try:
                        build_config(data, environ={name: value})
                    except ConfigError as e:
                        pytest.fail(f"{obj['metadata']['name']}/{c['name']}: {name}: {e}")
                else:
                    assert f'"{name}"' in code, f"{obj['metadata']['name']}/{c['name']}: no code reads {name}"
    # the learner's sync store listens on its pod IP, which the workers can reach
    learner_env = env_of(container(workload(docs, "learner"), "learner"))
    cfg = build_config(data, environ=learner_env)
    assert cfg.sync.host == FAKE_POD_IP


@pytest.mark.parametrize("target", TARGETS)
def test_args_parse_with_the_cli(target):
    from launch.cli import _parser

    docs = render(target)
    config_paths = set()
    for role in ROLES:
        obj = workload(docs, role)
        c = container(obj, role)
        pod_name = f"{obj['metadata']['name']}-0"
        parser = _parser()
        args = parser.parse_args(expand(c["args"], env_of(c, pod_name)))
        assert args.command == role
        # exact option names, not prefixes argparse would also accept
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[role]
        options = {s for a in sub._actions for s in a.option_strings}
        assert {a for a in c["args"] if a.startswith("--")} <= options
        if role == "rollout":  # the worker id is the pod name, from the downward API
            assert args.worker_id == pod_name
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert args.config in mounts and mounts[args.config]["subPath"] == Path(args.config).name
        config_paths.add(args.config)
    assert len(config_paths) == 1


@pytest.mark.parametrize("target", TARGETS)
def test_run_config_matches_the_manifests(target, tmp_path):
    docs = render(target)
    cfg = run_config(docs, tmp_path)
    validate_run(cfg)
    assert cfg.run_id and cfg.run_dir
    for role in ROLES:  # reachable by probes and Prometheus; the API token makes that allowed
        assert getattr(cfg, role).host == "0.0.0.0"
    # Redis: the Service the URL names, on its port, with no password in the URL
    url = urlsplit(cfg.redis_url)
    assert url.password is None and url.username is None
    redis_svc = one(docs, "Service", url.hostname)
    assert redis_svc["spec"]["selector"]["app.kubernetes.io/component"] == "redis"
    assert [p["port"] for p in redis_svc["spec"]["ports"]] == [url.port]
    # the worker fleet the learner waits for is the Deployment's
    assert workload(docs, "rollout")["spec"]["replicas"] == cfg.workers

    def mount_of(role: str, path: str) -> tuple[dict, dict]:
        c = container(workload(docs, role), role)
        volumes = {v["name"]: v for v in workload(docs, role)["spec"]["template"]["spec"]["volumes"]}
        best = max((m for m in c["volumeMounts"] if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")),
                   key=lambda m: len(m["mountPath"]), default=None)
        assert best is not None, f"{role}: {path} is on no volume"
        return best, volumes[best["name"]]

    # checkpoints and run_dir on the shared claim: written by the learner, read by workers
    from rlpipe.checkpoints import checkpoint_root

    for path in (cfg.run_dir, str(checkpoint_root(cfg))):
        m, v = mount_of("learner", path)
        assert v["persistentVolumeClaim"]["claimName"] == "rlpipe-checkpoints" and not m.get("readOnly")
        m, v = mount_of("rollout", str(checkpoint_root(cfg)))
        assert v["persistentVolumeClaim"]["claimName"] == "rlpipe-checkpoints" and m.get("readOnly")
    claim = one(docs, "PersistentVolumeClaim", "rlpipe-checkpoints")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    # the same model for every role
    assert cfg.model.path
    for role in ROLES:
        m, v = mount_of(role, cfg.model.path)
        assert v["persistentVolumeClaim"]["claimName"] == "rlpipe-models" and m.get("readOnly")


@pytest.mark.parametrize("target", TARGETS)
def test_budgets_cover_drain_and_startup(target, tmp_path):
    docs = render(target)
    cfg = run_config(docs, tmp_path)

    def budget(probe):
        return probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)

    rollout = workload(docs, "rollout")
    grace = rollout["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= cfg.rollout.shutdown_deadline_s + 30, "the grace period must cover the drain plus engine shutdown"
    for role in ROLES:
        c = container(workload(docs, role), role)
        # both roles wait for Redis (redis_wait_s) before they serve /healthz
        assert budget(c["startupProbe"]) > cfg.redis_wait_s + cfg.learner.lease_ttl_s
    assert budget(container(rollout, "rollout")["startupProbe"]) >= (1200 if "gpu" in target else 600)
    learner = workload(docs, "learner")
    assert learner["spec"]["replicas"] == cfg.learner.nodes  # one pod per learner node
    assert learner["spec"]["template"]["spec"].get("restartPolicy", "Always") == "Always"
    assert cfg.learner.on_done == "serve", "an exited learner would be restarted in a loop"
    pdb = one(docs, "PodDisruptionBudget", "rlpipe-rollout")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= rollout["spec"]["template"]["metadata"]["labels"].items()


def test_the_smollm2_overlay_runs_the_recipe_on_the_model_it_builds():
    """overlays/smollm2-math is configs/smollm2-math.yaml on Kubernetes: every key the recipe sets has the recipe's
    value (but the local launcher's core pinning and the model, which the init container prepares by the recipe's
    name and links at the overlay's model.path)."""
    from launch.cli import _parser

    def flat(tree, prefix=""):
        for k, v in tree.items():
            yield from flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [(prefix + k, v)]

    docs = render("overlays/smollm2-math")
    overlay = dict(flat(yaml.safe_load(run_config_text(docs))))
    recipe = dict(flat(yaml.safe_load((ROOT / "configs" / "smollm2-math.yaml").read_text())))
    local_only = {"model.path", "rollout.cpus", "learner.cpus"}
    assert {k: v for k, v in recipe.items() if k not in local_only} == \
        {k: overlay.get(k) for k in recipe if k not in local_only}
    (init,) = workload(docs, "learner")["spec"]["template"]["spec"]["initContainers"]
    script = init["args"][0]
    build = re.search(r'"\$\(rlpipe (build-model [^)]*)\)"', script)
    assert build, script
    args = _parser().parse_args(build.group(1).split())
    assert args.command == "build-model" and args.set == [f"model.path={recipe['model.path']}"]
    assert f'ln -sfn "$path" {overlay["model.path"]}' in script
    assert {m["mountPath"]: m for m in init["volumeMounts"]}[args.config]["subPath"] == "run.yaml"


# -- secrets -------------------------------------------------------------------------------
def documented_secrets() -> dict[str, set[str]]:
    """Secrets deploy/k8s/README.md tells the operator to create: name -> keys."""
    text = (K8S / "README.md").read_text().replace("\\\n", " ")  # join continued lines
    out = {}
    for cmd in re.findall(r"kubectl create secret generic [^\n]*", text):
        name = cmd.split()[4]
        out[name] = set(re.findall(r"--from-(?:literal|file)=([\w.-]+)=", cmd))
    return out


@pytest.mark.parametrize("target", TARGETS)
def test_secret_references_exist(target):
    docs = render(target)
    defined = {s["metadata"]["name"]: set(s["data"]) for s in objects(docs, "Secret")}
    if target != "overlays/cpu-demo":
        assert not defined, "only the demo overlay may carry Secrets"
        defined = documented_secrets()
    assert defined, "no Secrets defined"
    refs = 0
    for obj in objects(docs, "StatefulSet") + objects(docs, "Deployment"):
        spec = obj["spec"]["template"]["spec"]
        for v in spec.get("volumes", []):
            if "secret" in v:
                refs += 1
                assert v["secret"]["secretName"] in defined, f"volume {v['name']}: unknown Secret"
        for c in all_containers(obj):
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    refs += 1
                    assert ref["key"] in defined.get(ref["name"], ()), f"{e['name']}: unknown Secret key {ref}"
    assert refs >= 5


@pytest.mark.parametrize("target", TARGETS)
def test_tokens_only_from_secrets(target):
    docs = render(target)
    demo_values = [v for s in objects(render("overlays/cpu-demo"), "Secret") for v in s["data"].values()]
    import base64

    demo_values = [base64.b64decode(v).decode() for v in demo_values]
    assert len(demo_values) == 3
    for cm in objects(docs, "ConfigMap"):
        for text in cm["data"].values():
            assert not any(v in text for v in demo_values), f"ConfigMap {cm['metadata']['name']} holds a secret"
    for obj in objects(docs, "StatefulSet") + objects(docs, "Deployment"):
        for c in all_containers(obj):
            for e in c.get("env", []):
                if re.search(r"TOKEN|PASSWORD$|REDISCLI_AUTH", e["name"]):
                    assert "secretKeyRef" in e.get("valueFrom", {}), f"{e['name']} must come from a Secret"
    # both roles hold the API token (needed to listen on 0.0.0.0) and the same sync token
    tokens = {role: {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container(workload(docs, role), role)["env"]
                     if e["name"] in ("RLPIPE_API_TOKEN", "RLPIPE_SYNC_TOKEN")} for role in ROLES}
    assert tokens["learner"] == tokens["rollout"] and len(tokens["learner"]) == 2


# -- Redis -----------------------------------------------------------------------------------
def test_redis_persistence_and_auth():
    docs = render("base")
    sts = one(docs, "StatefulSet", "rlpipe-redis")
    c = container(sts, "redis")
    args = c["args"]
    opts = dict(zip(args[::2], args[1::2]))
    assert opts["--appendonly"] == "yes" and opts["--appendfsync"] == "everysec"
    assert opts["--requirepass"] == "$(REDIS_PASSWORD)"
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"]}
    assert env["REDIS_PASSWORD"] == env["REDISCLI_AUTH"]
    (data,) = [m for m in c["volumeMounts"] if m["mountPath"] == opts["--dir"]]
    assert [t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]] == [data["name"]]
    assert sts["spec"]["serviceName"] == "rlpipe-redis-headless"
    assert one(docs, "Service", "rlpipe-redis-headless")["spec"]["clusterIP"] == "None"


@pytest.mark.parametrize("reply, ready, alive", [
    ("PONG", True, True),
    ("LOADING Redis is loading the dataset in memory", False, True),  # replaying the AOF
    ("Could not connect to Redis at 127.0.0.1:6379: Connection refused", False, False),
    ("AUTH failed: WRONGPASS invalid username-password pair or user is disabled.", False, False),
])
def test_redis_probes_tolerate_loading(reply, ready, alive, tmp_path):
    """The probes' shell, run against a stand-in redis-cli giving each reply (the replies are
    what redis-cli 6.2 printed against a real server, LOADING included)."""
    c = container(one(render("base"), "StatefulSet", "rlpipe-redis"), "redis")
    fake = tmp_path / "redis-cli"
    fake.write_text(f"#!/bin/sh\necho '{reply}'\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}

    def passes(probe: str) -> bool:
        return subprocess.run(c[probe]["exec"]["command"], env=env, timeout=10).returncode == 0

    assert passes("readinessProbe") == ready
    assert passes("livenessProbe") == alive
    assert passes("startupProbe") == alive
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 300


# -- the rest --------------------------------------------------------------------------------
@pytest.mark.parametrize("target", TARGETS)
def test_labels_resources_security(target, tmp_path):
    docs = render(target)
    for obj in objects(docs, "StatefulSet") + objects(docs, "Deployment"):
        name = obj["metadata"]["name"]
        labels = obj["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "rlpipe"
        assert labels["app.kubernetes.io/component"] in ("learner", "rollout", "redis")
        spec = obj["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["automountServiceAccountToken"] is False
        for c in all_containers(obj):
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), f"{name}/{c['name']}: requests"
            assert "memory" in c["resources"]["limits"], f"{name}/{c['name']}: memory limit"
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        gpus = [c["name"] for c in all_containers(obj) if "nvidia.com/gpu" in c["resources"].get("limits", {})]
        if "gpu" in target and name != "rlpipe-redis":
            assert gpus == [labels["app.kubernetes.io/component"]], f"{name}: GPU"
        else:
            assert not gpus, f"{name}: GPUs belong in the gpu overlay only"
    if "gpu" in target:  # one GPU per learner rank of the pod's node, torchrun inside the pod; a worker's engine's worth
        from launch.gpus import gpus_per_worker

        cfg = run_config(docs, tmp_path)
        limits = container(workload(docs, "learner"), "learner")["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) == cfg.learner.ranks
        limits = container(workload(docs, "rollout"), "rollout")["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) == gpus_per_worker(cfg)
        assert not cfg.rollout.gpus and not cfg.learner.gpus, "in a pod the device plugin picks the GPUs"
    # vLLM needs a real /dev/shm
    rollout = workload(docs, "rollout")
    (shm,) = [m for m in container(rollout, "rollout")["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (vol,) = [v for v in rollout["spec"]["template"]["spec"]["volumes"] if v["name"] == shm["name"]]
    assert vol["emptyDir"]["medium"] == "Memory"


def test_network_policy():
    docs = render("base")
    policies = {p["metadata"]["name"]: p["spec"] for p in objects(docs, "NetworkPolicy")}
    redis = policies["rlpipe-redis"]
    (rule,) = redis["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 6379}]
    (peer,) = rule["from"]
    allowed = {e["key"]: e["values"] for e in peer["podSelector"]["matchExpressions"]}
    assert allowed == {"app.kubernetes.io/name": ["rlpipe"], "app.kubernetes.io/component": ["learner", "rollout"]}
    for role, other, port in (("learner", "rollout", 8001), ("rollout", "learner", 8000)):
        spec = policies[f"rlpipe-{role}"]
        assert spec["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == role
        peers = {}
        for rule in spec["ingress"]:
            for p in rule["from"]:
                sel = p.get("podSelector", {})
                comps = sel.get("matchLabels", {}).get("app.kubernetes.io/component")
                comps = [comps] if comps else next((e["values"] for e in sel.get("matchExpressions", [])
                                                    if e["key"] == "app.kubernetes.io/component"), [])
                for comp in comps:
                    peers[comp] = rule["ports"]
                if "namespaceSelector" in p:
                    peers["monitoring"] = rule["ports"]
        assert peers[other] == [{"protocol": "TCP"}], f"{role}: gloo needs every TCP port from the {other}"
        assert peers["monitoring"] == [{"protocol": "TCP", "port": port}]


def test_dockerfile():
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["rlpipe"]' in text
    stages = dict(re.findall(r"^FROM (\S+) AS (\w+)$", text, re.M))
    assert set(stages.values()) == {"cpu", "gpu", "final"} and stages["${VARIANT}"] == "final"
    cpu, gpu = text.split(" AS cpu")[1].split(" AS gpu")
    assert "scripts/install.sh" in cpu and "nvidia/cuda" in text.split(" AS gpu")[0].splitlines()[-1]
    assert '".[gpu]"' in gpu
    user = re.findall(r"^USER (\S+)$", text, re.M)
    assert user and not user[-1].startswith(("0", "root"))
    assert "HF_HUB_OFFLINE=1" in text
    # the image's uid is the one the manifests run as
    uid = user[-1].split(":")[0]
    for obj in objects(render("base"), "StatefulSet") + objects(render("base"), "Deployment"):
        if obj["metadata"]["name"] != "rlpipe-redis":
            assert str(obj["spec"]["template"]["spec"]["securityContext"]["runAsUser"]) == uid


def test_readme_documents_every_referenced_secret():
    """The README's `kubectl create secret` lines are what base and gpu rely on."""
    documented = documented_secrets()
    assert set(documented) == {"rlpipe-tokens", "rlpipe-redis"}, textwrap.shorten(str(documented), 200)
    demo = {s["metadata"]["name"].rsplit("-", 1)[0]: set(s["data"]) for s in objects(render("overlays/cpu-demo"), "Secret")}
    assert demo == documented, "the demo overlay's Secrets and the documented ones differ"


# -- the multi-node learner (overlays/gpu-multinode) ------------------------------------------
MULTINODE = "overlays/gpu-multinode"


def test_multinode_learner_meets_at_pod_0(tmp_path):
    """One pod per learner node, all started together; each pod's torchrun gets its node rank
    from its pod index and meets the others at pod 0's name under the headless Service."""
    from launch.launcher import torchrun_command

    docs = render(MULTINODE)
    cfg = run_config(docs, tmp_path)
    lc = cfg.learner
    sts = workload(docs, "learner")
    spec = sts["spec"]
    assert lc.nodes > 1 and spec["replicas"] == lc.nodes
    assert spec["podManagementPolicy"] == "Parallel"  # node 0 waits for all nodes; OrderedReady would wait for node 0
    # the rendezvous host is pod 0 of the StatefulSet's governing Service, which is headless and
    # publishes pod 0's name before it is ready (it is ready only after the rendezvous)
    svc = one(docs, "Service", spec["serviceName"])
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    host, port = lc.rendezvous.rsplit(":", 1)
    assert host == f"{sts['metadata']['name']}-0.{svc['metadata']['name']}" and int(port) > 0
    # the node rank is the pod index, from the downward API
    c = container(sts, "learner")
    (rank_env,) = [e for e in c["env"] if e["name"] == "RLPIPE_LEARNER__NODE_RANK"]
    assert rank_env["valueFrom"]["fieldRef"]["fieldPath"] == POD_INDEX
    data = yaml.safe_load(run_config_text(docs))
    assert "node_rank" not in data["learner"], "the node rank must come from the pod, not the shared run.yaml"
    for index in range(spec["replicas"]):
        pod_cfg = build_config(data, environ=env_of(c, f"{sts['metadata']['name']}-{index}", index))
        assert pod_cfg.learner.node_rank == index
        cmd, _ = torchrun_command(pod_cfg, ["learner", "--config", "/etc/rlpipe/run.yaml"])
        opts = dict(zip(cmd, cmd[1:]))
        assert opts["--nnodes"] == str(lc.nodes) and opts["--node-rank"] == str(index)
        assert opts["--rdzv-backend"] == "static" and opts["--rdzv-endpoint"] == lc.rendezvous
        assert opts["--nproc-per-node"] == str(lc.ranks)
    # one GPU per rank of the node, requested and limited
    resources = c["resources"]
    assert int(resources["requests"]["nvidia.com/gpu"]) == int(resources["limits"]["nvidia.com/gpu"]) == lc.ranks
    assert not lc.gpus


def _learner_peer_rules(policy: dict, labels: dict) -> list[list[dict]]:
    """The ports of the ingress rules of ``policy`` that admit pods with ``labels`` (same namespace)."""
    def selects(sel: dict) -> bool:
        if not sel.get("matchLabels", {}).items() <= labels.items():
            return False
        for e in sel.get("matchExpressions", []):
            if e["operator"] != "In" or labels.get(e["key"]) not in e["values"]:
                return False
        return True

    if not selects(policy["spec"]["podSelector"]):
        return []
    return [rule.get("ports", [])
            for rule in policy["spec"].get("ingress", [])
            if any("podSelector" in p and "namespaceSelector" not in p and selects(p["podSelector"]) for p in rule["from"])]


def test_multinode_network_policy_admits_learner_to_learner(tmp_path):
    """The nodes reach each other on the rendezvous port and NCCL's ephemeral ports (every TCP
    port); the base admits only workers and Prometheus to the learner."""
    docs = render(MULTINODE)
    labels = workload(docs, "learner")["spec"]["template"]["metadata"]["labels"]
    port = int(run_config(docs, tmp_path).learner.rendezvous.rsplit(":", 1)[1])

    def admitted(docs) -> list[list[dict]]:
        return [ports for p in objects(docs, "NetworkPolicy") for ports in _learner_peer_rules(p, labels)]

    rules = admitted(docs)
    assert [{"protocol": "TCP"}] in rules, f"learner pods may not reach each other on every TCP port: {rules}"
    assert any(p.get("port") in (None, port) for ports in rules for p in ports)
    assert not admitted(render("overlays/gpu")), "the one-node learner needs no learner-to-learner rule"


def test_multinode_learner_probes(tmp_path):
    """One httpGet /healthz for every node (one pod template): node 0's learner app serves it
    (test_ports_and_probes_match_the_apps), the other nodes' learner/node_health.py too, on
    the same port, and its check of node 0's store fits in the probes' timeout."""
    from learner.node_health import PATH, TIMEOUT_S

    docs = render(MULTINODE)
    c = container(workload(docs, "learner"), "learner")
    http_port = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert run_config(docs, tmp_path).learner.port in http_port.values()
    for k in ("startupProbe", "livenessProbe", "readinessProbe"):
        probe = c[k]
        assert "exec" not in probe, f"{k}: the exec probe is replaced by every node's /healthz"
        assert probe["httpGet"]["path"] == PATH and probe["httpGet"]["port"] in http_port
        assert probe.get("timeoutSeconds", 1) > TIMEOUT_S, f"{k}: shorter than node_health's check of node 0"


def test_multinode_checkpoints_are_read_and_written_by_node_0_alone(tmp_path):
    """One pod template gives every learner pod the checkpoint claim (the base's, which the
    workers read too), but with the overlay's run.yaml only global rank 0 (pod 0) reads and
    writes checkpoints: the full format, which the learner restores on rank 0 alone and sends
    to the other ranks (learner/checkpointer.py checkpoint_roles, Checkpointer.load). A
    sharded format would have every node write its shards into that directory."""
    from learner.checkpointer import checkpoint_roles

    docs = render(MULTINODE)
    lc = run_config(docs, tmp_path).learner
    fsdp = lc.parallel in ("auto", "fsdp")
    assert checkpoint_roles(lc, fsdp, lc.nodes * lc.ranks) == (False, True)
    assert checkpoint_roles(lc.model_copy(update={"nodes": 1}), fsdp, lc.ranks)[1] is False, "one node: every rank reads"
    assert checkpoint_roles(lc.model_copy(update={"checkpoint_format": "sharded"}), fsdp,
                            lc.nodes * lc.ranks) == (True, False)
    spec = workload(docs, "learner")["spec"]
    assert "volumeClaimTemplates" not in spec, "the checkpoints are one claim, shared with the workers"


AUTOSCALED = ["overlays/gpu", "overlays/gpu-multinode"]  # they include components/autoscale


def test_only_the_gpu_overlays_autoscale():
    for target in TARGETS:
        hpas = [d["metadata"]["name"] for d in render(target) if d["kind"] == "HorizontalPodAutoscaler"]
        assert hpas == (["rlpipe-rollout"] if target in AUTOSCALED else []), target


@pytest.mark.parametrize("target", AUTOSCALED)
def test_an_autoscaled_fleet_follows_the_learners_metric_within_the_run_configs_bounds(target, tmp_path):
    """The HorizontalPodAutoscaler (components/autoscale) scales the rollout Deployment to the
    metric the learner exports, through the prometheus-adapter rule shipped beside it, within
    the bounds the learner's rule uses (run.yaml autoscale): one number for every scaler."""
    from learner.metrics import METRICS

    docs = render(target)
    (hpa,) = [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    cfg = run_config(docs, tmp_path)
    spec = hpa["spec"]
    ref = spec["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ROLES["rollout"]
    assert (spec["minReplicas"], spec["maxReplicas"]) == (cfg.autoscale.min_workers, cfg.autoscale.max_workers)
    assert cfg.autoscale.min_workers <= workload(docs, "rollout")["spec"]["replicas"] <= cfg.autoscale.max_workers
    (metric,) = spec["metrics"]
    name = metric["external"]["metric"]["name"]
    assert name.startswith("rlpipe_") and name[len("rlpipe_"):] in METRICS  # the learner exports it
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}  # replicas = desired
    adapter = yaml.safe_load((K8S / "components" / "autoscale" / "prometheus-adapter-values.yaml").read_text())
    (rule,) = adapter["rules"]["external"]
    assert rule["name"]["as"] == name and name in rule["seriesQuery"] and "<<.Series>>" in rule["metricsQuery"]
    assert rule["resources"]["overrides"]["namespace"] == {"resource": "namespace"}
