"""Ray plumbing for RayDistributedExecutor: the optional import, this process's cluster
connection, and the node-local layout of the ranks.

Importing this module imports nothing heavy (no Ray, no torch).

Ray is imported only through `import_ray()`, i.e. only when `distributed_executor_backend
="ray"` is chosen; without the extra installed it raises an ImportError that says how to
install it.

The cluster connection is process-wide (Ray allows one per process), so it is shared by
every Ray-backed executor of the process and counted: the first `acquire_cluster()`
joins an existing cluster (RAY_ADDRESS, else the one `ray start --head` recorded on this
host) or, when there is none, starts a local instance; the last `release_cluster()`
disconnects from a cluster it joined (the cluster keeps running) or stops the instance
it started. A connection the user made with `ray.init()` before is used as is and never
closed here.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import socket
import threading
from types import ModuleType

import psutil

logger = logging.getLogger(__name__)

RAY_INSTALL_HINT = 'distributed_executor_backend="ray" needs Ray: pip install -e ".[ray]"'
# Node IP of the Ray node a process starts or joins from (Ray's `--node-ip-address`), for
# hosts where Ray's own choice, the address that routes outside, is not the one to use.
NODE_IP_ENV = "TP_RAY_NODE_IP"
_REACH_TIMEOUT_S = 5.0

_lock = threading.Lock()
_users = 0
_connected_here = False  # we called ray.init: the last release_cluster() calls ray.shutdown


def import_ray() -> ModuleType:
    """The `ray` module; ImportError naming the extra to install if it is missing."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(f"{RAY_INSTALL_HINT} ({e})") from None
    return ray


def _recorded_head_address() -> str | None:
    """The GCS address the last `ray start --head` on this host recorded (Ray's
    /tmp/ray/ray_current_cluster), or None. Ray's own lookup, so the rule is ray.init's."""
    from ray._private.services import find_bootstrap_address

    return find_bootstrap_address(None)


def _reachable(address: str) -> bool:
    """True if something accepts TCP connections at `address` ("host:port"); addresses of
    another form (ray://..., "auto") are left to ray.init."""
    if "://" in address or ":" not in address:
        return True
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=_REACH_TIMEOUT_S):
            return True
    except (OSError, ValueError):
        return False


def _ray_init(ray: ModuleType, **kwargs: object) -> None:
    """ray.init, keeping this process's SIGTERM handler: Ray replaces it with a bare
    sys.exit, but the process that runs the engine owns its signals (engine.serve
    drains its requests on SIGTERM)."""
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if in_main_thread else None
    ray.init(**kwargs)
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


def acquire_cluster(min_cpus: int) -> None:
    """Make sure this process is connected to a Ray cluster, and count one more user.

    Called by RayDistributedExecutor's start-up, in the engine process. `min_cpus` is how
    many CPUs a local instance started here must offer (one per CPU rank). Logs which of
    "used this process's connection", "joined" or "started a local instance" happened.
    Raises ConnectionError when RAY_ADDRESS names an address where no cluster answers
    (a cluster that was asked for is never silently replaced by a local one)."""
    global _users, _connected_here
    ray = import_ray()
    with _lock:
        if ray.is_initialized():
            if _users == 0:
                logger.info("Ray: using this process's connection to %s (ray.init was called before; "
                            "the engine leaves it open)", ray.get_runtime_context().gcs_address)
        else:
            node_ip = os.environ.get(NODE_IP_ENV) or None
            address = os.environ.get("RAY_ADDRESS") or None
            source = "RAY_ADDRESS"
            if address is None:
                address, source = _recorded_head_address(), "recorded by `ray start --head`"
                if address is not None and not _reachable(address):
                    logger.warning("Ray: no cluster answers at %s (%s); it is gone", address, source)
                    address = None
            elif not _reachable(address):
                raise ConnectionError(f"RAY_ADDRESS={address!r}: no Ray cluster answers there")
            if address is not None:
                _ray_init(ray, address=address, _node_ip_address=node_ip)
                logger.info("Ray: joined the cluster at %s (%s); shutdown removes only this engine's actors "
                            "and placement group", address, source)
            else:
                num_cpus = max(os.cpu_count() or 1, min_cpus)
                _ray_init(ray, address="local", num_cpus=num_cpus, include_dashboard=False, _node_ip_address=node_ip)
                logger.info("Ray: no cluster found (RAY_ADDRESS unset, no `ray start --head` on this host); "
                            "started a local instance at %s with %d CPUs, which shutdown stops",
                            ray.get_runtime_context().gcs_address, num_cpus)
            _connected_here = True
        _users += 1


def release_cluster() -> None:
    """One user fewer; the last one closes the connection acquire_cluster made (leaving a
    joined cluster, stopping a local instance started here). Called by the executor's
    shutdown; safe when Ray was already shut down (at interpreter exit Ray's own hook may
    run first)."""
    global _users, _connected_here
    ray = import_ray()
    with _lock:
        _users = max(0, _users - 1)
        if _users == 0 and _connected_here:
            _connected_here = False
            if ray.is_initialized():
                ray.shutdown()


def node_local_ranks(node_ids: list[str]) -> list[tuple[int, int]]:
    """(local_rank, local_world_size) of each rank, given the node each rank runs on:
    the ranks of one node are numbered in rank order, from 0."""
    seen: dict[str, int] = {}
    local = []
    for node in node_ids:
        local.append(seen.get(node, 0))
        seen[node] = local[-1] + 1
    return [(rank_on_node, seen[node]) for rank_on_node, node in zip(local, node_ids)]


def interface_for_ip(ip: str) -> str | None:
    """The network interface of this host whose subnet holds `ip` (the one with that very
    address first), or None; gloo must talk over the interface Ray's node IP is on."""
    target = ipaddress.ip_address(ip)
    in_subnet = None
    for name, addrs in psutil.net_if_addrs().items():
        for addr in addrs:
            if addr.family not in (socket.AF_INET, socket.AF_INET6) or not addr.netmask:
                continue
            try:
                network = ipaddress.ip_network(f"{addr.address.split('%')[0]}/{addr.netmask}", strict=False)
            except ValueError:
                continue
            if ipaddress.ip_address(addr.address.split("%")[0]) == target:
                return name
            if target in network and in_subnet is None:
                in_subnet = name
    return in_subnet


def tcp_url(ip: str, port: int) -> str:
    """tcp:// rendezvous URL for torch.distributed (IPv6 hosts in brackets)."""
    host = f"[{ip}]" if ipaddress.ip_address(ip).version == 6 else ip
    return f"tcp://{host}:{port}"


def free_port(ip: str) -> int:
    """A TCP port free on `ip` right now (the rendezvous store binds it moments later)."""
    family = socket.AF_INET6 if ipaddress.ip_address(ip).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((ip, 0))
        return s.getsockname()[1]
