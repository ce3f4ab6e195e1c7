"""`pdmctl doctor --job`'s all-reduce: the transport NCCL chose, read from its own log (lines in the forms NCCL
writes them, as its source formats them: nothing here has an NVIDIA GPU), NCCL's bus bandwidth, a socket
fallback on a profile that names InfiniBand failing in one line, and one rank a GPU, each a process of its own
(run here over gloo on the CPU)."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from pdmctl import doctor
from pdmctl.doctor import allreduce, nodes

# two nodes of 8 GPUs over InfiniBand, NCCL 2.21 (NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,NET, to a file): rank 0's
IB_LOG = """\
n1:20714:20714 [0] NCCL INFO Bootstrap : Using ib0:10.78.0.11<0>
n1:20714:20714 [0] NCCL INFO NET/Plugin: No plugin found (libnccl-net.so)
n1:20714:20714 [0] NCCL INFO NET/Plugin: Plugin load returned 2 : libnccl-net.so: cannot open shared object file: No such file or directory : when loading libnccl-net.so
n1:20714:20714 [0] NCCL INFO NET/Plugin: Using internal network plugin.
n1:20714:20714 [0] NCCL INFO cudaDriverVersion 12080
n1:20714:20714 [0] NCCL INFO NCCL version 2.21.5+cuda12.4
n1:20714:20781 [0] NCCL INFO NCCL_IB_HCA set to mlx5_0,mlx5_1
n1:20714:20781 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB [RO]; OOB ib0:10.78.0.11<0>
n1:20714:20781 [0] NCCL INFO Using non-device net plugin version 0
n1:20714:20781 [0] NCCL INFO Using network IB
n1:20714:20781 [0] NCCL INFO comm 0x5581e3a0c2d0 rank 0 nranks 16 cudaDev 0 nvmlDev 0 busId 18000 commId 0x6c2f8b1e0a4d9e37 - Init START
n1:20714:20781 [0] NCCL INFO Channel 00/32 :    0   1   2   3   4   5   6   7   8   9  10  11  12  13  14  15
n1:20714:20781 [0] NCCL INFO Channel 00/0 : 15[7] -> 0[0] [receive] via NET/IB/0/GDRDMA
n1:20714:20781 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
n1:20714:20781 [0] NCCL INFO Channel 01/0 : 0[0] -> 8[0] [send] via NET/IB/1(0)/GDRDMA
n1:20714:20781 [0] NCCL INFO Connected all rings
n1:20714:20781 [0] NCCL INFO comm 0x5581e3a0c2d0 rank 0 nranks 16 cudaDev 0 nvmlDev 0 busId 18000 commId 0x6c2f8b1e0a4d9e37 - Init COMPLETE
"""
# the same job where the container does not see the RDMA devices: NCCL goes over TCP on ib0 (IPoIB)
SOCKET_LOG = """\
n1:20714:20781 [0] NCCL INFO NCCL_IB_HCA set to mlx5_0,mlx5_1
n1:20714:20781 [0] NCCL INFO NET/IB : No device found.
n1:20714:20781 [0] NCCL INFO NET/Socket : Using [0]ib0:10.78.0.11<0>
n1:20714:20781 [0] NCCL INFO Using network Socket
n1:20714:20781 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC
n1:20714:20781 [0] NCCL INFO Channel 00/0 : 15[7] -> 0[0] [receive] via NET/Socket/0
n1:20714:20781 [0] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/Socket/0
"""
# an older NCCL without libibverbs in the image (its WARN names the file), then sockets
NO_VERBS_LOG = """\
n2:3310:3362 [1] misc/ibvwrap.cc:106 NCCL WARN Failed to open libibverbs.so[.1]
n2:3310:3362 [1] NCCL INFO NET/Socket : Using [0]eth0:10.77.0.12<0>
n2:3310:3362 [1] NCCL INFO Using network Socket
n2:3310:3362 [1] NCCL INFO Channel 00 : 9[1b000] -> 10[3d000] via P2P/IPC
n2:3310:3362 [1] NCCL INFO Channel 00 : 9[1b000] -> 1[1b000] [send] via NET/Socket/0
"""
# AWS EFA through aws-ofi-nccl (a network plugin: its name, with a blank), and a node's SHM
EFA_LOG = """\
ip-10-0-1-5:901:950 [0] NCCL INFO NET/OFI Selected Provider is efa (found 4 nics)
ip-10-0-1-5:901:950 [0] NCCL INFO Using network AWS Libfabric
ip-10-0-1-5:901:950 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via SHM/direct/direct
ip-10-0-1-5:901:950 [0] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/AWS Libfabric/0/GDRDMA/Shared
"""


def test_the_transport_nccl_chose_is_read_from_its_log_lines() -> None:
    """Between the nodes: each channel's `via NET/...` (GPUDirect RDMA shown, PXN's proxy rank and the device
    index dropped); within a node: `via P2P/...`, `via SHM/...`; the network from `Using network`."""
    ib = allreduce.parse_transport(IB_LOG)
    assert ib == allreduce.Transport("IB", ("NET/IB (GDRDMA)",), ("P2P/CUMEM",))
    assert ib.describe() == "transport NET/IB (GDRDMA) between nodes, P2P/CUMEM within a node (NCCL's log)"
    assert not ib.socket_fallback
    sock = allreduce.parse_transport(SOCKET_LOG)
    assert sock == allreduce.Transport("Socket", ("NET/Socket",), ("P2P/IPC",), "NET/IB : No device found.")
    assert sock.socket_fallback
    verbs = allreduce.parse_transport(NO_VERBS_LOG)
    assert verbs.socket_fallback and verbs.ib_note == "Failed to open libibverbs.so[.1]"
    efa = allreduce.parse_transport(EFA_LOG)
    assert efa == allreduce.Transport("AWS Libfabric", ("NET/AWS Libfabric (GDRDMA)",), ("SHM",))
    one_node = allreduce.parse_transport("n1:1:2 [0] NCCL INFO Using network Socket\n"
                                         "n1:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM\n")  # fmt: skip
    assert one_node.describe() == "transport network Socket, P2P/CUMEM within a node (NCCL's log)"
    assert allreduce.parse_transport("").describe() == "transport not in NCCL's log (no network or channel line)"


def test_a_socket_fallback_fails_only_where_the_profile_names_infiniband() -> None:
    """NCCL_IB_HCA set, or an ib* interface (network_interface, NCCL_SOCKET_IFNAME), names InfiniBand unless
    NCCL_IB_DISABLE turns it off; there NET/Socket between the nodes is a failure that quotes NCCL's reason."""
    assert allreduce.names_infiniband({"NCCL_IB_HCA": "mlx5_0,mlx5_1"}, None) == "NCCL_IB_HCA=mlx5_0,mlx5_1"
    assert allreduce.names_infiniband({}, "ib0") == "network_interface ib0"
    assert allreduce.names_infiniband({"NCCL_SOCKET_IFNAME": "=ib0"}, "eth0") == "NCCL_SOCKET_IFNAME==ib0"
    assert allreduce.names_infiniband({"NCCL_SOCKET_IFNAME": "^ib"}, "eth0") is None
    assert allreduce.names_infiniband({"NCCL_IB_HCA": "mlx5_0", "NCCL_IB_DISABLE": "1"}, "ib0") is None
    sock, ib = allreduce.parse_transport(SOCKET_LOG), allreduce.parse_transport(IB_LOG)
    assert allreduce.check_transport(sock, None) is None  # an Ethernet cluster: sockets are its network
    assert allreduce.check_transport(ib, "NCCL_IB_HCA=mlx5_0") is None
    assert allreduce.check_transport(sock, "NCCL_IB_HCA=mlx5_0") == (
        "NCCL fell back to sockets (NET/Socket) between the nodes though the profile names InfiniBand "
        "(NCCL_IB_HCA=mlx5_0) (NCCL: NET/IB : No device found.): the job must see the RDMA devices "
        "(/dev/infiniband, libibverbs) and NCCL_IB_HCA name them")


