"""jax.distributed start-up: explicit settings, SLURM or Open MPI, else one process (a no-op).

Where the settings come from, first match wins:
1. explicit: arguments of `initialize()` or the environment `MESHRUN_COORDINATOR` (host:port of
   process 0), `MESHRUN_NUM_PROCESSES`, `MESHRUN_PROCESS_ID` (`launch/local.sh`, `launch/hosts.sh`).
   A count or id left out is taken from SLURM/Open MPI when the job has several tasks.
2. SLURM (`srun`, several tasks) or Open MPI (`mpirun`): jax's own cluster detection.
3. nothing: a single process; jax.distributed is not started.

Optional: `MESHRUN_LOCAL_DEVICES` (simulated CPU devices per process), `MESHRUN_INIT_TIMEOUT_S`,
`MESHRUN_HEARTBEAT_S`. Failure modes are bounded: a coordinator that cannot be reached or peers
that never join end the start-up after the time-out with a message naming the coordinator; a peer
that dies later stops sending heartbeats and the coordination service terminates every other
process after `heartbeat_s` ("The following tasks are unhealthy (stopped sending heartbeats): 1").
"""

from __future__ import annotations

import errno
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from meshrun.errors import EXIT_CONFIG, ConfigError, DistributedError
from meshrun.runtime.devices import needed_devices, setup_devices, simulate_cpu_devices

ENV_COORDINATOR = "MESHRUN_COORDINATOR"
ENV_NUM_PROCESSES = "MESHRUN_NUM_PROCESSES"
ENV_PROCESS_ID = "MESHRUN_PROCESS_ID"
ENV_LOCAL_DEVICES = "MESHRUN_LOCAL_DEVICES"
ENV_INIT_TIMEOUT = "MESHRUN_INIT_TIMEOUT_S"
ENV_HEARTBEAT = "MESHRUN_HEARTBEAT_S"

DEFAULT_TIMEOUT_S = 300  # jax's default: nodes of a large job may start minutes apart
DEFAULT_HEARTBEAT_S = 30  # jax's default is 100 s; a dead peer should not idle 1000 GPUs that long
_GRACE_S = 10  # jax's own start-up deadline comes this much after ours, so our message wins


@dataclass(frozen=True)
class JoinSettings:
    """How this process joins the job: the resolved process-group settings (pure data, decided
    before jax is imported)."""

    mode: str  # single | explicit | slurm | ompi
    coordinator: str | None = None
    num_processes: int = 1
    process_id: int = 0
    local_devices: int | None = None  # simulated CPU devices per process
    # jax local_device_ids: None = jax's choice (one GPU per task under SLURM/MPI), [] = all visible
    local_device_ids: list[int] | None = field(default=None)


# ------------------------------------------------------------------ parsing and validation


