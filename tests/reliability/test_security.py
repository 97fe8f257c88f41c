"""Security of a running server (`python -m engine.serve`, TP=2, loopback only):

- `--api-key` guards every route but the liveness probes /health and /ping (auth.py);
- the server and its workers listen on loopback only, unless --host says otherwise;
- what the server creates is owner-only even under a permissive umask (000): private
  directories 0700, files and shared-memory segments 0600, and every Unix socket it
  listens on is a file in an owner-only directory, never an abstract-namespace name
  (those have no permissions at all: any local user may connect, and our sockets carry
  pickles);
- no code runs from a checkpoint: see test_bad_checkpoints.py.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import httpx
import psutil
import pytest

from tests.conftest import REPO, free_port, tiny_llama_with_tokenizer
from tests.test_serve import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "tiny-secure"
KEY = "s3cret-key"
LIVENESS = ("/health", "/ping")
LOOPBACK = ("127.0.0.1", "::1")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_with_tokenizer(tmp_path_factory.mktemp("secure_model") / "tiny", num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)


def server_args(model: Path, *extra: str, tp: int = 2) -> list[str]:
    return [str(model), "--tp", str(tp), "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "16MiB",
            "--max-model-len", "256", "--served-model-name", MODEL, "--no-access-log", "--disable-log-stats", *extra]


@pytest.fixture(scope="module")
def temp_root() -> Iterator[Path]:
    """The server's TMPDIR: world-readable itself, so only the modes of what the server
    creates inside protect it. Short, under /tmp: socket paths live in it, and a Unix
    socket path must stay under about 100 bytes (pytest's tmp_path is long)."""
    root = Path(tempfile.mkdtemp(prefix="tps-", dir="/tmp"))
    root.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def server(model: Path, temp_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A TP=2 server with --api-key, started under umask 000 (inherited at fork)."""
    proc = ServerProcess(server_args(model, "--api-key", KEY), tmp_path_factory.mktemp("secure_log") / "server.log",
                         env={"TMPDIR": str(temp_root)})
    old = os.umask(0)
    try:
        proc.start()  # its readiness poll is /health, which needs no key
    finally:
        os.umask(old)
    yield proc
    proc.stop()


def tree(pid: int) -> list[psutil.Process]:
    proc = psutil.Process(pid)
    return [proc, *proc.children(recursive=True)]


# ----------------------------------------------------------------------- API key


def test_api_key_guards_every_route_but_the_liveness_probes(server: ServerProcess) -> None:
    url = server.url
    spec = httpx.get(f"{url}/openapi.json", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert spec.status_code == 200, spec.text
    routes = [(method.upper(), path) for path, ops in spec.json()["paths"].items() for method in ops]
    routes += [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/no/such/route"), ("POST", "/v1/no-such")]
    assert ("GET", "/metrics") in routes and ("POST", "/v1/completions") in routes, routes
    guarded = [(m, p) for m, p in routes if p not in LIVENESS]
    with httpx.Client(base_url=url, timeout=30) as http:
        for method, path in guarded:
            concrete = path.replace("{", "").replace("}", "")
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                            {"Authorization": f"Basic {KEY}"}):
                response = http.request(method, concrete, headers=headers, json={})
                assert response.status_code == 401, (method, path, headers, response.status_code, response.text[:200])
                assert response.json()["error"]["code"] == "invalid_api_key"
        for path in LIVENESS:
            if ("GET", path) in routes:
                assert http.get(path).status_code == 200, path
        assert http.get("/health").json()["status"] == "ok"
        good = {"Authorization": f"Bearer {KEY}"}
        assert http.get("/metrics", headers=good).status_code == 200
        ok = http.post("/v1/completions", headers=good,
                       json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
        # A body sent without the key is refused before it is read (the size check runs inside).
        big = http.post("/v1/completions", content=b"x" * (11 << 20), headers={"content-type": "application/json"})
        assert big.status_code == 401


# ----------------------------------------------------------------------- listening sockets


def test_server_and_workers_listen_on_loopback_only(server: ServerProcess) -> None:
    procs = tree(server.pid)
    assert len([p for p in procs if p.pid != server.pid]) >= 2, "a TP=2 server has worker processes"
    listening = [(p.pid, " ".join(p.cmdline())[:60], c.laddr) for p in procs
                 for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert any(addr.ip == "127.0.0.1" and addr.port == server.port for _, _, addr in listening), listening
    public = [entry for entry in listening if entry[2].ip not in LOOPBACK]
    assert not public, f"listening beyond loopback (pid, command, address): {public}"


def test_host_flag_is_honoured(model: Path, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "engine.serve", *server_args(model, tp=1), "--host",
                                 "127.0.0.2", "--port", str(port)], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        ready = False
        while time.monotonic() < deadline and proc.poll() is None and not ready:
            try:
                ready = httpx.get(f"http://127.0.0.2:{port}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                time.sleep(0.2)
        assert ready, log.read_text(errors="replace")
        addresses = {c.laddr for c in psutil.Process(proc.pid).net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
        assert {a.ip for a in addresses} == {"127.0.0.2"}, addresses
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        # The banner follows uvicorn's start by up to one 0.1 s poll of the serve loop,
        # while the socket (bound before the model loaded) may answer /health first.
        banner = f"on http://127.0.0.2:{port}"
        while banner not in log.read_text(errors="replace") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert banner in log.read_text(errors="replace")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


# ----------------------------------------------------------------------- files, segments, sockets


def _shm_fds(procs: list[psutil.Process]) -> dict[str, int]:
    """{/dev/shm path (as mapped, maybe '(deleted)'): mode} of every segment our processes hold open."""
    found: dict[str, int] = {}
    for p in procs:
        fd_dir = Path(f"/proc/{p.pid}/fd")
        for fd in fd_dir.iterdir():
            try:
                target = os.readlink(fd)
                if target.startswith("/dev/shm/"):
                    found[target] = stat.S_IMODE(os.stat(fd).st_mode)
            except OSError:
                continue
    return found


def test_private_files_and_segments_are_owner_only(server: ServerProcess, temp_root: Path) -> None:
    loose = []
    for path in [temp_root, *temp_root.rglob("*")]:
        if path == temp_root:
            continue
        mode = stat.S_IMODE(path.lstat().st_mode)
        kind = stat.S_IFMT(path.lstat().st_mode)
        if kind == stat.S_IFDIR and mode & 0o077:
            loose.append((str(path), oct(mode)))
        elif kind == stat.S_IFSOCK and mode & 0o022:
            loose.append((str(path), oct(mode)))
        elif kind == stat.S_IFREG and mode & 0o077:
            loose.append((str(path), oct(mode)))
    assert not loose, f"created under umask 000 and open to others: {loose}"
    segments = _shm_fds(tree(server.pid))
    assert segments, "a TP=2 server maps shared-memory segments (message queues, all-reduce)"
    open_to_others = {path: oct(mode) for path, mode in segments.items() if mode & 0o077}
    assert not open_to_others, f"shared-memory segments open to others: {open_to_others}"
    # Named segments are unlinked once every rank attached: none of ours is left to open by name.
    linked = [name for name in os.listdir("/dev/shm") if str(server.pid) in name]
    assert not linked, f"segments still linked in /dev/shm: {linked}"


def _unix_listeners() -> dict[int, str]:
    """{inode: path or '@abstract-name'} of every listening Unix socket on this host."""
    out: dict[int, str] = {}
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and int(fields[3], 16) & 0x10000:  # __SO_ACCEPTCON: listening
            out[int(fields[6])] = fields[7]
    return out


def test_unix_sockets_are_owner_only(server: ServerProcess) -> None:
    inodes: set[int] = set()
    for p in tree(server.pid):
        for fd in Path(f"/proc/{p.pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[len("socket:["):-1]))
    ours = {inode: name for inode, name in _unix_listeners().items() if inode in inodes}
    abstract = sorted(name for name in ours.values() if name.startswith("@"))
    # An abstract name has no owner or mode, and /proc/net/unix shows it to every local
    # user: any of them can connect and send what our peers unpickle.
    assert not abstract, f"abstract-namespace sockets, open to every local user: {abstract}"
    loose = []
    for name in ours.values():
        path = Path(name)
        parent_mode = stat.S_IMODE(path.parent.stat().st_mode)
        if parent_mode & 0o077 and stat.S_IMODE(path.lstat().st_mode) & 0o022:
            loose.append((name, oct(parent_mode), oct(stat.S_IMODE(path.lstat().st_mode))))
    assert not loose, f"socket files others may connect to: {loose}"
