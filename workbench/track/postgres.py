"""The PostgreSQL half of the tracking server (workbench.track.server): Debian's package, one
private cluster in the state folder, a `workbench` role and the databases MLflow and Optuna use.

Why PostgreSQL: runs and sweep trials on many nodes cannot share one sqlite file (its locking is
unreliable over NFS and a fresh store races on its schema migration); an RDB every node reaches
over TCP is what MLflow's server and Optuna's RDBStorage are built for.

How it is set up, and why:
- a cluster of its own (initdb into DIR/pg), not the system one: nothing outside DIR changes and
  the default port (5433) does not clash with a system PostgreSQL on 5432;
- PostgreSQL refuses to run as root, so as root every server command runs as Debian's `postgres`
  user (runuser); as anyone else, as that user;
- the server's own administration goes over a Unix socket in DIR/pgsock with peer
  authentication (no password exists for the superuser); TCP clients log in as `workbench` with a
  generated password (scram-sha-256) kept in DIR/pgpass, a libpq password file (mode 0600).
  Clients find it through PGPASSFILE, so the storage URL printed and passed around
  (postgresql://workbench@HOST:PORT/optuna) carries no secret.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
from pathlib import Path
from typing import List, Optional

from workbench.errors import InputError

ROLE = "workbench"
DATABASES = ("mlflow", "optuna", "mlflow_auth")
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def pg_bin(name: str) -> Optional[str]:
    """A PostgreSQL server program: Debian keeps them in /usr/lib/postgresql/VERSION/bin, off
    PATH; the newest installed version wins."""
    found = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"),
                   key=lambda p: int(p.parts[-3]) if p.parts[-3].isdigit() else 0)
    return str(found[-1]) if found else shutil.which(name)


def ensure_installed() -> None:
    """apt-get install Debian's `postgresql` when its programs are missing (root only)."""
    if pg_bin("initdb") and pg_bin("pg_ctl") and shutil.which("psql"):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise InputError("PostgreSQL is not installed (initdb, pg_ctl, psql); install Debian's "
                         "`postgresql` package or run this as root to have it installed")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "postgresql"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if proc.returncode:
            raise InputError(f"{' '.join(cmd)} failed: {_tail(proc.stderr)}")
    if not pg_bin("initdb"):
        raise InputError("apt-get installed postgresql but initdb is still missing")