def test_bus_bandwidth_is_nccls_definition() -> None:
    """busbw = size / time x 2(n-1)/n (nccl-tests): 64 MiB in 1 ms over 16 ranks; one rank moves nothing."""
    assert allreduce.bus_bandwidth(64 << 20, 1e-3, 16) == pytest.approx((64 << 20) / 1e-3 * 30 / 16)
    assert allreduce.bus_bandwidth(4 << 20, 0.01, 2) == pytest.approx((4 << 20) / 0.01)
    assert allreduce.bus_bandwidth(4 << 20, 0.01, 1) == 0.0


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_each_local_rank_is_a_process_of_its_own_and_a_failed_ones_words_are_raised() -> None:
    """A node's ranks (one a GPU on a GPU node) start as processes of their own and sum across the job: two
    here over gloo, the sum 2. Ranks that wait for a node that never comes end at the rendezvous's timeout,
    raising the backend's words, their processes gone."""
    got, transport = allreduce.run_local_ranks("gloo", 0, 1, 2, "127.0.0.1", _port(), 60, size=1 << 20,
                                               iterations=(1, 2))  # fmt: skip
    assert got.low == got.high == 2 and got.seconds > 0 and transport is None
    with pytest.raises(RuntimeError, match=r"(?i)time(d )?out"):
        allreduce.run_local_ranks("gloo", 0, 2, 1, "127.0.0.1", _port(), 2, size=1 << 20, iterations=(1, 1))


