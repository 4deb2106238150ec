"""A real two-node Slurm cluster on one machine, for tests (run as root).

`ensure()` brings it up idempotently (a second call, or a second pytest session, reuses what is
running) and returns a `Cluster`, or raises `Unavailable` with the reason it cannot run here:

- Debian's `slurmctld`, `slurmd`, `slurm-client` and `munge` are installed with apt-get when
  missing (once; apt keeps the .debs in its cache);
- a bridge `rsbr0` (10.77.0.1/24) in the host namespace, and two network namespaces `rs-node1`,
  `rs-node2`, each joined to the bridge by a veth pair and owning its own address (10.77.0.11,
  10.77.0.12). Each slurmd also runs in its own UTS namespace, so `hostname` says node1/node2,
  and `ip netns exec` mounts /etc/netns/<ns>/hosts over /etc/hosts, so node names resolve to
  those addresses inside the nodes. Rendezvous, the TCP store, gloo and the heartbeat therefore
  cross real interfaces, as between two machines;
- munged (one per machine, as on a cluster: a unix socket, not namespaced), slurmctld in the host
  namespace on 10.77.0.1, and `slurmd -N nodeX` in each node namespace; cgroups are not used
  (proctrack/linuxproc, task/none), so it works in a container.

Clients need `SLURM_CONF` (see `Cluster.env`). `python tests/slurm_harness.py up|down|status`.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

STATE = Path("/tmp/rankserve-slurm")
BRIDGE, BRIDGE_IP = "rsbr0", "10.77.0.1"
NODES = {"node1": "10.77.0.11", "node2": "10.77.0.12"}
CPUS_PER_NODE = 2
_CTLD = socket.gethostname().split(".")[0]  # slurmctld must run on the host it names
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")


class Unavailable(RuntimeError):
    """The cluster cannot run on this machine; the message says why."""


@dataclass(frozen=True)
class Cluster:
    conf: Path
    nodes: dict[str, str]  # node name -> address

    @property
    def env(self) -> dict[str, str]:
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def addr(self, node: str) -> str:
        return self.nodes[node]


def _sh(cmd: str, check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise Unavailable(f"`{cmd}` failed ({r.returncode}): {(r.stderr or r.stdout).strip()[-500:]}")
    return r


def _ns(node: str) -> str:
    return f"rs-{node}"


def _conf_text() -> str:
    nodes = "\n".join(f"NodeName={n} NodeAddr={a} NodeHostname={n} CPUs={CPUS_PER_NODE} "
                      f"RealMemory=1000 State=UNKNOWN" for n, a in NODES.items())
    return f"""# written by tests/slurm_harness.py
