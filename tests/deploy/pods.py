"""Run a rendered pod's container on loopback: the real tritonserver with the Deployment's
command arguments, env (Secret entries included, expanded into the arguments as `$(VAR)`),
ports, volume mounts and preStop hook, as a kubelet would, with each container path mapped into
a temporary folder and each container port onto a free port."""
from __future__ import annotations

import base64
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from deploykit import REPO, need_module, one

from exspec.serving.install import find_tritonserver, install
from exspec.serving.launcher import stub_environment
from exspec.serving.ports import reserve_ports
from exspec.demo.tiny import build_tokenizer, llama, noisy_copy, save_pair


def build_pair(out: Path) -> Path:
    """A tiny Llama pair with room for long streams (the drain test needs a few seconds)."""
    tokenizer = build_tokenizer()
    target = llama(len(tokenizer), 11, layers=2, hidden=64, max_positions=4096,
                   eos_token_id=tokenizer.eos_token_id)
    return save_pair(out, tokenizer, target, noisy_copy(target, 12, scale=0.05))


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Path:
    """The pair a test module's pod serves (import it as a fixture; its clients need
    tritonclient)."""
    need_module("tritonclient.grpc")
    return build_pair(tmp_path_factory.mktemp("pair"))


class SimulatedPod:
    """One pod of a rendered Deployment: start(), probe(), pre_stop(), sigterm(), wait()."""

    def __init__(self, docs: list[dict], root: Path, model_store: Path):
        self.deployment = one(docs, "Deployment")
        self.spec = self.deployment["spec"]["template"]["spec"]
        (self.container,) = self.spec["containers"]
        self.root = root
        self.mounts: dict[str, Path] = {}       # container path -> host path
        # Held until the pod's startup probe passes (its server has bound them by then).
        self._reservation = reserve_ports(len(self.container["ports"]))
        self.ports = {p["containerPort"]: port for p, port in
                      zip(self.container["ports"], self._reservation.ports)}
        self.named_ports = {p["name"]: self.ports[p["containerPort"]] for p in self.container["ports"]}
        self.secrets = {d["metadata"]["name"]: {k: base64.b64decode(v).decode()
                                                for k, v in d.get("data", {}).items()}
                        for d in docs if d["kind"] == "Secret"}
        self._lay_out(docs, model_store)
        self.process: subprocess.Popen | None = None
        self.log = root / "tritonserver.log"

    # -- the container's file system -----------------------------------------------------------
    def _lay_out(self, docs, model_store: Path):
        image_models = self.root / "image" / "models"      # what the Dockerfile copies to /models
        shutil.copytree(REPO / "model_repository" / "exspec_unary", image_models / "exspec_unary",
                        ignore=shutil.ignore_patterns("__pycache__"))
        (image_models / "exspec" / "1").mkdir(parents=True)
        self.mounts["/models"] = image_models
        volumes = {v["name"]: v for v in self.spec["volumes"]}
        configmaps = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
        files = []
        for mount in self.container["volumeMounts"]:
            volume = volumes[mount["name"]]
            path = mount["mountPath"]
            if path == "/dev/shm":
                continue                     # the host's /dev/shm (checked in test_chart)
            if "configMap" in volume:        # written once every folder is mapped
                files.append((path, configmaps[volume["configMap"]["name"]][mount["subPath"]]))
            elif "emptyDir" in volume:
                self.mounts[path] = self.root / "volumes" / mount["name"]
                self.mounts[path].mkdir(parents=True)
            else:                            # the model store: a PVC or a host folder
                self.mounts[path] = model_store
        for path, data in files:
            self.host(path).write_text(self._rewrite(data))

    def host(self, path: str) -> Path:
        """The host path of a container path (longest mount prefix wins)."""
        for prefix in sorted(self.mounts, key=len, reverse=True):
            if path == prefix or path.startswith(prefix + "/"):
                return self.mounts[prefix] / path[len(prefix):].lstrip("/")
        raise AssertionError(f"{path} is on no volume of the rendered pod")

    def _rewrite(self, text: str) -> str:
        """Container paths inside a config file or command -> host paths (model.json, pbtxt)."""
        for prefix in sorted(self.mounts, key=len, reverse=True):
            text = text.replace(f'"{prefix}/', f'"{self.mounts[prefix]}/')
            text = text.replace(f" {prefix}/", f" {self.mounts[prefix]}/")
        return text

    # -- the process ---------------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        """The container's own env as the kubelet resolves it: values and Secret entries."""
        env = {}
        for item in self.container.get("env", []):
            if "value" in item:
                value = item["value"]
                env[item["name"]] = str(self.host(value)) if value.startswith("/") else value
            else:
                ref = item["valueFrom"]["secretKeyRef"]
                assert ref["name"] in self.secrets, f"Secret {ref['name']} is not in the release"
                env[item["name"]] = self.secrets[ref["name"]][ref["key"]]
        return env

    def command(self, backends: Path, dist, env: dict[str, str]) -> list[str]:
        assert self.container["command"] == ["tritonserver"]
        cmd = [str(dist.binary)]
        for arg in self.container["args"]:
            flag, _, value = expand(arg, env).partition("=")
            if flag.endswith("-port") and int(value) in self.ports:
                value = str(self.ports[int(value)])
            elif value.startswith("/"):
                value = str(self.host(value))
            cmd.append(f"{flag}={value}" if _ else flag)
        # What the image has in place: the backend in Triton's backends folder.
        cmd.append(f"--backend-directory={backends}")
        if dist.caches.is_dir():
            cmd.append(f"--cache-directory={dist.caches}")
        return cmd

    def start(self):
        dist = find_tritonserver()
        backends = install(self.root / "backends", dist)
        container_env = self.env()
        env = {**stub_environment(dist=dist), **container_env}
        self._log_file = open(self.log, "ab")
        self.process = subprocess.Popen(self.command(backends, dist, container_env), env=env,
                                        stdout=self._log_file, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        self.started = time.monotonic()
        return self

    def url(self, port_name: str) -> str:
        return f"127.0.0.1:{self.named_ports[port_name]}"

    def probe(self, name: str) -> bool:
        """One kubelet probe: HTTP GET on the named port within timeoutSeconds; 2xx/3xx passes."""
        spec = self.container[name]
        get = spec["httpGet"]
        port = self.named_ports[get["port"]] if isinstance(get["port"], str) else self.ports[get["port"]]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{get['path']}",
                                        timeout=spec.get("timeoutSeconds", 1)) as r:
                return 200 <= r.status < 400
        except (urllib.error.URLError, ConnectionError, OSError):
            return False

    def wait_started(self) -> float:
        """Run the startup probe as the kubelet would; the seconds it took."""
        spec = self.container["startupProbe"]
        budget = spec["periodSeconds"] * spec["failureThreshold"]
        while time.monotonic() - self.started < budget:
            if self.process.poll() is not None:
                raise AssertionError(f"tritonserver exited ({self.process.returncode}):\n{self.log_tail()}")
            if self.probe("startupProbe"):
                self._reservation.release()
                return time.monotonic() - self.started
            time.sleep(0.25)
        raise AssertionError(f"startup probe failed for {budget} s:\n{self.log_tail()}")

    def pre_stop(self) -> subprocess.Popen:
        """The preStop exec hook, its paths mapped; the kubelet sends SIGTERM when it ends."""
        command = [self._rewrite(part) for part in self.container["lifecycle"]["preStop"]["exec"]["command"]]
        return subprocess.Popen(command)

    def sigterm(self):
        self.process.send_signal(signal.SIGTERM)   # PID 1 only, as the kubelet does

    def stop(self):
        self._reservation.release()
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
        if self.process is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)   # no stub outlives the test
            except (ProcessLookupError, PermissionError):
                pass
        if getattr(self, "_log_file", None):
            self._log_file.close()

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://{self.url('metrics')}/metrics", timeout=10) as r:
            return r.read().decode()


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of a container argument: $(VAR) becomes VAR's value when the
    container defines VAR (else stays as written), $$ becomes $."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def pod_values(pair: Path, **engine) -> dict:
    """cpu.yaml, with the tiny pair in a host-folder model store (mounted like a real one)."""
    return {
        "modelStore": {"type": "hostPath", "hostPath": "/var/lib/exspec/models",
                       "mountPath": "/model-store", "readOnly": True},
        "model": {"engine": {"target_model": "/model-store/target", "draft_model": "/model-store/draft",
                             "tokenizer": "/model-store/tokenizer", "max_output_tokens": 4000,
                             "max_batch_size": 4, "max_num_seqs": 8, **engine}},
    }



