"""Weight sync between two network hosts: the worker in its own network namespace,
reaching the learner over a veth pair, as a worker pod reaches the learner's pod.

On one host every address is local, which hid that a worker bound its gloo pairs to the
*learner's* address (``create_device(hostname=learner)``: "Cannot resolve ... to a (local)
address" on any other host). Needs root and ``ip netns`` (iproute2); skips without them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import uuid

import pytest
import torch

from weight_sync.transport import GlooGroup

LEARNER_IP, WORKER_IP = "10.231.7.1", "10.231.7.2"


@pytest.fixture
def netns():
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and iproute2's ip for a network namespace")
    name, veth = f"rlp{uuid.uuid4().hex[:6]}", f"rv{uuid.uuid4().hex[:6]}"
    steps = [f"ip netns add {name}", f"ip link add {veth}a type veth peer name {veth}b",
             f"ip link set {veth}b netns {name}", f"ip addr add {LEARNER_IP}/24 dev {veth}a",
             f"ip link set {veth}a up", f"ip netns exec {name} ip addr add {WORKER_IP}/24 dev {veth}b",
             f"ip netns exec {name} ip link set {veth}b up", f"ip netns exec {name} ip link set lo up"]
    try:
        for step in steps:
            subprocess.run(step.split(), check=True, capture_output=True, timeout=10)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        pytest.skip(f"cannot make a network namespace here: {getattr(e, 'stderr', b'').decode().strip()}")
    yield name
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    subprocess.run(["ip", "link", "del", f"{veth}a"], capture_output=True)


WORKER = textwrap.dedent("""
    import sys, torch
    from weight_sync.transport import GlooGroup, local_address_towards
    host, port = sys.argv[1], int(sys.argv[2])
    assert local_address_towards(host) == sys.argv[3], local_address_towards(host)
    store, _ = GlooGroup.connect(host, port, 30, None)
    group = GlooGroup(store, 1, 2, host, 1, 30, 30)
    buf = torch.zeros(1000)
    group.wait(group.recv(buf, 0, 0))
    print("sum", float(buf.sum()))
""")


def test_a_worker_on_another_host_joins_the_gloo_group_and_receives(netns):
    store, port, _ = GlooGroup.listen(LEARNER_IP, 30, None)  # no token: the store on the address itself
    worker = subprocess.Popen(["ip", "netns", "exec", netns, sys.executable, "-c", WORKER, LEARNER_IP, str(port),
                               WORKER_IP], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(__file__)))
    try:
        group = GlooGroup(store, 0, 2, LEARNER_IP, 1, 30, 30)
        group.wait(group.send(torch.arange(1000, dtype=torch.float32), 1, 0))
        out, err = worker.communicate(timeout=60)
    finally:
        worker.kill()
    assert worker.returncode == 0, err[-2000:]
    assert f"sum {float(sum(range(1000)))}" in out
