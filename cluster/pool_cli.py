"""`tandem pools`, `tandem drain` and `tandem teardown`: a running deployment's
worker pools from the command line, through its pool manager
(cluster/pool_manager.py) on the Ray cluster at `--address` (default `auto`: the
one `ray start` or `ray up` runs here). What the Python one-liners of
docs/operations.md did, with a one-line error for a cluster or pool that is not
there."""

from __future__ import annotations

import argparse
import json
import logging
import socket
import time
from dataclasses import asdict

from cluster.cli_error import CliError


def add_pool_commands(sub) -> None:
    pools = sub.add_parser("pools", help="a running deployment's workers, start failures, scaling events and the "
                                         "settings its workers run")
    _connection_args(pools)
    pools.add_argument("--events", type=int, default=20, help="how many of the latest scaling events (default 20)")
    pools.add_argument("--json", action="store_true", help="as one JSON object")
    pools.set_defaults(func=_cmd_pools)

    drain = sub.add_parser("drain", help="take a worker out of a running deployment without failing its requests")
    drain.add_argument("worker_id", help="as `tandem pools` lists it, e.g. p0")
    _connection_args(drain)
    drain.set_defaults(func=_cmd_drain)

    teardown = sub.add_parser("teardown", help="stop a deployment's worker pools and their pool manager (after "
                                               "`serve shutdown`: a deploy then starts new ones from its manifest)")
    _connection_args(teardown)
    teardown.add_argument("--kv-stores", action="store_true",
                          help="also stop every node's KV store actors, of every deployment on the cluster: their "
                               "host memory is freed, their disk and shared tiers stay on disk for the next ones")
    teardown.set_defaults(func=_cmd_teardown)


def _connection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default="auto", help="the Ray cluster (default: auto, the one running here)")
    parser.add_argument("--pool-name", help="the manifest's pool_name (default: the cluster's only pool manager)")


def _pool_manager(args: argparse.Namespace) -> tuple[str, object]:
    """The pool manager's name and actor handle: the one --pool-name names, or
    the cluster's only one."""
    import ray

    from cluster.pool_manager import NAMESPACE  # (here, not at the top: `tandem --help` loads no torch)

    problem = _unreachable(args.address)
    if problem is not None:  # (Ray itself retries an address it cannot reach for minutes)
        raise CliError(f"cannot reach the Ray cluster at {args.address!r} ({problem}): pass the head's GCS address "
                       "(host:6379), or run this on a node of the cluster") from None
    # Ray's notices on connecting are not the command's output: token authentication
    # found enabled (the token `make serve`'s cluster wrote) was printed on every call.
    logging.getLogger("ray").setLevel(logging.ERROR)
    try:
        ray.init(address=args.address, logging_level="ERROR", log_to_driver=False, configure_logging=False)
    except (ConnectionError, ValueError, RuntimeError) as exc:  # (RuntimeError: `auto` found a head that is gone)
        raise CliError(f"no Ray cluster at {args.address!r} ({(str(exc).splitlines() or [''])[0]}): start one "
                       "(ray start, ray up), or pass --address") from None
    names = sorted(_actor_names(NAMESPACE))
    name = args.pool_name
    if name is None:  # (the namespace holds the pool managers alone)
        if len(names) != 1:
            raise CliError(f"several pool managers on this cluster ({', '.join(names)}): pass --pool-name" if names
                           else "no pool manager on this cluster: is the app deployed?")
        name = names[0]
    if name not in names:
        raise CliError(f"no pool manager {name!r} on this cluster (its pool managers: "
                       f"{', '.join(names) or 'none'}): is the app deployed, with this pool_name?")
    return name, ray.get_actor(name, namespace=NAMESPACE)


def _actor_names(namespace: str) -> list[str]:
    """The named actors of a Ray namespace on the connected cluster."""
    import ray

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace]


