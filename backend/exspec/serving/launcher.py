"""exspec-serve: lay out the backend, start a real tritonserver, wait until it is ready.

    exspec-serve --model-repository model_repository [--host ADDRESS] [--http-port N]
                 [--grpc-port N] [--metrics-port N] [--free-ports] [--ready-file PATH]
                 [--startup-timeout-s S] [-- extra tritonserver args]

Listens on loopback only unless --host says otherwise (Triton's own default, every interface,
would serve the model and Triton's administrative APIs to the whole network). Prints the URLs
once every model is ready (and writes them as JSON to --ready-file), exits non-zero with the
log's tail when the server is not ready in time, and stops the server cleanly on Ctrl-C /
SIGTERM. Tests use `TritonServer` as a context manager. This module never imports
Triton: it copies files (exspec.serving.install) and runs a process.

For an OpenAI-compatible API instead of KServe's, run Triton's OpenAI frontend with
`exspec-openai` (exspec.serving.openai_frontend; docs/serving.md, "Triton's OpenAI frontend").
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import os
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from .install import TritonDist, find_tritonserver, install
from .ports import PortReservation, ports_in_use, reserve_ports


# On a machine without an NVIDIA GPU, Triton would still try its pinned memory pool and GPU
# metrics and log "Unable to allocate pinned system memory", "CudaDriverHelper has not been
# initialized", "Failed to initialize NVML" and "DCGM unable to start": harmless, but alarming.
CPU_ONLY_FLAGS = ["--pinned-memory-pool-byte-size=0", "--cuda-memory-pool-byte-size=0:0",
                  "--allow-gpu-metrics=false"]
# Unless the caller picks a model control mode: explicit, every model loaded at start, so that a
# model whose engine died can unload itself and its ready endpoint fail (Triton before 26.03
# never asks a Python model whether it is ready; design.md, "The Triton adapter").
EXPLICIT_CONTROL = ["--model-control-mode=explicit", "--load-model=*"]


def has_nvidia_gpu() -> bool:
    """Whether an NVIDIA driver exposes a device here (its control node exists)."""
    return Path("/dev/nvidiactl").exists()


def stub_environment(base: dict | None = None, dist: TritonDist | None = None) -> dict:
    """Environment in which the Python backend stub runs this interpreter (design: "Running Triton").

    The stub embeds the libpython it was linked against and finds its standard library and
    site-packages from the first `python3` on PATH. So: this interpreter's bin first on PATH,
    its shared libpython first on LD_LIBRARY_PATH, then the libraries tritonserver ships with.
    """
    env = dict(os.environ if base is None else base)
    # no empty entry: one would put the working directory on the stub's PATH
    env["PATH"] = os.pathsep.join(p for p in [str(Path(sys.executable).parent), env.get("PATH", "")] if p)
    libs = [sysconfig.get_config_var("LIBDIR") or ""]
    if dist is not None and dist.libs is not None:
        libs.append(str(dist.libs))
    libs.append(env.get("LD_LIBRARY_PATH", ""))
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in libs if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


FALSE_WORDS = ("false", "0", "off", "no")


def _last_flag(args: list[str], name: str) -> str | None:
    """The value of the last `name=value` (or `name value`) among tritonserver arguments."""
    value = None
    for i, arg in enumerate(args):
        if arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
        elif arg == name and i + 1 < len(args):
            value = args[i + 1]
    return None if value is None else value.strip().lower()


class ServerNotReady(RuntimeError):
    """tritonserver exited or did not become ready in time; the message ends with its log tail."""


class PortInUse(ServerNotReady):
    """A port we were asked to serve on is taken before tritonserver starts."""


class PortTaken(PortInUse):
    """tritonserver could not bind a port that was free when it was chosen."""


class TritonServer:
    """One tritonserver process serving a model repository with the exspec backend installed.

        with TritonServer("model_repository", free_ports=True) as server:
            server.urls["http"]   # http://127.0.0.1:PORT

    `host` is the IPv4 address HTTP, gRPC and metrics listen on: loopback by default,
    "0.0.0.0" for every interface.
    """

    PORT_ATTEMPTS = 3

    def __init__(self, model_repository: str | os.PathLike, *, host: str = "127.0.0.1",
                 http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002,
                 free_ports: bool = False,
                 ready_file: str | os.PathLike | None = None, startup_timeout_s: float = 300.0,
                 extra_args: list[str] | tuple[str, ...] = (), tritonserver: str | None = None,
                 work_dir: str | os.PathLike | None = None, log_path: str | os.PathLike | None = None,
                 echo_log: bool = False, backend_source: str | os.PathLike | None = None):
        self.model_repository = Path(model_repository).resolve()
        self.host = listen_address(host)
        self.extra_args = list(extra_args)
        # `-- --allow-metrics=false` (tritonserver's own flag) turns the metrics service off:
        # then there is no metrics port to choose, check or wait for.
        self.metrics_enabled = _last_flag(self.extra_args, "--allow-metrics") not in FALSE_WORDS
        self.ports = {"http": http_port, "grpc": grpc_port}
        if self.metrics_enabled:
            self.ports["metrics"] = metrics_port
        self.use_free_ports = free_ports
        self.ready_file = Path(ready_file) if ready_file else None
        self.startup_timeout_s = startup_timeout_s
        self.tritonserver = tritonserver
        self.work_dir = Path(work_dir) if work_dir else None
        self.log_path = Path(log_path) if log_path else None
        self.echo_log = echo_log
        self.backend_source = backend_source
        self.process: subprocess.Popen | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._log_file = None
        self._launched_at = 0

    # -- URLs --------------------------------------------------------------------------------
    @property
    def urls(self) -> dict:
        host = "127.0.0.1" if self.host == "0.0.0.0" else self.host
        return {"http": f"http://{host}:{self.ports['http']}",
                "grpc": f"{host}:{self.ports['grpc']}",
                "metrics": (f"http://{host}:{self.ports['metrics']}/metrics"
                            if self.metrics_enabled else None)}

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "TritonServer":
        if not (self.model_repository / "").is_dir():
            raise FileNotFoundError(f"model repository {self.model_repository} does not exist")
        dist = find_tritonserver(self.tritonserver)
        if self.work_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="exspec-serve-")
            self.work_dir = Path(self._tmp.name)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        backends = install(self.work_dir / "backends", dist,
                           **({"source": self.backend_source} if self.backend_source else {}))
        if self.log_path is None:
            self.log_path = self.work_dir / "tritonserver.log"
        # Ports we chose can still be taken by a process that uses no reservation between our
        # check and tritonserver's bind; then choose again (bounded). Given ports are the
        # caller's: a clash is their error.
        attempts = self.PORT_ATTEMPTS if self.use_free_ports else 1
        for attempt in range(1, attempts + 1):
            reservation = self._claim_ports()
            try:
                self._launch(dist, backends)
                self._wait_ready()
                break
            except PortTaken:
                self.stop()
                if attempt == attempts:
                    raise
            except BaseException:
                self.stop()
                raise
            finally:
                reservation.release()   # bound by now, or given up
        if self.ready_file:
            self.ready_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.ready_file.with_suffix(self.ready_file.suffix + ".tmp")
            tmp.write_text(json.dumps({**self.urls, "pid": self.process.pid,
                                       "log": str(self.log_path)}))
            tmp.replace(self.ready_file)   # readers never see a half-written file
        return self

    def _claim_ports(self) -> PortReservation:
        if self.use_free_ports:
            reservation = reserve_ports(len(self.ports), host=self.host)
            self.ports = dict(zip(self.ports, reservation.ports))
            return reservation
        busy = ports_in_use(self.ports.values(), host=self.host)
        if busy:   # else another server could answer our readiness probe
            raise PortInUse(f"port(s) {', '.join(map(str, busy))} already in use; stop the "
                            "other server, choose other ports, or pass --free-ports")
        return PortReservation([], [])

    def _launch(self, dist: TritonDist, backends: Path) -> None:
        self._log_file = open(self.log_path, "ab")
        self._launched_at = self._log_file.tell()    # this attempt's lines start here
        cmd = [str(dist.binary), f"--model-repository={self.model_repository}",
               f"--backend-directory={backends}",
               f"--http-port={self.ports['http']}", f"--grpc-port={self.ports['grpc']}",
               f"--http-address={self.host}", f"--grpc-address={self.host}"]
        if self.metrics_enabled:
            cmd += [f"--metrics-port={self.ports['metrics']}", "--allow-metrics=true",
                    f"--metrics-address={self.host}"]
        if dist.caches.is_dir():
            cmd.append(f"--cache-directory={dist.caches}")
        if not has_nvidia_gpu():   # no pinned pool or GPU metrics to set up: no CUDA/NVML/DCGM errors
            cmd += CPU_ONLY_FLAGS
        if _last_flag(self.extra_args, "--model-control-mode") is None:
            cmd += EXPLICIT_CONTROL
        cmd += self.extra_args
        # Own process group, so a Ctrl-C in the terminal reaches the launcher only and the
        # launcher decides how the server stops.
        self.process = subprocess.Popen(cmd, env=stub_environment(dist=dist), stdout=self._log_file,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        if self.echo_log:
            threading.Thread(target=self._echo, daemon=True).start()

    def _wait_ready(self) -> None:
        """Ready = models ready and the metrics port answering: Triton starts its metrics
        service just after the HTTP one, so a scrape right after /v2/health/ready could be
        refused (seen in CI)."""
        deadline = time.monotonic() + self.startup_timeout_s
        waiting = [self.urls["http"] + "/v2/health/ready"] + (
            [self.urls["metrics"]] if self.metrics_enabled else [])
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.log_tail()
                with open(self.log_path, "rb") as log:
                    log.seek(self._launched_at)
                    this_attempt = log.read().decode(errors="replace")
                if "already in use" in this_attempt:   # "Socket '127.0.0.1:N' already in use"
                    raise PortTaken(f"a port was taken before tritonserver bound it:\n{tail}")
                raise ServerNotReady(f"tritonserver exited with code {self.process.returncode} "
                                     f"before it was ready; log tail:\n{tail}")
            try:
                with urllib.request.urlopen(waiting[0], timeout=2) as response:
                    if response.status == 200:
                        waiting.pop(0)
                        if not waiting:
                            return
                        continue
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.25)
        raise ServerNotReady(f"tritonserver not ready after {self.startup_timeout_s:.0f} s; "
                             f"log tail:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGINT (Triton unloads models, finalize runs), then SIGKILL the group if it hangs."""
        code = None
        if self.process is not None:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGINT)
                try:
                    self.process.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    os.killpg(self.process.pid, signal.SIGKILL)
                    self.process.wait(10)
            code = self.process.returncode
            # Stubs are children of tritonserver in its group; none may outlive it.
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self.ready_file is not None and self.ready_file.exists():
            self.ready_file.unlink()
        return code

    def cleanup(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 25) -> str:
        """The log's error lines (Triton prefixes them with E<date>) and then its last lines."""
        try:
            text = Path(self.log_path).read_text(errors="replace").splitlines()
        except (OSError, TypeError):
            return "(no log)"
        errors = [line for line in text[:-lines] if line[:1] == "E" and line[1:5].isdigit()]
        return "\n".join(errors[-20:] + text[-lines:])

    def _echo(self) -> None:
        with open(self.log_path, "rb") as log:
            while self.is_running():
                line = log.readline()
                if line:
                    sys.stdout.write(line.decode(errors="replace"))
                    sys.stdout.flush()
                else:
                    time.sleep(0.2)

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        self.cleanup()


