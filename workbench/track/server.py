"""`python -m workbench.track.server start|stop|status`: an MLflow tracking server on PostgreSQL
(and the Optuna storage beside it) for runs and sweeps that span nodes.

    python -m workbench.track.server start [--dir /tmp/workbench-tracking] [--host 127.0.0.1]
        [--port 5000] [--pg-port 5433] [--workers 2] [--threads 4] [--auth [--auth-file FILE]]
    python -m workbench.track.server status | stop [--dir ...]

`start` installs Debian's postgresql when missing, starts a private PostgreSQL cluster
(workbench.track.postgres), creates the `mlflow`, `optuna` and `mlflow_auth` databases, starts
`mlflow server`, waits for its /health, then prints the two URLs and writes them to DIR/env.sh:

    WORKBENCH_TRACKING_URI=http://127.0.0.1:5000      -> tracking.uri=... / MLFLOW_TRACKING_URI
    WORKBENCH_OPTUNA_STORAGE=postgresql://workbench@127.0.0.1:5433/optuna
    PGPASSFILE=DIR/pgpass                             (the storage URL carries no password)

It is idempotent (a second `start` finds both servers up and prints the same lines) and `stop`
stops only what `start` started: the PostgreSQL cluster of DIR/pg and the process group whose
leader's pid is in DIR/run/mlflow.pid.

The MLflow server settings, and why:
- `--backend-store-uri postgresql://...`: concurrent writers from many nodes; MLflow migrates the
  schema once, in the server, instead of in every client racing on a fresh sqlite file.
- `--serve-artifacts --artifacts-destination DIR/artifacts`: the artifact proxy. Runs upload
  through the server (mlflow-artifacts:/ URIs), so compute nodes need neither the head node's
  filesystem nor credentials to an object store; point the destination at shared or object
  storage on a real cluster.
- gunicorn (`--gunicorn-opts`), not MLflow's default uvicorn: uvicorn's multi-worker mode
  accepts connections on a socket made without IPPROTO_TCP, so asyncio never sets TCP_NODELAY
  on them; every response after the first on a kept-alive connection then waits for the
  client's delayed ACK. Measured here: 42-52 ms per request (even /health) against 2.7 ms with
  one uvicorn worker and 2-7 ms with gunicorn, and a sweep driver makes about five requests
  per trial. gunicorn sets TCP_NODELAY on its listening socket.
- `--workers 2 --threads 4` (gunicorn gthread): one request blocked on the database does not
  stall the rest. Measured here (2 cores, busy): 32 concurrent runs of 100 steps took 43-45 s
  against 2 workers and 105-255 s against 1; each worker costs about 250 MB. 32 concurrent
  runs and 16 Optuna workers are tested against 2.
- MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false: otherwise the server starts a job runner and seven
  consumer processes (about 2.3 GB, against 490 MB) for GenAI jobs the workbench never submits.
- MLFLOW_DISABLE_TELEMETRY=true: nothing leaves the machine.
- bound to 127.0.0.1 unless `--host` says otherwise; with another host, MLflow's Host-header
  check (`--allowed-hosts`) is opened to this machine's names and private addresses only.
- the server runs in a session of its own (setsid) and is stopped by process group: killing the
  `mlflow` pid alone leaves its gunicorn workers serving.
- `--auth`: MLflow's basic-auth app (`--app-name basic-auth`), its user store in PostgreSQL. The
  admin's credentials come from MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (what an
  MLflow client sends) or from `--auth-file`, an MLflow credentials file (section [mlflow], keys
  mlflow_tracking_username / mlflow_tracking_password, mode 0600, e.g. ~/.mlflow/credentials,
  which clients read by themselves). They reach the server through its environment, never its
  command line, a log, a param or a tag; the first start creates the admin, later starts keep it.
  A request without credentials is then refused (401).
"""

from __future__ import annotations

import configparser
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional

from workbench.cli import ArgParser, guarded
from workbench.errors import InputError
from workbench.track.postgres import LOOPBACK, Postgres, ensure_installed, port_in_use

DEFAULT_DIR = Path("/tmp/workbench-tracking")