ClusterName=rankserve-ci
SlurmctldHost={_CTLD}({BRIDGE_IP})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation={STATE}/ctld
SlurmdSpoolDir={STATE}/spool-%n
SlurmctldPidFile={STATE}/slurmctld.pid
SlurmdPidFile={STATE}/slurmd-%n.pid
SlurmctldLogFile={STATE}/slurmctld.log
SlurmdLogFile={STATE}/slurmd-%n.log
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=10
MinJobAge=60
{nodes}
PartitionName=ci Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:2
"""


def _install() -> None:
    missing = [p for p in PACKAGES if _sh(f"dpkg -s {p}", check=False).returncode != 0]
    if not missing:
        return
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = f"apt-get install -y -q --no-install-recommends {' '.join(missing)}"
    if _sh(cmd, check=False, timeout=600, env=env).returncode != 0:
        _sh("apt-get update -q", timeout=300, env=env)
        _sh(cmd, timeout=600, env=env)


def _network() -> None:
    if _sh(f"ip link show {BRIDGE}", check=False).returncode != 0:
        _sh(f"ip link add {BRIDGE} type bridge")
        _sh(f"ip addr add {BRIDGE_IP}/24 dev {BRIDGE}")
    _sh(f"ip link set {BRIDGE} up")
    existing = _sh("ip netns list", check=False).stdout
    for i, (node, addr) in enumerate(NODES.items(), start=1):
        ns, host_if = _ns(node), f"rsv{i}"
        if ns not in existing.split():
            _sh(f"ip netns add {ns}")
        if _sh(f"ip link show {host_if}", check=False).returncode != 0:
            _sh(f"ip link add {host_if} type veth peer name eth0 netns {ns}")
            _sh(f"ip link set {host_if} master {BRIDGE}")
            _sh(f"ip -n {ns} addr add {addr}/24 dev eth0")
        _sh(f"ip link set {host_if} up")
        _sh(f"ip -n {ns} link set lo up")
        _sh(f"ip -n {ns} link set eth0 up")
        etc = Path("/etc/netns") / ns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(
            "127.0.0.1 localhost\n" + f"{BRIDGE_IP} {_CTLD}\n"
            + "".join(f"{a} {n}\n" for n, a in NODES.items()))


def _munge() -> None:
    if _sh("munge -n | unmunge", check=False).returncode == 0:
        return
    _sh("install -d -o munge -g munge -m 0755 /run/munge")
    if not Path("/etc/munge/munge.key").exists():
        _sh("runuser -u munge -- mungekey --create")
    _sh("runuser -u munge -- /usr/sbin/munged")
    for _ in range(50):
        if _sh("munge -n | unmunge", check=False).returncode == 0:
            return
        time.sleep(0.1)
    raise Unavailable("munged does not answer")


def _alive(pidfile: Path) -> bool:
    """The daemon of this pid file runs (a stale file's pid may belong to something else now)."""
    try:
        pid = int(pidfile.read_text().strip())
        return Path(f"/proc/{pid}/comm").read_text().strip().startswith("slurm")
    except (OSError, ValueError):
        return False


def _daemons(conf: Path, restart: bool) -> None:
    if restart:
        _stop_daemons()
    if not _alive(STATE / "slurmctld.pid"):
        _sh(f"slurmctld -f {conf}")
    for node in NODES:
        if not _alive(STATE / f"slurmd-{node}.pid"):
            # own network namespace (address) and UTS namespace (hostname) per node
            # nsenter rather than `ip netns exec`, which remounts /sys without the cgroup
            # hierarchy slurmd 22.05 insists on; the node's /etc/hosts is bind-mounted here
            (STATE / f"spool-{node}").mkdir(exist_ok=True)
            _sh(f"nsenter --net=/run/netns/{_ns(node)} unshare --uts --mount sh -c "
                f"'mount --bind /etc/netns/{_ns(node)}/hosts /etc/hosts && hostname {node} && "
                f"exec slurmd -f {conf} -N {node}'")


def _wait_idle(env: dict, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    out = ""
    while time.monotonic() < deadline:
        out = _sh("sinfo -h -N -o '%N %T'", check=False, env=env).stdout
        states = dict(line.split() for line in out.splitlines() if line.strip())
        if all(states.get(n, "").rstrip("*").startswith(("idle", "mixed", "alloc")) for n in NODES):
            return
        if any(s.startswith(("down", "drain")) for s in states.values()):
            _sh(f"scontrol update nodename={','.join(NODES)} state=resume", check=False, env=env)
        time.sleep(0.5)
    raise Unavailable(f"nodes not idle after {timeout:.0f} s: {out.strip()}; see {STATE}/*.log")


def ensure() -> Cluster:
    """Bring the cluster up (or reuse it). Raises Unavailable with the reason."""
    if os.geteuid() != 0:
        raise Unavailable("needs root (network namespaces, Slurm daemons)")
    if not all(shutil.which(t) for t in ("ip", "unshare", "nsenter", "runuser")):
        raise Unavailable("needs iproute2 and util-linux (unshare, nsenter, runuser)")
    if not shutil.which("slurmd") and not shutil.which("apt-get"):
        raise Unavailable("Slurm is not installed and there is no apt-get to install it")
    STATE.mkdir(parents=True, exist_ok=True)
    with open(STATE / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent test sessions share one cluster
        _install()
        _network()
        _munge()
        conf = STATE / "slurm.conf"
        text = _conf_text()
        changed = not conf.exists() or conf.read_text() != text
        if changed:
            conf.write_text(text)
        (STATE / "ctld").mkdir(exist_ok=True)
        cluster = Cluster(conf, dict(NODES))
        _daemons(conf, restart=changed)
        _wait_idle(cluster.env)
        return cluster


def _stop_daemons() -> None:
    for pidfile in sorted(STATE.glob("slurm*.pid")):
        try:
            os.kill(int(pidfile.read_text().strip()), 15)
        except (OSError, ValueError):
            pass
    time.sleep(1)


def down() -> None:
    """Stop the daemons and remove the namespaces and the bridge (munged is left running)."""
    _stop_daemons()
    for i, node in enumerate(NODES, start=1):
        _sh(f"ip link del rsv{i}", check=False)
        _sh(f"ip netns del {_ns(node)}", check=False)
    _sh(f"ip link del {BRIDGE}", check=False)


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "up"
    if what == "down":
        down()
    else:
        c = ensure()
        print(f"SLURM_CONF={c.conf}")
        print(_sh("sinfo -N -o '%N %o %T'", env=c.env).stdout)