def _tail(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


def _owner_ids() -> Optional[tuple]:
    """(uid, gid) of `postgres` when we are root (PostgreSQL refuses root), else None."""
    if os.geteuid() != 0:
        return None
    import pwd

    try:
        pw = pwd.getpwnam("postgres")
    except KeyError:
        raise InputError("running as root but the `postgres` user does not exist (Debian's "
                         "postgresql package creates it)") from None
    return pw.pw_uid, pw.pw_gid


def port_in_use(host: str, port: int) -> bool:
    target = "127.0.0.1" if host in ("0.0.0.0", "", "*") else host
    with socket.socket(socket.AF_INET6 if ":" in target else socket.AF_INET) as s:
        s.settimeout(1.0)
        return s.connect_ex((target, port)) == 0


class Postgres:
    """One private PostgreSQL cluster under DIR: data in DIR/pg, socket in DIR/pgsock."""

    def __init__(self, state_dir: Path, host: str, port: int):
        self.dir, self.host, self.port = state_dir, host, port
        self.data = state_dir / "pg"
        self.sock = state_dir / "pgsock"
        self.log = state_dir / "log" / "postgres.log"
        self.pgpass = state_dir / "pgpass"
        self.owner = _owner_ids()

    def _as_owner(self, cmd: List[str]) -> List[str]:
        return ["runuser", "-u", "postgres", "--", *cmd] if self.owner else cmd

    def _run(self, cmd: List[str], what: str, **kw) -> str:
        proc = subprocess.run(self._as_owner(cmd), capture_output=True, text=True, check=False,
                              cwd="/", **kw)
        if proc.returncode:
            raise InputError(f"PostgreSQL {what} failed ({_tail(proc.stderr or proc.stdout)}); "
                             f"log: {self.log}")
        return proc.stdout

    def _chown(self, path: Path) -> None:
        if self.owner:
            os.chown(path, *self.owner)

    def pid(self) -> Optional[int]:
        """The postmaster's pid when our cluster runs (from its postmaster.pid), else None."""
        try:
            pid = int((self.data / "postmaster.pid").read_text().split()[0])
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            return None
        return pid if b"postgres" in cmdline else None

    def init(self) -> None:
        """initdb once; the password file once (reused by every later start)."""
        for d in (self.data, self.sock, self.log.parent):
            d.mkdir(parents=True, exist_ok=True)
        if self.owner and subprocess.run(["runuser", "-u", "postgres", "--", "test", "-x",
                                          str(self.dir)], check=False).returncode:
            raise InputError(f"--dir {self.dir}: PostgreSQL runs as `postgres`, which cannot "
                             "reach that folder (a parent lacks o+x); pick one it can reach")
        self._chown(self.data)
        self._chown(self.sock)
        if not self.pgpass.exists():
            fd = os.open(self.pgpass, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(f"*:*:*:{ROLE}:{secrets.token_urlsafe(24)}\n")
        if not self.log.exists():
            self.log.touch()
            self._chown(self.log)
        if (self.data / "PG_VERSION").exists():
            return
        self._run([pg_bin("initdb") or "initdb", "-D", str(self.data), "-E", "UTF8",
                   "--locale=C", "--auth-local=peer", "--auth-host=scram-sha-256",
                   "--no-instructions"], "initdb")

    def _allow_remote(self) -> None:
        """Bound beyond loopback, TCP logins from any address still need the password."""
        hba = self.data / "pg_hba.conf"
        line = f"host all {ROLE} 0.0.0.0/0 scram-sha-256"
        if self.host not in LOOPBACK and line not in hba.read_text():
            with hba.open("a") as f:
                f.write(line + "\n")

    def start(self) -> None:
        """Start the cluster (pg_ctl waits until it accepts connections)."""
        if self.pid():
            return
        if port_in_use(self.host, self.port):
            raise InputError(f"port {self.port} on {self.host} is taken by another program; "
                             "pick another with --pg-port")
        self._allow_remote()
        listen = "*" if self.host in ("0.0.0.0", "") else self.host
        opts = (f"-c listen_addresses='{listen}' -c port={self.port} "
                f"-c unix_socket_directories='{self.sock}' -c max_connections=200 "
                "-c shared_buffers=64MB")
        self._run([pg_bin("pg_ctl") or "pg_ctl", "-D", str(self.data), "-l", str(self.log),
                   "-w", "-t", "60", "-o", opts, "start"], "start")

    def stop(self) -> bool:
        """Stop our cluster (fast: sessions are cut, committed data is safe). False: not up."""
        if not self.pid():
            return False
        self._run([pg_bin("pg_ctl") or "pg_ctl", "-D", str(self.data), "-m", "fast", "-w",
                   "-t", "60", "stop"], "stop")
        return True

    def password(self) -> str:
        return self.pgpass.read_text().strip().rsplit(":", 1)[1]

    def create_databases(self) -> None:
        """The `workbench` role (its password from DIR/pgpass) and one database per user of it,
        each created once."""
        psql = [shutil.which("psql") or "psql", "-h", str(self.sock), "-p", str(self.port),
                "-d", "postgres", "-v", "ON_ERROR_STOP=1", "-qtA"]
        pw = self.password().replace("'", "''")
        self._run(psql + ["-f", "-"], "role setup", input=(
            f"SELECT 'CREATE ROLE {ROLE} LOGIN' WHERE NOT EXISTS "
            f"(SELECT 1 FROM pg_roles WHERE rolname = '{ROLE}')\\gexec\n"
            f"ALTER ROLE {ROLE} PASSWORD '{pw}';\n"))
        for db in DATABASES:
            self._run(psql + ["-f", "-"], f"creating database {db}", input=(
                f"SELECT 'CREATE DATABASE {db} OWNER {ROLE}' WHERE NOT EXISTS "
                f"(SELECT 1 FROM pg_database WHERE datname = '{db}')\\gexec\n"))

    def url(self, db: str, host: str, driver: str = "postgresql") -> str:
        """The SQLAlchemy URL of one database; no password in it (PGPASSFILE supplies it)."""
        return f"{driver}://{ROLE}@{host}:{self.port}/{db}"
