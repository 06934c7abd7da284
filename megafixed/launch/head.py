"""The head node's address that every node of a job can reach.

The classic multi-node failure: ``MASTER_ADDR=$(hostname)`` on a machine whose ``/etc/hosts``
maps its own name to ``127.0.1.1`` (Debian's default) or ``127.0.0.1``. Rank 0 then listens on
loopback and the other nodes either never connect (a hang until the collective timeout) or, with
per-node rendezvous, connect to *themselves* and train as separate worlds. So: resolve the name,
keep a non-loopback address, and where the name only resolves to loopback ask the kernel which
source address it would use towards another node of the job (no packet is sent). Loopback is
fine only when the job has one node.

``python -m megafixed.launch.head HEAD_NODE --nodes N [--peer OTHER_NODE]`` prints the address
(the sbatch script of ``megafixed submit`` runs it on the head node, where the batch script runs).
"""
from __future__ import annotations

import argparse
import ipaddress
import shutil
import socket
import subprocess
import sys

from .errors import LaunchError


def is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def addresses(host: str) -> list[str]:
    """Every address ``host`` resolves to, IPv4 first (what NCCL/gloo pick by default), in resolver order."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise LaunchError(f"cannot resolve the node name {host!r} ({exc.strerror}); check DNS or /etc/hosts on "
                          f"this node, or export MASTER_ADDR=<the head node's address> yourself") from None
    seen: list[str] = []
    for family in (socket.AF_INET, socket.AF_INET6):
        for fam, _, _, _, sockaddr in infos:
            if fam == family and sockaddr[0] not in seen:
                seen.append(sockaddr[0])
    return seen


def source_address(dest: str) -> str | None:
    """The local address the kernel would use to reach ``dest`` (a UDP connect sends nothing)."""
    family = socket.AF_INET6 if ":" in dest else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((dest, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def interface_of(addr: str) -> str | None:
    """The name of the local network interface that holds ``addr`` (e.g. eth0), or None."""
    import psutil  # a DeepSpeed dependency

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%", 1)[0] == addr for a in addrs):
            return name
    return None


def pin_gloo_interface(master: str, env=None) -> str | None:
    """Set ``GLOO_SOCKET_IFNAME`` to the interface that routes to ``master`` when gloo would pick loopback.

    Without it gloo binds to the address of this node's *hostname*; with Debian's ``127.0.1.1 <hostname>``
    line in /etc/hosts that is loopback, peers on other nodes are told to connect to 127.0.1.1 and the
    first collective hangs. An explicit GLOO_SOCKET_IFNAME (or a hostname with a real address) is kept."""
    import os

    env = os.environ if env is None else env
    if env.get("GLOO_SOCKET_IFNAME") or is_loopback(master):
        return None
    try:
        own = addresses(socket.gethostname())
    except LaunchError:
        own = []
    if any(not is_loopback(a) for a in own):
        return None
    src = source_address(master)
    name = interface_of(src) if src and not is_loopback(src) else None
    if name:
        env["GLOO_SOCKET_IFNAME"] = name
    return name


def reachable_address(host: str, nnodes: int, peer: str | None = None) -> str:
    """An address of ``host`` that the job's other nodes can connect to; loopback only on one node."""
    found = addresses(host)
    good = [a for a in found if not is_loopback(a)]
    if good:
        return good[0]
    if nnodes <= 1:
        return found[0]
    for peer_addr in (addresses(peer) if peer else []):
        src = None if is_loopback(peer_addr) else source_address(peer_addr)
        if src and not is_loopback(src):
            return src
    raise LaunchError(f"the head node {host} resolves only to loopback ({', '.join(found)}) and this job spans "
                      f"{nnodes} nodes: the other nodes could not reach its rendezvous (or would reach "
                      f"themselves). Fix the name resolution of {host} (/etc/hosts maps it to loopback, or DNS), "
                      f"or export MASTER_ADDR=<its address on the cluster network> before srun")


def expand_nodelist(nodelist: str) -> list[str]:
    """``node[01-03]`` -> [node01, node02, node03], by Slurm itself (its syntax has many forms)."""
    if shutil.which("scontrol") is None:
        raise LaunchError(f"cannot expand the Slurm node list {nodelist!r}: scontrol is not on PATH; export "
                          f"MASTER_ADDR=<the head node's address> and MASTER_PORT yourself")
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60)
    hosts = out.stdout.split()
    if out.returncode != 0 or not hosts:
        raise LaunchError(f"`scontrol show hostnames {nodelist}` failed ({out.stderr.strip() or 'no hosts'}); "
                          f"export MASTER_ADDR and MASTER_PORT yourself")
    return hosts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megafixed.launch.head", description=__doc__.split("\n\n")[0])
    p.add_argument("host", help="the head node's name (first of `scontrol show hostnames $SLURM_JOB_NODELIST`)")
    p.add_argument("--nodes", type=int, default=1, help="nodes in the job ($SLURM_JOB_NUM_NODES)")
    p.add_argument("--peer", default=None, help="another node of the job, to find the route's source address")
    args = p.parse_args(argv)
    try:
        print(reachable_address(args.host, args.nodes, args.peer or None))
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
