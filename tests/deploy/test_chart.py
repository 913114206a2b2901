"""The Helm chart and the KServe objects, offline: render every values file, lint, reject values
that break the schema, validate every object against two Kubernetes versions' schemas, and
check that the objects agree with each other and with the exspec code."""
from __future__ import annotations

import re

import pytest
import yaml

from deploykit import (CHART, KSERVE, VALUES_FILES, deep_merge, load_values, need_module, one,
                      registry_series, render)

KUBERNETES_VERSIONS = ("1.29.0", "1.37.0")
# Kinds whose schemas come with their operators, not with Kubernetes: allowed without one.
CUSTOM_RESOURCES = {
    ("monitoring.coreos.com/v1", "PodMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("keda.sh/v1alpha1", "ScaledObject"), ("serving.kserve.io/v1alpha1", "ServingRuntime"),
    ("serving.kserve.io/v1beta1", "InferenceService"),
}


@pytest.fixture(scope="module", params=VALUES_FILES)
def rendered(request):
    return request.param, render(load_values(request.param))


def kserve_objects() -> list[dict]:
    return [doc for path in sorted(KSERVE.glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def pod_spec(docs) -> dict:
    return one(docs, "Deployment")["spec"]["template"]["spec"]


def container(docs) -> dict:
    (c,) = pod_spec(docs)["containers"]
    return c


def args_of(c: dict) -> dict:
    return dict(a[2:].split("=", 1) for a in c["args"] if a.startswith("--") and "=" in a)


def model_config(docs) -> tuple[str, dict]:
    data = one(docs, "ConfigMap", "-model")["data"]
    import json
    return data["config.pbtxt"], json.loads(data["model.json"])


def pbtxt_parameters(pbtxt: str) -> dict:
    return dict(re.findall(r'key: "([^"]+)", value: \{ string_value: "([^"]*)" \}', pbtxt))


# -- render, lint, schema --------------------------------------------------------------------
@pytest.mark.parametrize("name", VALUES_FILES)
def test_every_values_file_renders_and_lints_clean(name):
    helm = need_module("helm_python")
    docs = render(load_values(name))
    kinds = sorted(d["kind"] for d in docs)
    assert {"ConfigMap", "Deployment", "Service"} <= set(kinds), kinds
    report = helm.lint(str(CHART), load_values(name), strict=True, kube_version="v1.29.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not problems, f"helm lint on {name}.yaml: {problems}"


def test_defaults_render_without_a_values_file():
    docs = render()
    assert one(docs, "Deployment")


SCHEMA_VIOLATIONS = {
    "unknown top-level key": {"replicas": 3},
    "unknown engine-free model key": {"model": {"name": "other"}},
    "placement cpu with GPUs": {"model": {"placement": "cpu", "gpus": 2}},
    "per-gpu with no GPU": {"model": {"placement": "per-gpu", "gpus": 0}},
    "multi-gpu on one GPU": {"model": {"placement": "multi-gpu", "gpus": 1}},
    "deviceMap without multi-gpu": {"model": {"deviceMap": "auto"}},
    "unknown placement": {"model": {"placement": "tpu"}},
    "engine dtype": {"model": {"engine": {"dtype": "int4"}}},
    "negative k": {"model": {"engine": {"num_speculative_tokens": -1}}},
    "pvc without a claim": {"modelStore": {"type": "pvc", "claimName": ""}},
    "relative drain file": {"drain": {"file": "drain"}},
    "stream length zero": {"longestStreamSeconds": 0},
    "extra arg not a flag": {"extraArgs": ["model-repository=/x"]},
    "unknown autoscaler": {"autoscaling": {"engine": "vpa"}},
    "shm size not a quantity": {"shmSize": "lots"},
    "admin header gRPC cannot carry": {"adminApi": {"header": "X-Admin-Key"}},
    "admin secret not a name": {"adminApi": {"existingSecret": "My Secret"}},
    "openai port on a KServe port": {"openaiFrontend": {"enabled": True, "port": 8001}},
    "unknown openai frontend key": {"openaiFrontend": {"host": "0.0.0.0"}},
}


@pytest.mark.parametrize("case", sorted(SCHEMA_VIOLATIONS))
def test_values_that_break_the_schema_are_refused(case):
    helm = need_module("helm_python")
    values = deep_merge(load_values("gpu"), SCHEMA_VIOLATIONS[case])
    with pytest.raises(helm.HelmValuesError):
        render(values)


# -- Kubernetes schemas ----------------------------------------------------------------------
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_validates_strictly_against_kubernetes(rendered, version):
    kv = need_module("kubernetes_validate")
    name, docs = rendered
    checked = []
    for doc in docs + kserve_objects():
        what = f"{name}.yaml {doc['kind']}/{doc['metadata']['name']} on Kubernetes {version}"
        try:
            kv.validate(doc, version, strict=True)
            checked.append(doc["kind"])
        except kv.SchemaNotFoundError:
            assert (doc["apiVersion"], doc["kind"]) in CUSTOM_RESOURCES, \
                f"{what}: no schema and not a listed custom resource"
        except kv.ValidationError as exc:
            path = ".".join(map(str, exc.path))
            pytest.fail(f"{what}: {path}: {exc.message}")
    assert "Deployment" in checked and "Service" in checked


def test_strict_validation_catches_a_misspelt_field():
    kv = need_module("kubernetes_validate")
    doc = one(render(load_values("cpu")), "Deployment")
    doc["spec"]["template"]["spec"]["terminationGracePeriod"] = 30
    with pytest.raises(kv.ValidationError):
        kv.validate(doc, KUBERNETES_VERSIONS[0], strict=True)


# -- cross references ------------------------------------------------------------------------
def test_selectors_match_the_pod_labels(rendered):
    _, docs = rendered
    labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    selectors = [one(docs, "Deployment")["spec"]["selector"]["matchLabels"]]
    selectors += [d["spec"]["selector"] for d in docs if d["kind"] == "Service"]
    selectors += [d["spec"]["selector"]["matchLabels"] for d in docs
                  if d["kind"] in ("PodDisruptionBudget", "PodMonitor")]
    for selector in selectors:
        assert selector and selector.items() <= labels.items(), (selector, labels)


def test_services_target_named_container_ports(rendered):
    _, docs = rendered
    ports = {p["name"]: p["containerPort"] for p in container(docs)["ports"]}
    assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002}
    args = args_of(container(docs))
    assert (int(args["http-port"]), int(args["grpc-port"]), int(args["metrics-port"])) == \
        (8000, 8001, 8002)
    for service in (d for d in docs if d["kind"] == "Service"):
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, port
            assert port["port"] == ports[port["targetPort"]], port
            if port["name"] == "grpc":
                assert port["appProtocol"] == "kubernetes.io/h2c"
    for monitor in (d for d in docs if d["kind"] == "PodMonitor"):
        assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= set(ports)


def test_probes_hit_triton_health_on_the_http_port(rendered):
    name, docs = rendered
    c = container(docs)
    expected = {"startupProbe": "/v2/health/ready", "readinessProbe": "/v2/health/ready",
                "livenessProbe": "/v2/health/live"}
    for probe, path in expected.items():
        assert c[probe]["httpGet"] == {"path": path, "port": "http"}, (probe, c[probe])
    startup = c["startupProbe"]
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    assert budget >= load_values(name)["startupSeconds"], "startup probe gives up before the model loads"


def test_grace_period_covers_prestop_plus_exit_timeout_and_the_drain(rendered):
    _, docs = rendered
    spec, c = pod_spec(docs), container(docs)
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[:2] == ["/bin/sh", "-c"]
    sleep = int(re.search(r"sleep (\d+)", pre_stop[2]).group(1))
    args = args_of(c)
    exit_timeout = int(args["exit-timeout-secs"])
    assert spec["terminationGracePeriodSeconds"] >= sleep + exit_timeout
    pbtxt, _ = model_config(docs)
    params = pbtxt_parameters(pbtxt)
    drain = float(params["drain_timeout_s"])
    # The model ends late streams before Triton gives up on them, with time for the responses.
    assert drain + 5 <= sleep + exit_timeout, (drain, sleep, exit_timeout)
    # preStop creates the very file the model watches, in a writable volume.
    assert f"touch {params['drain_file']}" in pre_stop[2]
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert params["drain_file"].rsplit("/", 1)[0] in mounts
    # A connection past its age still finishes its longest stream.
    assert int(args["grpc-max-connection-age-grace"]) >= drain * 1000


def test_dev_shm_is_an_in_memory_volume(rendered):
    _, docs = rendered
    mounts = {m["mountPath"]: m["name"] for m in container(docs)["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec(docs)["volumes"]}
    assert "/dev/shm" in mounts, "the Python backend needs /dev/shm"
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"


def test_config_files_are_mounted_over_the_image_repository(rendered):
    _, docs = rendered
    c = container(docs)
    assert args_of(c)["model-repository"] == "/models"
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/models/exspec/config.pbtxt"]["subPath"] == "config.pbtxt"
    assert mounts["/models/exspec/1/model.json"]["subPath"] == "model.json"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["HF_HUB_OFFLINE"] == "1", "pods must never download weights"


def test_gpu_limits_match_the_instance_group(rendered):
    name, docs = rendered
    c = container(docs)
    gpus = int(c["resources"].get("limits", {}).get("nvidia.com/gpu", 0))
    assert int(c["resources"]["requests"].get("nvidia.com/gpu", 0)) == gpus
    pbtxt, engine = model_config(docs)
    group = re.search(r"instance_group \[ \{ (.*) \} \]", pbtxt).group(1)
    placement = load_values(name)["model"]["placement"]
    if placement == "cpu":
        assert gpus == 0 and "kind: KIND_CPU" in group
    elif placement == "per-gpu":
        ids = [int(x) for x in re.search(r"gpus: \[ ([0-9, ]+) \]", group).group(1).split(",")]
        assert "kind: KIND_GPU" in group and "count: 1" in group
        assert ids == list(range(gpus)), f"instances on GPUs {ids} but the pod has {gpus}"
        assert "device_map" not in engine
    else:
        assert "kind: KIND_MODEL" in group and "count: 1" in group and gpus >= 2
        assert engine["device"] == "cuda:0" and engine.get("device_map")


def test_the_rendered_model_json_is_an_engine_config_exspec_loads(rendered):
    """Every key the chart writes must be one the engine knows, with a value it accepts (the
    big-target device_map included): a typo here would only show as a pod that never starts."""
    from exspec import EngineConfig
    _, engine = model_config(rendered[1])
    EngineConfig.from_dict(engine)   # raises on an unknown key or a refused value


def test_every_metric_the_autoscalers_and_rules_use_is_exported_by_exspec(rendered):
    name, docs = rendered
    known = registry_series()
    used = set()
    for doc in docs:
        if doc["kind"] == "HorizontalPodAutoscaler":
            used |= {m["pods"]["metric"]["name"] for m in doc["spec"]["metrics"]}
        elif doc["kind"] == "ScaledObject":
            used |= {n for t in doc["spec"]["triggers"] for n in metric_names(t["metadata"]["query"])}
        elif doc["kind"] == "PrometheusRule":
            for group in doc["spec"]["groups"]:
                for rule in group["rules"]:
                    used |= metric_names(rule["expr"])
    recorded = {r["record"] for d in docs if d["kind"] == "PrometheusRule"
                for g in d["spec"]["groups"] for r in g["rules"] if "record" in r}
    unknown = sorted(used - known - recorded)
    assert not unknown, f"{name}.yaml uses metrics exspec does not export: {unknown}"
    if load_values(name)["autoscaling"]["enabled"]:
        assert "exspec:num_requests_waiting" in used


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: names with a colon, or ending in a metric suffix."""
    expr = re.sub(r'"[^"]*"', '""', expr)            # label values
    expr = re.sub(r"\{[^}]*\}", "", expr)             # matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)           # ranges
    expr = re.sub(r"\b(by|without)\s*\([^)]*\)", "", expr)
    words = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr))
    functions = {"sum", "avg", "rate", "histogram_quantile", "max", "min", "count", "irate",
                 "increase", "and", "or", "unless", "on", "ignoring"}
    return {w for w in words if w not in functions and (":" in w or w.endswith("_total"))}


def test_only_one_autoscaler_at_a_time():
    for name in VALUES_FILES:
        docs = render(load_values(name))
        scalers = [d["kind"] for d in docs if d["kind"] in ("HorizontalPodAutoscaler", "ScaledObject")]
        auto = load_values(name)["autoscaling"]
        assert len(scalers) == (1 if auto["enabled"] else 0), (name, scalers)
        deployment = one(docs, "Deployment")
        assert ("replicas" in deployment["spec"]) == (not auto["enabled"]), \
            f"{name}: a fixed replica count would fight the autoscaler"
        for hpa in (d for d in docs if d["kind"] == "HorizontalPodAutoscaler"):
            assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
            behavior = hpa["spec"]["behavior"]
            assert behavior["scaleUp"]["stabilizationWindowSeconds"] < \
                behavior["scaleDown"]["stabilizationWindowSeconds"]


# -- the admin key ---------------------------------------------------------------------------
ADMIN_GROUPS = {"shared-memory", "model-config", "model-repository", "statistics", "trace",
                "logging"}      # every Triton API group but health, metadata and inference
RESTRICTION_FLAGS = {"--http-restricted-api", "--grpc-restricted-protocol"}


def restrictions(c: dict) -> dict:
    """Triton's restriction flags, `<groups>:<header>=<key>`: flag -> (groups, header, key)."""
    out = {}
    for arg in c["args"]:
        flag, _, spec = arg.partition("=")
        if flag in RESTRICTION_FLAGS:
            groups, _, rest = spec.partition(":")
            header, _, key = rest.partition("=")
            out[flag] = (set(groups.split(",")), header, key)
    return out


def key_source(c: dict) -> dict:
    """The Secret reference both restriction flags of container `c` take their key from,
    through its env."""
    env = {e["name"]: e for e in c["env"]}
    found = restrictions(c)
    assert set(found) == RESTRICTION_FLAGS, f"restriction flags: {sorted(found)}"
    refs = []
    for flag, (groups, header, key) in found.items():
        assert groups == ADMIN_GROUPS, f"{flag} restricts {sorted(groups)}"
        assert header == "exspec-admin-key", (flag, header)
        variable = re.fullmatch(r"\$\((\w+)\)", key)
        assert variable, f"{flag}: the key {key!r} is not taken from the env"
        refs.append(env[variable.group(1)]["valueFrom"]["secretKeyRef"])
    assert refs[0] == refs[1], refs
    return refs[0]


def test_admin_apis_need_a_generated_key_over_both_protocols(rendered):
    import base64
    _, docs = rendered
    ref = key_source(container(docs))
    secret = one(docs, "Secret")
    assert ref["name"] == secret["metadata"]["name"]
    assert len(base64.b64decode(secret["data"][ref["key"]])) >= 32


def test_an_existing_secret_replaces_the_generated_one():
    docs = render({"adminApi": {"existingSecret": "ops-triton-key", "secretKey": "token"}})
    assert key_source(container(docs)) == {"name": "ops-triton-key", "key": "token"}
    assert not [d for d in docs if d["kind"] == "Secret"], "a second key was generated"


def test_an_existing_secret_renders_the_same_manifests_every_time():
    """GitOps: `helm template` run twice must agree, so a synced cluster never sees a new key.
    With the generated Secret it cannot (helm template has no cluster to look the old key up
    in): the negative control."""
    gitops = {"adminApi": {"existingSecret": "ops-triton-key"}}
    docs = render(gitops)
    assert docs == render(gitops)
    # Triton reads the key from its argv only: it must stay inside the container's PID namespace
    assert not pod_spec(docs).get("shareProcessNamespace"), "other containers would see the key"
    generated = [one(render({}), "Secret")["data"] for _ in range(2)]
    assert generated[0] != generated[1], "the generated key is expected to change per render"


def test_opting_out_renders_no_restriction_and_no_secret():
    docs = render({"adminApi": {"restricted": False}})
    c = container(docs)
    assert not restrictions(c) and "EXSPEC_ADMIN_KEY" not in {e["name"] for e in c["env"]}
    assert not [d for d in docs if d["kind"] == "Secret"]


# -- the OpenAI frontend option ------------------------------------------------------------
OPENAI_CASES = {"beside KServe": {"kserve": True}, "alone": {"kserve": False}}


def openai_docs(case: str) -> list[dict]:
    return render(deep_merge(load_values("gpu"), {
        "openaiFrontend": {"enabled": True, "port": 9100, **OPENAI_CASES[case]}}))


@pytest.mark.parametrize("case", sorted(OPENAI_CASES))
def test_openai_frontend_option_runs_the_entry_point_on_its_port(case):
    """The container runs exspec-openai with arguments its own parser takes, on the chosen
    port, and keeps the KServe ports only when asked."""
    from exspec.serving.openai_frontend import parse_args
    c = container(openai_docs(case))
    assert c["command"] == ["exspec-openai"]
    args, frontend_args = parse_args(c["args"])
    assert (args.model_repository, args.openai_port) == ("/models", 9100)
    assert args.host == "0.0.0.0", "exspec-openai listens on loopback unless told: no Service"
    # open KServe ports are the operator's explicit choice (exspec-openai refuses them else)
    assert args.unrestricted_kserve == OPENAI_CASES[case]["kserve"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    if OPENAI_CASES[case]["kserve"]:
        assert ports == {"openai": 9100, "http": 8000, "grpc": 8001}
        assert frontend_args == ["--enable-kserve-frontends", "--kserve-http-port=8000",
                                 "--kserve-grpc-port=8001"]
    else:
        assert ports == {"openai": 9100} and frontend_args == []
    assert not any(a.startswith("--exit-timeout-secs") for a in c["args"]), \
        "tritonserver flags must not reach the frontend"


@pytest.mark.parametrize("case", sorted(OPENAI_CASES))
def test_openai_frontend_probes_services_and_scrapes_its_port(case):
    docs = openai_docs(case)
    c = container(docs)
    assert c["startupProbe"]["httpGet"] == {"path": "/health/ready", "port": "openai"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/health/ready", "port": "openai"}
    assert c["livenessProbe"]["tcpSocket"] == {"port": "openai"}
    budget = c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
    assert budget >= load_values("gpu")["startupSeconds"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for service in (d for d in docs if d["kind"] == "Service"):
        targets = {p["targetPort"]: p["port"] for p in service["spec"]["ports"]}
        assert targets.get("openai") == 9100, service["metadata"]["name"]
        assert set(targets) <= set(ports), f"{service['metadata']['name']} targets {targets}"
        assert all(targets[name] == ports[name] for name in targets)
    (monitor,) = [d for d in docs if d["kind"] == "PodMonitor"]
    assert [(e["port"], e["path"]) for e in monitor["spec"]["podMetricsEndpoints"]] == \
        [("openai", "/metrics")]


@pytest.mark.parametrize("case", sorted(OPENAI_CASES))
def test_openai_frontend_option_lints_clean(case):
    helm = need_module("helm_python")
    values = deep_merge(load_values("gpu"), {"openaiFrontend": {"enabled": True,
                                                                **OPENAI_CASES[case]}})
    report = helm.lint(str(CHART), values, strict=True, kube_version="v1.29.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not problems, f"helm lint with the OpenAI frontend {case}: {problems}"


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_openai_frontend_objects_validate_strictly(version):
    kv = need_module("kubernetes_validate")
    for case in OPENAI_CASES:
        for doc in openai_docs(case):
            try:
                kv.validate(doc, version, strict=True)
            except kv.SchemaNotFoundError:
                assert (doc["apiVersion"], doc["kind"]) in CUSTOM_RESOURCES
            except kv.ValidationError as exc:
                pytest.fail(f"{case}: {doc['kind']}: {'.'.join(map(str, exc.path))}: {exc.message}")


# -- KServe ----------------------------------------------------------------------------------
def test_kserve_runtime_and_service_agree():
    objects = {d["kind"]: d for d in kserve_objects()}
    runtime, isvc = objects["ServingRuntime"], objects["InferenceService"]
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    (c,) = runtime["spec"]["containers"]
    args = args_of(c)
    ports = {p["containerPort"] for p in c["ports"]}
    assert {int(args["http-port"]), int(args["grpc-port"]), int(args["metrics-port"])} <= ports
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["port"] == int(args["http-port"])
    sleep = int(re.search(r"sleep (\d+)", c["lifecycle"]["preStop"]["exec"]["command"][2]).group(1))
    grace = isvc["spec"]["predictor"]["terminationGracePeriodSeconds"]
    assert grace >= sleep + int(args["exit-timeout-secs"])
    assert key_source(c)["name"] in (KSERVE / "README.md").read_text(), "no Secret to create"
    gpus = model["resources"]["limits"]["nvidia.com/gpu"]
    assert int(gpus) == 1
    readme = (KSERVE / "README.md").read_text()
    drain = float(re.search(r'"drain_timeout_s", value: \{ string_value: "(\d+)"', readme).group(1))
    assert 0 < drain and drain + 5 <= sleep + int(args["exit-timeout-secs"])
    assert "/dev/shm/exspec-drain" in readme and "touch /dev/shm/exspec-drain" in \
        c["lifecycle"]["preStop"]["exec"]["command"][2]