def parse_coordinator(addr: str, name: str = ENV_COORDINATOR) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port); ConfigError otherwise."""
    fix = "give HOST:PORT of process 0, e.g. 10.0.0.1:61234 or 127.0.0.1:61234 on one machine"
    text = str(addr).strip()
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
    else:
        host, sep, port = text.rpartition(":")
    if not sep or not host or ":" in host and not text.startswith("["):
        raise ConfigError(name, addr, fix, "coordinator is not HOST:PORT")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(name, addr, fix, "port is not a number in 1..65535")
    return host, int(port)


def _int(name: str, raw, lo: int | None = None) -> int:
    try:
        v = int(str(raw).strip())
    except ValueError:
        raise ConfigError(name, raw, "use a whole number, e.g. 2", "not an integer") from None
    if lo is not None and v < lo:
        raise ConfigError(name, v, f"use a number >= {lo}")
    return v


def _scheduler(env: Mapping[str, str]) -> tuple[str, int, int, int] | None:
    """(name, size, rank, tasks on this node) of a SLURM step or Open MPI job with > 1 task."""
    if all(k in env for k in ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NODELIST")):
        size = _int("SLURM_NTASKS", env.get("SLURM_NTASKS", "1"), 1)
        if size > 1:
            per_node = env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", ""))
            local = 1 if per_node and all(p.split("(")[0] == "1" for p in per_node.split(",")) else 0
            return "slurm", size, _int("SLURM_PROCID", env["SLURM_PROCID"], 0), local
    if "OMPI_COMM_WORLD_SIZE" in env:
        size = _int("OMPI_COMM_WORLD_SIZE", env["OMPI_COMM_WORLD_SIZE"], 1)
        if size > 1:
            local = _int("OMPI_COMM_WORLD_LOCAL_SIZE", env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "0"))
            return "ompi", size, _int("OMPI_COMM_WORLD_RANK", env.get("OMPI_COMM_WORLD_RANK", "0"), 0), local
    return None


def plan(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    env: Mapping[str, str] | None = None,
) -> JoinSettings:
    """Decide how to start (see the module docstring); every inconsistency is a ConfigError."""
    env = os.environ if env is None else env
    coordinator = coordinator or env.get(ENV_COORDINATOR) or None
    if num_processes is None and env.get(ENV_NUM_PROCESSES, "") != "":
        num_processes = _int(ENV_NUM_PROCESSES, env[ENV_NUM_PROCESSES])
    if process_id is None and env.get(ENV_PROCESS_ID, "") != "":
        process_id = _int(ENV_PROCESS_ID, env[ENV_PROCESS_ID])
    local = _int(ENV_LOCAL_DEVICES, env[ENV_LOCAL_DEVICES], 1) if env.get(ENV_LOCAL_DEVICES) else None
    sched = _scheduler(env)
    if num_processes is not None and num_processes < 1:
        raise ConfigError(ENV_NUM_PROCESSES, num_processes, "use 1 or more processes", "must be >= 1")
    if sched and num_processes is not None and num_processes != sched[1]:
        raise ConfigError(
            ENV_NUM_PROCESSES,
            num_processes,
            f"unset it or make it {sched[1]} (the task count {sched[0]} started)",
            f"disagrees with the {sched[0]} job's {sched[1]} tasks",
        )
    if coordinator is None and num_processes is None and process_id is None:
        return _from_scheduler(sched, env, local)
    return _explicit(coordinator, num_processes, process_id, sched, local)


def _from_scheduler(sched: tuple[str, int, int, int] | None, env: Mapping[str, str], local: int | None) -> JoinSettings:
    """Nothing explicit: the SLURM/Open MPI job's settings, or a single process without one."""
    if sched is None:
        return JoinSettings("single", local_devices=local)
    name, size, rank, per_node = sched
    if name == "ompi" and "OMPI_MCA_orte_hnp_uri" not in env:
        raise ConfigError(
            ENV_COORDINATOR,
            None,
            "set it to HOST:PORT of rank 0 (count and id come from OMPI_COMM_WORLD_*)",
            "this Open MPI (5.x) does not export OMPI_MCA_orte_hnp_uri, jax cannot find the coordinator",
        )
    # One task per node owns all of the node's GPUs; jax would otherwise give it only GPU LOCALID.
    return JoinSettings(name, None, size, rank, local, [] if per_node == 1 else None)


def _explicit(
    coordinator: str | None,
    num_processes: int | None,
    process_id: int | None,
    sched: tuple[str, int, int, int] | None,
    local: int | None,
) -> JoinSettings:
    """Explicit settings, a count or id left out taken from the scheduler's job when there is one."""
    if num_processes is None and sched:
        num_processes = sched[1]
    if process_id is None and sched:
        process_id = sched[2]
    if num_processes is None:
        num_processes = 1 if coordinator is None else None
    if num_processes is None:
        raise ConfigError(ENV_NUM_PROCESSES, None, "set the number of processes of the job, e.g. 2")
    if process_id is None:
        if num_processes > 1:
            raise ConfigError(ENV_PROCESS_ID, None, f"set this process's id, 0..{num_processes - 1}")
        process_id = 0
    if not 0 <= process_id < num_processes:
        raise ConfigError(
            ENV_PROCESS_ID,
            process_id,
            f"use 0..{num_processes - 1} (one distinct id per process)",
            f"out of range for {num_processes} processes",
        )
    if num_processes == 1:
        return JoinSettings("single", coordinator, 1, 0, local)
    if coordinator is None:
        raise ConfigError(ENV_COORDINATOR, None, "set HOST:PORT of process 0, e.g. 127.0.0.1:61234")
    parse_coordinator(coordinator)
    return JoinSettings("explicit", coordinator, num_processes, process_id, local)


# ------------------------------------------------------------------ network pre-flight