def _unreachable(address: str, timeout_s: float = 5.0) -> str | None:
    """Why a host:port address is no Ray GCS: it takes no TCP connection, or does
    not answer an HTTP/2 client preface with a SETTINGS frame as a GCS (gRPC)
    does (None: it is one, or the address is not host:port, such as `auto`). The
    dashboard's port (8265) or Serve's (8000) took the connection, and Ray retried
    them for minutes, printing warnings and no error."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "://" in address:
        return None
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # (and empty SETTINGS)
    try:
        connection = socket.create_connection((host, int(port)), timeout=timeout_s)
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    except (ValueError, OverflowError) as exc:  # (no host name: `a..b`, a label past 63 characters; a huge port)
        return f"{host!r} port {port} is no address ({exc})"
    header = b""
    with connection:
        try:
            connection.sendall(preface)
            while len(header) < 9 and (piece := connection.recv(9 - len(header))):
                header += piece
        except OSError:  # (reset, or silent past the timeout)
            pass
    if len(header) == 9 and header[3] == 4:  # (a frame's type is its fourth byte: 4, SETTINGS)
        return None
    return "it answers, but not as Ray's GCS does: an HTTP port, the dashboard's or Serve's?"


ANSWER_TIMEOUT_S = 60.0  # the pool manager's answer to a command (its shutdown: five times this)


def _answer(name: str, refs, timeout_s: float = ANSWER_TIMEOUT_S):
    """`ray.get(refs)` of pool manager `name`'s calls, or a one-line CliError: one
    busy or restarting hung the command for good, one that died meanwhile ended
    it in a traceback."""
    import ray

    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise CliError(f"pool manager {name!r} did not answer within {timeout_s:g} s (restarting, or busy?): "
                       "try again") from None
    except ray.exceptions.RayActorError as exc:
        raise CliError(f"pool manager {name!r} is gone ({type(exc).__name__}): is the app being redeployed?") from None
    except ray.exceptions.RayTaskError as exc:  # (its call failed: said in one line, the traceback in its log)
        raise CliError(f"pool manager {name!r} failed the command: {type(exc.cause).__name__}: {exc.cause}") from None


def _cmd_pools(args: argparse.Namespace) -> None:
    if args.events < 0:
        raise CliError(f"--events must be 0 or more, got {args.events}")
    name, pool = _pool_manager(args)
    workers, failures, events = _answer(name, [pool.workers.remote(), pool.start_failures.remote(),
                                                pool.scaling_events.remote()])
    try:
        settings = _answer(name, pool.running_settings.remote())
    except AttributeError:  # a pool manager of an older version
        settings = None
    latest = events[-args.events:] if args.events else []
    if settings is not None and settings.get("api_key") is not None:  # (a script's output ends up in logs)
        settings = {**settings, "api_key": "<redacted>"}
    if args.json:
        print(json.dumps({"pool_name": name, "workers": [asdict(w) for w in workers],
                          "failing": {role: asdict(f) for role, f in failures.items()},
                          "events": [{k: v for k, v in asdict(e).items() if k != "stats"} for e in latest],
                          "settings": settings}))
        return
    runs = ""
    if settings is not None:
        model = settings["model"]
        source = model["path"] or f"preset {model['preset']} ({model['arch']})"
        runs = f", {settings['mode']}, model {source}, engine on {settings['engine']['device']}"
    print(f"pool {name}: {len(workers)} workers{runs}")
    for worker in sorted(workers, key=lambda w: (w.role, w.worker_id)):
        print(f"  {worker.worker_id:<8} {worker.role:<10} {worker.state}")
    for role, failure in failures.items():
        retry = "" if failure.next_start_in_s is None else f"; next start in {failure.next_start_in_s:g} s"
        print(f"failing: {role}: {failure.worker_id} ({failure.failures_in_a_row} in a row): {failure.error}{retry}")
    if latest:
        print(f"scaling events, the latest {len(latest)} of {len(events)}:")
    for event in latest:
        when = time.strftime("%H:%M:%S", time.localtime(event.time_s))
        what = " ".join(part for part in (event.kind, event.worker_id or "", event.signal) if part)
        print(f"  {when} {event.role} {what}" + (f": {event.reason}" if event.reason else ""))


def _cmd_drain(args: argparse.Namespace) -> None:
    name, pool = _pool_manager(args)
    workers = {w.worker_id: w for w in _answer(name, pool.workers.remote())}
    worker = workers.get(args.worker_id)
    if worker is None:
        raise CliError(f"no worker {args.worker_id!r} in pool {name!r}; its workers: "
                       f"{', '.join(sorted(workers)) or 'none'}")
    state = _answer(name, pool.drain.remote(args.worker_id, "by hand (tandem drain)"))
    if state is None:
        raise CliError(f"{args.worker_id} is draining already (or waits to, for its replacement)")
    if state == "waiting":
        print(f"{args.worker_id} ({worker.role}) drains once another {worker.role} worker has started, and serves "
              "until then (it is its role's only one: `tandem pools` shows the one starting in its place)")
        return
    print(f"{args.worker_id} ({worker.role}) is draining: it takes no new requests and goes once it holds none "
          "(at most autoscaling.drain_timeout_s)")


def _cmd_teardown(args: argparse.Namespace) -> None:
    """The pool manager's workers stopped, then the pool manager: what a deploy of
    settings the pools keep (cluster/pool_settings.py) needs first. Scheduler
    replicas still deployed start a new pool manager from their own manifest at
    their next refresh. With --kv-stores, the nodes' KV store actors too (detached,
    they outlive every deployment: a new `kv_store` setting starts new ones beside
    them, whose host memory the old ones would keep)."""
    import ray

    from actors.kv_store_client import STORE_NAMESPACE

    name, pool = _pool_manager(args)
    num_workers = len(_answer(name, pool.workers.remote()))
    _answer(name, pool.shutdown.remote(), 5 * ANSWER_TIMEOUT_S)
    ray.kill(pool)
    print(f"pool {name}: its {num_workers} workers and its pool manager stopped")
    if args.kv_stores:
        stores = _actor_names(STORE_NAMESPACE)
        for store in stores:
            ray.kill(ray.get_actor(store, namespace=STORE_NAMESPACE))
        print(f"{len(stores)} KV store actors stopped (their disk and shared tiers stay on disk)")