@dataclass
class Settings:
    host: str = "127.0.0.1"
    port: int = 5000
    pg_port: int = 5433
    workers: int = 2
    threads: int = 4  # per worker (gunicorn gthread): requests waiting on the database overlap
    auth: bool = False

    def client_host(self) -> str:
        """The name clients use: the bind address, or this machine's name when bound to all."""
        return socket.gethostname() if self.host in ("0.0.0.0", "", "::") else self.host

    def tracking_uri(self) -> str:
        return f"http://{self.client_host()}:{self.port}"


def _pid_alive(pidfile: Path, needle: bytes) -> Optional[int]:
    """The pid in pidfile when that process still runs and is what we started (its command line
    holds needle): a stale file whose pid was reused names someone else's process."""
    try:
        pid = int(pidfile.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    return pid if needle in cmdline else None


def mlflow_pid(state_dir: Path) -> Optional[int]:
    return _pid_alive(state_dir / "run" / "mlflow.pid", b"mlflow")


def healthy(uri: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _read_credentials(auth_file: Optional[Path]) -> Dict[str, str]:
    """The admin's username and password: --auth-file, else the environment."""
    if auth_file is not None:
        if not auth_file.is_file():
            raise InputError(f"--auth-file {auth_file}: no such file")
        if auth_file.stat().st_mode & 0o077:
            raise InputError(f"--auth-file {auth_file}: readable by others; chmod 600 it")
        cp = configparser.ConfigParser()
        cp.read(auth_file)
        sec = cp["mlflow"] if "mlflow" in cp else {}
        user, pw = sec.get("mlflow_tracking_username"), sec.get("mlflow_tracking_password")
        where = f"--auth-file {auth_file}"
    else:
        user = os.environ.get("MLFLOW_TRACKING_USERNAME")
        pw = os.environ.get("MLFLOW_TRACKING_PASSWORD")
        where = "the environment"
    if not user or not pw:
        raise InputError(f"--auth needs the admin's credentials; {where} has none (set "
                         "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or pass "
                         "--auth-file with [mlflow] mlflow_tracking_username/_password, mode 600)")
    return {"MLFLOW_AUTH_ADMIN_USERNAME": user, "MLFLOW_AUTH_ADMIN_PASSWORD": pw}


def _auth_config(state_dir: Path, pg: Postgres) -> Path:
    """The basic-auth app's config: its user store in PostgreSQL, no secret in the file."""
    path = state_dir / "basic_auth.ini"
    path.write_text("[mlflow]\ndefault_permission = READ\n"
                    f"database_uri = {pg.url('mlflow_auth', '127.0.0.1')}\n"
                    "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
                    "# a verified password is cached a minute per worker: PBKDF2 on every\n"
                    "# request would cost the server more CPU than the request itself\n"
                    "auth_cache_ttl_seconds = 60\n")
    return path


def _secret(path: Path) -> str:
    """A random key made once and kept (mode 0600): the auth app signs its CSRF tokens with it,
    and every worker and every restart must use the same one."""
    if not path.exists():
        import secrets

        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return path.read_text().strip()


def _allowed_hosts(s: Settings) -> Dict[str, str]:
    """MLflow's Host-header check opened to this machine's names and private addresses, as an
    environment variable: its `--allowed-hosts` flag is refused beside `--gunicorn-opts`
    (MLflow 3), while the Flask app reads MLFLOW_SERVER_ALLOWED_HOSTS under gunicorn too."""
    if s.host in LOOPBACK:
        return {}
    names = {socket.gethostname(), socket.getfqdn(), s.host, "localhost", "127.0.0.1"}
    pats = [p for n in sorted(names) for p in (n, f"{n}:*")]
    return {"MLFLOW_SERVER_ALLOWED_HOSTS": ",".join(pats + ["10.*", "192.168.*", "172.*"])}


def start_mlflow(state_dir: Path, s: Settings, pg: Postgres,
                 secrets_env: Dict[str, str]) -> subprocess.Popen:
    """Start `mlflow server` in a session of its own; its pid (= process group) goes to
    DIR/run/mlflow.pid."""
    if port_in_use(s.host, s.port):
        raise InputError(f"port {s.port} on {s.host} is taken by another program; pick another "
                         "with --port")
    (state_dir / "artifacts").mkdir(exist_ok=True)
    (state_dir / "run").mkdir(exist_ok=True)
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
           "MLFLOW_DISABLE_TELEMETRY": "true", "PGPASSFILE": str(pg.pgpass), **secrets_env,
           **_allowed_hosts(s)}
    cmd = [sys.executable, "-m", "mlflow", "server",
           "--backend-store-uri", pg.url("mlflow", "127.0.0.1"),
           "--serve-artifacts", "--artifacts-destination", str(state_dir / "artifacts"),
           "--host", s.host, "--port", str(s.port), "--workers", str(s.workers),
           "--gunicorn-opts", f"--threads {s.threads}"]
    if s.auth:
        env["MLFLOW_AUTH_CONFIG_PATH"] = str(_auth_config(state_dir, pg))
        env["MLFLOW_FLASK_SERVER_SECRET_KEY"] = _secret(state_dir / "flask_secret")
        cmd += ["--app-name", "basic-auth"]
    with open(state_dir / "log" / "mlflow.log", "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                cwd=state_dir, start_new_session=True)
    (state_dir / "run" / "mlflow.pid").write_text(f"{proc.pid}\n")
    return proc


def wait_healthy(state_dir: Path, uri: str, timeout_s: float,
                 proc: Optional[subprocess.Popen] = None) -> None:
    """Wait for /health. The server just started is watched through its Popen: right after
    exec, /proc/PID/cmdline can still read empty, which would look like a dead server."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if healthy(uri):
            return
        if (proc.poll() is not None) if proc is not None else mlflow_pid(state_dir) is None:
            raise InputError(f"mlflow server exited at start ({_last_line(state_dir)}); "
                             f"log: {state_dir}/log/mlflow.log")
        time.sleep(0.5)
    raise InputError(f"mlflow server did not answer {uri}/health within {timeout_s:.0f} s; "
                     f"log: {state_dir}/log/mlflow.log")


def _last_line(state_dir: Path) -> str:
    try:
        lines = (state_dir / "log" / "mlflow.log").read_text(errors="replace").splitlines()
    except OSError:
        return "no log"
    import re

    last = [ln.strip() for ln in lines if ln.strip() and not ln.startswith(" ")]
    errors = [ln for ln in last if re.match(r"[\w.]*(Error|Exception)\b", ln)]
    return (errors or last or ["no output"])[-1][:300]


def stop_mlflow(state_dir: Path, timeout_s: float = 5.0) -> bool:
    """TERM the server's process group, KILL what is left after timeout_s (uvicorn otherwise
    waits for idle keep-alive clients; the server holds no state, PostgreSQL does). False: not
    up."""
    pid = mlflow_pid(state_dir)
    if pid is None:
        (state_dir / "run" / "mlflow.pid").unlink(missing_ok=True)
        return False
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            break
        deadline = time.time() + wait_s
        while time.time() < deadline and _group_alive(pid):
            time.sleep(0.2)
        if not _group_alive(pid):
            break
    (state_dir / "run" / "mlflow.pid").unlink(missing_ok=True)
    return True


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def env_lines(state_dir: Path, s: Settings, pg: Postgres) -> List[str]:
    return [f"export WORKBENCH_TRACKING_URI={s.tracking_uri()}",
            f"export WORKBENCH_OPTUNA_STORAGE={pg.url('optuna', s.client_host())}",
            f"export PGPASSFILE={pg.pgpass}"]


def _recorded(state_dir: Path) -> Optional[Settings]:
    try:
        return Settings(**json.loads((state_dir / "server.json").read_text()))
    except (OSError, ValueError, TypeError):
        return None


def start(state_dir: Path, s: Settings, auth_file: Optional[Path], wait_s: float) -> int:
    secrets_env = _read_credentials(auth_file) if s.auth else {}  # bad input: nothing written
    state_dir.mkdir(parents=True, exist_ok=True)
    before = _recorded(state_dir)
    if before is not None and before != s and (mlflow_pid(state_dir) or
                                               Postgres(state_dir, s.host, s.pg_port).pid()):
        raise InputError(f"{state_dir} already serves {asdict(before)}; stop it first "
                         f"(python -m workbench.track.server stop --dir {state_dir}) or use "
                         "another --dir")
    ensure_installed()
    pg = Postgres(state_dir, s.host, s.pg_port)
    pg.init()
    pg.start()
    pg.create_databases()
    (state_dir / "server.json").write_text(json.dumps(asdict(s)) + "\n")
    (state_dir / "run").mkdir(exist_ok=True)
    (state_dir / "run" / "postgres.pid").write_text(f"{pg.pid()}\n")
    uri = s.tracking_uri()
    local_uri = f"http://127.0.0.1:{s.port}" if s.host in ("0.0.0.0", "") else uri
    if mlflow_pid(state_dir) is None:
        t0 = time.time()
        proc = start_mlflow(state_dir, s, pg, secrets_env)
        wait_healthy(state_dir, local_uri, wait_s, proc)
        print(f"mlflow server up in {time.time() - t0:.0f} s", file=sys.stderr)
    else:
        wait_healthy(state_dir, local_uri, wait_s)
    lines = env_lines(state_dir, s, pg)
    (state_dir / "env.sh").write_text("\n".join(lines) + "\n")
    print(f"tracking uri:   {uri}\noptuna storage: {pg.url('optuna', s.client_host())}\n"
          f"env file:       {state_dir / 'env.sh'}  (source it: exports PGPASSFILE too)")
    return 0


def stop(state_dir: Path) -> int:
    s = _recorded(state_dir) or Settings()
    stopped = ["mlflow server"] if stop_mlflow(state_dir) else []
    if (state_dir / "pg" / "PG_VERSION").exists() and Postgres(state_dir, s.host,
                                                                s.pg_port).stop():
        stopped.append("postgresql")
    (state_dir / "run" / "postgres.pid").unlink(missing_ok=True)
    print(f"stopped: {', '.join(stopped)}" if stopped else f"nothing running under {state_dir}")
    return 0


def status(state_dir: Path) -> int:
    """Exit 0 when both servers are up and MLflow answers /health, 1 otherwise."""
    s = _recorded(state_dir)
    if s is None:
        print(f"not started under {state_dir}")
        return 1
    pg_pid, ml_pid = Postgres(state_dir, s.host, s.pg_port).pid(), mlflow_pid(state_dir)
    local = f"http://127.0.0.1:{s.port}" if s.host in ("0.0.0.0", "") else s.tracking_uri()
    ok = bool(pg_pid and ml_pid and healthy(local))
    print(f"postgresql:     {'pid ' + str(pg_pid) if pg_pid else 'down'} (port {s.pg_port})\n"
          f"mlflow server:  {'pid ' + str(ml_pid) if ml_pid else 'down'}"
          f"{' healthy' if ok else ''} ({s.tracking_uri()}{', auth' if s.auth else ''})")
    return 0 if ok else 1


@guarded
def main(argv: List[str]) -> int:
    ap = ArgParser(prog="python -m workbench.track.server",
                   description="Start, stop or report the MLflow tracking server on PostgreSQL.")
    ap.add_argument("command", choices=["start", "stop", "status"])
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="state folder")
    ap.add_argument("--host", default="127.0.0.1", help="address both servers bind")
    ap.add_argument("--port", type=int, default=5000, help="MLflow server port")
    ap.add_argument("--pg-port", type=int, default=5433, help="PostgreSQL port")
    ap.add_argument("--workers", type=int, default=2, help="MLflow server worker processes")
    ap.add_argument("--threads", type=int, default=4, help="request threads per worker")
    ap.add_argument("--auth", action="store_true", help="MLflow's basic-auth app")
    ap.add_argument("--auth-file", type=Path, help="MLflow credentials file (mode 600)")
    ap.add_argument("--wait-s", type=float, default=120.0, help="seconds to wait for /health")
    a = ap.parse_args(argv)
    for name in ("port", "pg_port", "workers", "threads"):
        value = getattr(a, name)
        if not (0 < value < 65536) or (name in ("workers", "threads") and value > 64):
            raise InputError(f"--{name.replace('_', '-')}={value}: out of range")
    if a.port == a.pg_port:
        raise InputError(f"--port and --pg-port are both {a.port}")
    state_dir = a.dir.resolve()
    if a.command == "stop":
        return stop(state_dir)
    if a.command == "status":
        return status(state_dir)
    s = Settings(host=a.host, port=a.port, pg_port=a.pg_port, workers=a.workers,
                 threads=a.threads, auth=a.auth)
    return start(state_dir, s, a.auth_file, a.wait_s)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