def stub_pids(marker: str) -> list[int]:
    """Python backend stub processes whose command line mentions `marker` (e.g. a server's
    backend folder or model repository): what must be gone after a clean stop."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "triton_python_backend_stub" in cmd and marker in cmd:
            pids.append(int(entry.name))
    return sorted(pids)


def listen_address(host: str) -> str:
    """`host` if it is an IPv4 address tritonserver can listen on, else a ValueError that says
    what is accepted (the port checks and the printed URLs are IPv4)."""
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        raise ValueError(f"{host!r} is not an IPv4 address: give 127.0.0.1 (loopback, the "
                         "default), 0.0.0.0 (every interface) or one of this machine's") from None


def host_argument(value: str) -> str:
    try:
        return listen_address(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None   # argparse shows only this type


def split_passthrough(argv: list[str] | None) -> tuple[list[str], list[str]]:
    """(own arguments, arguments after `--` for the server we start)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def parse_args(argv: list[str] | None):
    argv, extra = split_passthrough(argv)
    parser = argparse.ArgumentParser(
        prog="exspec-serve", description=__doc__.split("\n\n")[0],
        epilog="The OpenAI API (Triton's OpenAI frontend, --backend vllm): exspec-openai "
               "--model-repository DIR [--frontend DIR] (docs/serving.md, \"Triton's OpenAI frontend\").")
    parser.add_argument("--model-repository", required=True)
    parser.add_argument("--host", type=host_argument, default="127.0.0.1",
                        help="IPv4 address HTTP, gRPC and metrics listen on (default 127.0.0.1: "
                             "this machine only; 0.0.0.0: every interface)")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--free-ports", action="store_true",
                        help="pick three free ports instead of the given ones")
    parser.add_argument("--ready-file", default=None,
                        help="write the URLs as JSON here once ready (removed on stop)")
    parser.add_argument("--startup-timeout-s", type=float, default=600.0)
    parser.add_argument("--tritonserver", default=None,
                        help="tritonserver binary or root (default: $TRITONSERVER, "
                             "/opt/tritonserver, nvidia-pytriton)")
    parser.add_argument("--work-dir", default=None,
                        help="where the backend folder and log go (default: a temporary folder)")
    parser.add_argument("--backend-source", default=None,
                        help="folder with model.py and the exspec/ package to install "
                             "(default: the backend/ folder this package sits in)")
    parser.add_argument("--quiet", action="store_true", help="do not echo the server log")
    args = parser.parse_args(argv)
    return args, extra


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    server = TritonServer(args.model_repository, host=args.host, http_port=args.http_port,
                          grpc_port=args.grpc_port, metrics_port=args.metrics_port,
                          free_ports=args.free_ports, ready_file=args.ready_file,
                          startup_timeout_s=args.startup_timeout_s, extra_args=extra,
                          tritonserver=args.tritonserver, work_dir=args.work_dir,
                          echo_log=not args.quiet, backend_source=args.backend_source)
    stopping = threading.Event()

    def interrupt_start(signum, _frame):
        raise KeyboardInterrupt   # start() stops the half-started server on the way out

    signal.signal(signal.SIGTERM, interrupt_start)
    try:
        server.start()
    except (ServerNotReady, FileNotFoundError) as exc:
        print(f"exspec-serve: {exc}", file=sys.stderr)
        server.cleanup()
        return 1
    except KeyboardInterrupt:
        print("exspec-serve: interrupted before the server was ready", file=sys.stderr)
        server.cleanup()
        return 130
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    urls = server.urls
    print(f"\nexspec-serve: ready\n  HTTP    {urls['http']}\n  gRPC    {urls['grpc']}\n"
          f"  metrics {urls['metrics'] or 'off'}\n  log     {server.log_path}", flush=True)
    if not has_nvidia_gpu():
        print("  (no NVIDIA GPU here: the pinned pool and GPU metrics are off, and Triton's one "
              "\"CudaDriverHelper has not been initialized\" line is harmless)", flush=True)
    while not stopping.is_set() and server.is_running():
        stopping.wait(0.5)
    died = not server.is_running()
    code = server.stop()
    if died:
        print(f"exspec-serve: tritonserver exited with code {code}; log tail:\n"
              f"{server.log_tail()}", file=sys.stderr)
    else:
        print(f"exspec-serve: stopped (tritonserver exit code {code})", flush=True)
    server.cleanup()
    return 1 if died else 0


if __name__ == "__main__":
    sys.exit(main())
