"""What the rendezvous exposes on the network: a one-process run opens no store socket (an in-memory
HashStore) and nothing on a non-loopback address; with several ranks, rank 0's TCPStore listens at
the address MASTER_ADDR names, not on every interface."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from _env import launch_free_env
from megafixed.launch import rendezvous
from megafixed.launch.world import World

LISTEN = "0A"


def listening(pid: int | str = "self") -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that process ``pid`` holds (/proc/<pid>/net/tcp*,
    matched to the process's own socket inodes)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in open(f"/proc/{pid}/net/{name}").read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == LISTEN and fields[9] in inodes:
                hex_addr, hex_port = fields[1].split(":")
                raw = bytes.fromhex(hex_addr)
                if family == socket.AF_INET:
                    raw = raw[::-1]
                else:  # four little-endian 32-bit words
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                out.append((socket.inet_ntop(family, raw), int(hex_port, 16)))
    return out


def _loopback(addr: str) -> bool:
    return addr.startswith("127.") or addr == "::1"


LONE_RUN = """
import json, sys
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from test_rendezvous_sockets import listening
from megafixed.config import load_config
from megafixed.launch import rendezvous
from megafixed.parallel import setup_distributed
from megafixed.run_plan import RunPlan

conf = load_config(None, ["data.mock=true", "train.global_batch=8"])
setup_distributed(RunPlan.for_launch(conf))
t = torch.ones(3)
dist.all_reduce(t)
dist.new_group([0])
print(json.dumps({"store": type(rendezvous.store()).__name__, "listening": listening(), "sum": t.tolist()}))
"""


@pytest.mark.multiprocess
def test_a_one_process_run_opens_no_store_and_nothing_beyond_loopback(tmp_path):
    env = launch_free_env()
    env.pop("GLOO_SOCKET_IFNAME", None)
    out = subprocess.run([sys.executable, "-c", LONE_RUN, os.path.dirname(__file__)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["store"] == "HashStore" and seen["sum"] == [1.0, 1.0, 1.0]
    # gloo's own device listens per group, even for one rank (on loopback, pinned); no store, nothing wider
    assert all(_loopback(addr) for addr, _port in seen["listening"]), seen["listening"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rank0s_store_listens_only_at_master_addr():
    port = _free_port()
    world = World(2, 0, 0, "srun", 1)
    deadline = rendezvous.time.monotonic() + 30
    store = rendezvous._open_store(world, "127.0.0.1", port, deadline, 30)
    try:
        mine = [(a, p) for a, p in listening() if p == port]
        assert mine == [("127.0.0.1", port)], mine  # not 0.0.0.0 / ::
        client = rendezvous._open_store(World(2, 1, 0, "srun", 1), "127.0.0.1", port, deadline, 30)
        client.set("k", "v")
        assert store.get("k") == b"v"
    finally:
        del store


def test_an_address_that_is_not_this_nodes_falls_back_to_torchs_own_listening():
    port = _free_port()
    assert rendezvous._socket_at("192.0.2.1", port) is None  # TEST-NET-1: never a local address
    assert rendezvous._socket_at("no-such-host.invalid", port) is None


def test_a_taken_port_is_named_with_the_fix():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(rendezvous.RendezvousError, match=f"cannot listen on port {port}.*MASTER_PORT"):
            rendezvous._open_store(World(2, 0, 0, "srun", 1), "127.0.0.1", port,
                                   rendezvous.time.monotonic() + 5, 5)