def _gpu_profile(tmp_path: Path, **changes: object):
    from pdmctl import orchestrate
    from tests.test_doctor import _filled_h20

    ctx = orchestrate.make_context(str(_filled_h20(tmp_path, **changes)))
    return doctor.Doctor(ctx.profile, ctx.tracking_uri)


def test_a_socket_fallback_on_an_infiniband_profile_fails_the_all_reduce_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """An 8-GPU profile whose network: names InfiniBand (NCCL_IB_HCA) where NCCL's log shows sockets between
    the nodes: the all-reduce line is a FAIL that gives the reason and still the bandwidth measured; with
    NET/IB it passes, showing the bus bandwidth over all 8 ranks and the transport."""
    import torch

    checker = _gpu_profile(tmp_path, network={"NCCL_IB_HCA": "mlx5_0", "NCCL_SOCKET_IFNAME": "lo"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    calls: list[tuple] = []

    def ranks(log: str):
        def run(*args, **kwargs):
            calls.append(args)
            return allreduce.Measured(8.0, 8.0, 2e-3), allreduce.parse_transport(log)

        return run

    for log, ok in ((SOCKET_LOG, False), (IB_LOG, True)):
        monkeypatch.setattr(allreduce, "run_local_ranks", ranks(log))
        node = nodes.NodesDoctor(checker, nodes.Task(0, 1, "n1", "1.0"))
        node._first = {"address": "127.0.0.1", "port": _port(), "ranks_port": 29999}
        lines: list[str] = []
        try:
            assert doctor.run_lines([("all-reduce", node.all_reduce)], [], lines.append, {}) is ok
        finally:
            node.close()
        assert len(lines) == 1, lines
        if not ok:
            assert lines[0].startswith("FAIL  all-reduce: nccl across 1 node(s) x 8 GPU(s) over lo: NCCL fell back to "
                                       "sockets (NET/Socket) between the nodes though the profile names InfiniBand "
                                       "(NCCL_IB_HCA=mlx5_0) (NCCL: NET/IB : No device found.)"), lines  # fmt: skip
            assert "; 64 MiB in 2.0 ms: bus bandwidth 58.7 GB/s" in lines[0], lines
        else:
            assert lines[0] == ("ok    all-reduce: nccl across 1 node(s) x 8 GPU(s) over lo: the sum came back 8; 64 MiB "
                                "in 2.0 ms: bus bandwidth 58.7 GB/s, algorithm bandwidth 33.6 GB/s (8 rank(s), 8 a "
                                "node; transport NET/IB (GDRDMA) between nodes, P2P/CUMEM within a node (NCCL's "
                                "log))")  # fmt: skip
    assert calls == [("nccl", 0, 1, 8, "127.0.0.1", 29999, 300.0)] * 2  # 8 local ranks, at the second port


def test_without_gpus_one_rank_a_node_measures_over_gloo(tmp_path: Path) -> None:
    """A profile without GPUs: the all-reduce runs in the node's own gloo group, one rank a node, and its line
    shows the sum and the bandwidth (one node here: the bus moves nothing)."""
    checker = _gpu_profile(tmp_path, gpus_per_node=0, network={"GLOO_SOCKET_IFNAME": "lo"})
    node = nodes.NodesDoctor(checker, nodes.Task(0, 1, "n1", "1.0"))
    node._first = {"address": "127.0.0.1", "port": _port(), "ranks_port": _port()}
    try:
        line = node.all_reduce()
    finally:
        node.close()
    assert re.fullmatch(r"gloo across 1 node\(s\) over lo: the sum came back 1; 4 MiB in \d+\.\d ms: bus bandwidth "
                        r"0 B/s, algorithm bandwidth \d+(\.\d)? [KMGT]?B/s \(1 rank\(s\), one a node; gloo over TCP\)",
                        line), line  # fmt: skip


# one node of 8 GPUs (NCCL_DEBUG=INFO): the channels between its GPUs, no network between nodes
ONE_NODE_LOG = """\
n1:20714:20781 [0] NCCL INFO comm 0x5581e3a0c2d0 rank 0 nranks 8 cudaDev 0 nvmlDev 0 busId 18000 commId 0x1 - Init START
n1:20714:20781 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
n1:20714:20781 [0] NCCL INFO Connected all rings
"""


def test_a_one_node_job_sums_across_its_own_processes_and_shows_the_bandwidth(tmp_path: Path) -> None:
    """A job of one node has no node to sum with: its all-reduce runs across the node itself, here (no GPU)
    two processes over gloo on the loopback, the sum right and the bandwidth shown."""
    checker = _gpu_profile(tmp_path, gpus_per_node=0)
    line = nodes.one_node_all_reduce(checker, "n1")
    assert re.fullmatch(r"gloo on n1, 2 process\(es\): the sum came back 2; 4 MiB in \d+\.\d ms: bus bandwidth "
                        r"\d+(\.\d)? [KMGT]?B/s, algorithm bandwidth \d+(\.\d)? [KMGT]?B/s \(2 rank\(s\), gloo over "
                        r"TCP on the loopback\)", line), line  # fmt: skip


def test_a_one_node_job_of_gpus_runs_a_rank_a_gpu_and_reads_the_transport_within_the_node(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """On a GPU node the one-node all-reduce runs a rank on each of the profile's GPUs (over NCCL, its
    rendezvous on the loopback) and names the transport NCCL's log shows within the node; fewer GPUs than
    the profile gives fail in one line before anything starts."""
    import torch

    checker = _gpu_profile(tmp_path)  # 8 GPUs a node
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    calls: list[tuple] = []

    def run(*args, **kwargs):
        calls.append(args[:5])
        return allreduce.Measured(8.0, 8.0, 2e-3), allreduce.parse_transport(ONE_NODE_LOG)

    monkeypatch.setattr(allreduce, "run_local_ranks", run)
    assert nodes.one_node_all_reduce(checker, "n1") == (
        "nccl on n1, 8 GPU(s): the sum came back 8; 64 MiB in 2.0 ms: bus bandwidth 58.7 GB/s, algorithm bandwidth "
        "33.6 GB/s (8 rank(s), one a GPU; transport P2P/CUMEM within a node (NCCL's log))")  # fmt: skip
    assert calls == [("nccl", 0, 1, 8, "127.0.0.1")]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 6)
    lines: list[str] = []
    assert not doctor.run_lines([("all-reduce", lambda: nodes.one_node_all_reduce(checker, "n1"))], [], lines.append, {})
    assert lines == ["FAIL  all-reduce: torch sees 6 GPU(s) on n1, the profile gives 8 (gpus_per_node)"]