def _port_free(port: int) -> str | None:
    """None when process 0 can bind `port` where jax's coordinator will (all interfaces, or
    JAX_COORDINATOR_BIND_ADDRESS), else why. jax segfaults on a port in use, hence this check."""
    bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS")
    if bind:
        host, port = parse_coordinator(bind, "JAX_COORDINATOR_BIND_ADDRESS")
        targets = [(socket.AF_INET6 if ":" in host else socket.AF_INET, host)]
    else:
        targets = [(socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")]
    for family, addr in targets:
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue
        with s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((addr, port))
                return None
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return "port already in use"
    return None  # no stack could be probed: let jax try


def _wait_reachable(host: str, port: int, deadline: float) -> str | None:
    """Retry a TCP connect to the coordinator until `deadline`; None when it answers, else the last error."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return f"cannot resolve {host!r} ({e.strerror})"
    why = "no address"
    while True:
        for family, kind, proto, _, sockaddr in infos:
            try:
                with socket.socket(family, kind, proto) as s:
                    s.settimeout(max(0.1, min(2.0, deadline - time.monotonic())))
                    s.connect(sockaddr)
                    return None
            except OSError as e:
                why = e.strerror or type(e).__name__
        if time.monotonic() >= deadline:
            return why
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


# ------------------------------------------------------------------ initialize


def _env_seconds(name: str, value: float | None, default: float) -> float:
    if value is not None:
        return float(value)
    raw = os.environ.get(name, "")
    return float(_int(name, raw, 1)) if raw else default


def _watchdog(p: JoinSettings, wait_s: float, timeout_s: float, done: threading.Event) -> None:
    """jax aborts the process (no Python exception) when start-up fails: say why first, then exit."""
    if done.wait(wait_s):
        return
    where = p.coordinator or f"the {p.mode} coordinator"
    print(
        f"meshrun: error: process {p.process_id} of {p.num_processes}: start-up timed out after "
        f"{timeout_s:g} s waiting for all processes to join the coordinator at {where}; check that every "
        f"process runs with the same process count ({p.num_processes}) and a distinct process id, and "
        f"that none of them failed (see its log); raise {ENV_INIT_TIMEOUT} if nodes start slowly",
        file=sys.stderr,
        flush=True,
    )
    os._exit(EXIT_CONFIG)  # like bad input: the fix is nearly always the address, a count or an id


def _handshake(client, p: JoinSettings, local: int, nproc: int) -> None:
    """Every process publishes what it was told; all of them compare and fail together."""
    mine = f"{p.num_processes},{local}"
    client.key_value_set(f"meshrun/startup/{p.process_id}", mine)
    n = min(p.num_processes, nproc)  # a process told a larger count must not wait for ids that never come
    views = [client.blocking_key_value_get(f"meshrun/startup/{i}", 60_000) for i in range(n)]
    counts = sorted({v.split(",")[0] for v in views})
    if len(counts) > 1:
        raise ConfigError(
            ENV_NUM_PROCESSES,
            ", ".join(f"process {i}: {v.split(',')[0]}" for i, v in enumerate(views)),
            "give every process the same count",
            "processes disagree on the process count",
        )
    devs = sorted({v.split(",")[1] for v in views})
    if len(devs) > 1:
        raise ConfigError(
            "local devices",
            ", ".join(f"process {i}: {v.split(',')[1]}" for i, v in enumerate(views)),
            f"give every process the same device count (e.g. {ENV_LOCAL_DEVICES})",
            "processes have different numbers of devices",
        )


def _already_initialized() -> dict:
    import jax
    from jax._src import distributed as _dist

    return {
        "mode": "initialized",
        "process_id": jax.process_index(),
        "num_processes": jax.process_count(),
        "coordinator": _dist.global_state.coordinator_address,
        "host": socket.gethostname(),
        "local_devices": jax.local_device_count(),
        "global_devices": jax.device_count(),
    }


def _preflight(p: JoinSettings, timeout_s: float, deadline: float) -> None:
    """Explicit settings: process 0 checks that it can bind the coordinator port, every other
    process that the coordinator answers before `deadline` (jax would abort or hang instead)."""
    host, port = parse_coordinator(p.coordinator)
    if p.process_id == 0:
        why = _port_free(port)
        if why:
            raise ConfigError(
                ENV_COORDINATOR,
                p.coordinator,
                "choose a free port (launch/local.sh picks one) or stop the old job",
                why,
            )
        return
    why = _wait_reachable(host, port, deadline)
    if why:
        raise ConfigError(
            ENV_COORDINATOR,
            p.coordinator,
            "start process 0 there, or give the address process 0 listens on",
            f"process {p.process_id} cannot reach the coordinator within {timeout_s:g} s ({why})",
        )


def _join(p: JoinSettings, deadline: float, timeout_s: float, heartbeat_s: float) -> JoinSettings:
    """jax.distributed.initialize under the start-up watchdog, then the handshake. Returns the
    settings as joined: under SLURM / Open MPI jax's cluster detection found the coordinator, count and id."""
    import jax
    from jax._src import distributed as _dist

    done = threading.Event()
    left = max(1.0, deadline - time.monotonic())
    threading.Thread(target=_watchdog, args=(p, left, timeout_s, done), daemon=True, name="meshrun-startup").start()
    kwargs = dict(
        initialization_timeout=int(left + _GRACE_S),
        heartbeat_timeout_seconds=int(heartbeat_s),
        shutdown_timeout_seconds=int(timeout_s),
        local_device_ids=p.local_device_ids,
    )
    try:
        if p.mode == "explicit":
            kwargs["cluster_detection_method"] = "deactivate"  # do not let SLURM vars pick one GPU per task
            jax.distributed.initialize(p.coordinator, p.num_processes, p.process_id, **kwargs)
        else:
            jax.distributed.initialize(**kwargs)
        state = _dist.global_state
        if p.mode != "explicit":
            coordinator, n, i = state.coordinator_address, jax.process_count(), jax.process_index()
            p = JoinSettings(p.mode, coordinator, n, i, p.local_devices, p.local_device_ids)
        _handshake(state.client, p, jax.local_device_count(), jax.process_count())
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - jax/XLA raise RuntimeError, ValueError or XlaRuntimeError here
        raise DistributedError(_join_failure(p, e)) from e
    finally:
        done.set()
    return p


def _join_failure(p: JoinSettings, e: BaseException) -> str:
    """One line for a jax.distributed failure after the pre-flight checks passed."""
    first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
    where = p.coordinator or f"the {p.mode} coordinator"
    return (
        f"process {p.process_id} of {p.num_processes}: jax.distributed could not start with the coordinator at "
        f"{where} ({type(e).__name__}: {first[:300]}); check that process 0 is running and every process "
        "has the same settings (see the other processes' logs)"
    )


def _check_joined(p: JoinSettings) -> None:
    """The job jax joined is the one this process was told about."""
    import jax

    if jax.process_count() != p.num_processes:  # the coordinator runs a job of another size
        raise ConfigError(
            ENV_NUM_PROCESSES,
            p.num_processes,
            f"use {jax.process_count()}",
            f"the coordinator at {p.coordinator} runs {jax.process_count()} processes",
        )
    if p.local_devices and jax.local_device_count() != p.local_devices:
        raise ConfigError(
            ENV_LOCAL_DEVICES,
            p.local_devices,
            f"jax sees {jax.local_device_count()} local devices",
            "set it before jax is imported (or leave it unset)",
        )


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout_s: float | None = None,
    heartbeat_s: float | None = None,
) -> dict:
    """Start jax.distributed when the job has several processes; return what this process is.

    Call before any jax computation. `timeout_s` bounds start-up (all processes must join);
    `heartbeat_s` is how long a silent peer may stay silent before the job is terminated."""
    if "jax" in sys.modules and sys.modules["jax"].distributed.is_initialized():
        return _already_initialized()  # a second call (tests, notebooks): report, do not restart
    p = plan(coordinator, num_processes, process_id)
    if p.local_devices:
        simulate_cpu_devices(p.local_devices)
    info = {
        "mode": p.mode,
        "process_id": p.process_id,
        "num_processes": p.num_processes,
        "coordinator": p.coordinator,
        "host": socket.gethostname(),
    }
    if p.mode == "single":
        return info
    timeout_s = _env_seconds(ENV_INIT_TIMEOUT, timeout_s, DEFAULT_TIMEOUT_S)
    heartbeat_s = _env_seconds(ENV_HEARTBEAT, heartbeat_s, DEFAULT_HEARTBEAT_S)
    p = _start(p, timeout_s, heartbeat_s)
    return _report_joined(info, p, timeout_s, heartbeat_s)


def _start(p: JoinSettings, timeout_s: float, heartbeat_s: float) -> JoinSettings:
    """The pre-flight checks (explicit settings), the join and its checks, all processes within
    `timeout_s`; returns the settings as joined (`_join`)."""
    deadline = time.monotonic() + timeout_s
    if p.mode == "explicit":
        _preflight(p, timeout_s, deadline)
    p = _join(p, deadline, timeout_s, heartbeat_s)
    _check_joined(p)
    return p


def _report_joined(info: dict, p: JoinSettings, timeout_s: float, heartbeat_s: float) -> dict:
    """`initialize`'s `info` completed with the job as joined (`p`), and the line each process prints
    about itself to stderr."""
    import jax

    info.update(
        mode=p.mode,
        coordinator=p.coordinator,
        local_devices=jax.local_device_count(),
        global_devices=jax.device_count(),
        platform=jax.devices()[0].platform,
        heartbeat_s=heartbeat_s,
        timeout_s=timeout_s,
    )
    print(
        f"meshrun: process {info['process_id']}/{info['num_processes']} host={info['host']} "
        f"local_devices={info['local_devices']} ({info['platform']}) global_devices={info['global_devices']} "
        f"coordinator={info['coordinator']} via={p.mode}",
        file=sys.stderr,
        flush=True,
    )
    return info


def start_command(cfg, args, command: str) -> str:
    """Devices for a command that runs `cfg` (`--devices N`, `--fast-compile`: CPU only), then
    `jax.distributed` when the launcher asked for it; returns the platform."""
    if args.devices < 0:
        raise ConfigError("--devices", args.devices, "use a positive device count")
    force = bool(args.devices)
    platform = setup_devices(args.devices or needed_devices(cfg), force=force, fast_compile=args.fast_compile)
    if platform != "cpu" and (args.devices or args.fast_compile):
        print(f"meshrun {command}: platform {platform}: --devices and --fast-compile act on CPU only", file=sys.stderr)
    initialize()
    return platform
