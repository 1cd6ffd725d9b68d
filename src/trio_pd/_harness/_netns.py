"""Test hosts: network namespaces joined to this host by veth links (Linux, root).

:func:`open_test_hosts` makes ``count`` namespaces. Host ``i`` is joined to
the root namespace by a veth pair; the root side has ``198.18.i.1/24``, the
host side ``198.18.i.2/24`` (RFC 2544's benchmarking range: private, and
nothing is routed off the machine). A prefill engine runs inside a host with
``open_prefill_worker(spec, netns=host.netns)``; traffic between it and the
root namespace crosses the link, whose rate can be limited (``tc tbf``), and
which can be cut and restored (a partition).

With ``routed=True`` the hosts also reach each other through the root
namespace (a decode engine on one host pulls from a prefill engine on
another): each host routes ``198.18.0.0/16`` via its link's root end, and
forwarding is enabled on the links' root ends only (their per-interface
``forwarding`` flag). The machine's global ``ip_forward`` and its other
interfaces are left alone, the hosts get no default route, the root namespace
gets an ``unreachable`` route for ``198.18.0.0/16`` (so a packet for an
address no host has dies here instead of leaving by the default route), and
the flags go with the links: nothing is routed off the machine, and nothing
stays changed (the fence route is deleted on exit).

Everything made is deleted on every exit path (the namespaces, which takes
their veth ends with them, then any root end left). The addresses are fixed,
so only one set of test hosts may exist on a machine at a time (names carry
the process id; a second set in the same process is refused).

UCX caches the routing table per process: a process must create its first
NIXL agent after the links exist to use them (run the decoder in its own
process, or create the hosts before any agent).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import trio

HOSTS_NETWORK = "198.18.0.0/16"
"""Every test host's address is in it (host ``i``: ``198.18.i.0/24``)."""

_open = False
"""Whether this process has test hosts open now."""


class TestHostsUnavailable(RuntimeError):
    """Test hosts need root, ``ip`` and network namespaces; the message says what is missing."""

    __test__ = False  # not a pytest test class


@attrs.frozen
class TestHost:
    """One test host: a network namespace and its link to the root namespace.

    Attributes:
        netns: the namespace's name (``ip netns exec <netns> ...``).
        address: the host's address, on its end of the link.
        root_address: the root namespace's address on the same link.
        link: the root end's interface name (its counters, its qdisc).
        peer: the host end's interface name, inside the namespace.
        routed: it reaches the other test hosts through the root namespace.
    """

    __test__ = False  # not a pytest test class

    netns: str
    address: str
    root_address: str
    link: str
    peer: str
    routed: bool = False

    def link_bytes(self) -> int:
        """Bytes the link's root end sent and received so far."""
        stats = Path("/sys/class/net") / self.link / "statistics"
        return sum(int((stats / name).read_text()) for name in ("rx_bytes", "tx_bytes"))

    async def limit_rate(self, rate: str, *, burst: str = "64kb") -> None:
        """Limit the link to ``rate`` (``tc`` syntax, e.g. ``"200mbit"``) both ways."""
        for prefix in ([], ["ip", "netns", "exec", self.netns]):
            dev = self.link if not prefix else self.peer
            await _run(
                *prefix, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                "rate", rate, "burst", burst, "latency", "400ms",
            )  # fmt: skip

    async def cut(self) -> None:
        """Partition the host: packets to it vanish silently until :meth:`restore`.

        The host's end of the link goes down. The root end keeps its route
        and a permanent neighbour entry for the host, so traffic to the host
        is dropped on the link (as a partition drops it) instead of failing
        fast, or -- with the route gone -- following the default route off
        the machine. Inside the host, the link's routes go with it: what the
        host sends fails at once (network unreachable).
        """
        await _run("ip", "-n", self.netns, "link", "set", self.peer, "down")

    async def restore(self) -> None:
        """Bring the host's end of the link back up after :meth:`cut`."""
        await _run("ip", "-n", self.netns, "link", "set", self.peer, "up")
        if self.routed:  # (the route to the other hosts went with the link)
            await _route_to_hosts(self)


async def _output(*command: str) -> str:
    result = await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False)
    if result.returncode:
        raise RuntimeError(f"{' '.join(command)}: {result.stderr.decode().strip()}")
    return result.stdout.decode()


async def _run(*command: str) -> None:
    result = await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False)
    if result.returncode:
        raise RuntimeError(f"{' '.join(command)}: {result.stderr.decode().strip()}")


def _check_available() -> None:
    if os.geteuid() != 0:
        raise TestHostsUnavailable("test hosts need root (network namespaces and veth links)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise TestHostsUnavailable(f"test hosts need {tool!r} (Debian: iproute2)")


@asynccontextmanager
async def open_test_hosts(count: int, *, routed: bool = False) -> AsyncIterator[list[TestHost]]:
    """``count`` test hosts for the block's duration (see the module docstring);
    ``routed``: they reach each other too, through the root namespace.

    Raises:
        TestHostsUnavailable: not root, or ``ip``/``tc`` missing, or the
            kernel refused to create a namespace or link.
    """
    if not 1 <= count <= 255:
        raise ValueError(f"between 1 and 255 test hosts (198.18.i.0/24 each), not {count}")
    _check_available()
    global _open
    if _open:
        raise RuntimeError(
            "test hosts are already open in this process (their addresses are fixed)"
        )
    tag = f"tpd{os.getpid() % 100000}"
    hosts: list[TestHost] = []
    made: list[TestHost] = []
    fenced = False
    try:
        if routed:
            # The hosts route all of 198.18.0.0/16 here, and the links' root ends
            # forward: what is not a host's must die here, not leave by the
            # default route (the hosts' own /24s are more specific and win).
            fenced = await _try("ip", "route", "add", "unreachable", HOSTS_NETWORK)
        for i in range(count):
            host = TestHost(
                netns=f"{tag}h{i}",
                address=f"198.18.{i}.2",
                root_address=f"198.18.{i}.1",
                link=f"{tag}r{i}",
                peer=f"{tag}n{i}",
                routed=routed,
            )
            made.append(host)
            try:
                await _make(host)
            except RuntimeError as exc:
                raise TestHostsUnavailable(f"could not create test host {i}: {exc}") from exc
            hosts.append(host)
        _open = True
        yield hosts
    finally:
        _open = False
        with trio.CancelScope(shield=True):
            await _remove(made)
            if fenced:
                await _try("ip", "route", "del", "unreachable", HOSTS_NETWORK)


async def _make(host: TestHost) -> None:
    netns = ["ip", "-n", host.netns]
    await _run("ip", "netns", "add", host.netns)
    await _run("ip", "link", "add", host.link, "type", "veth", "peer", "name", host.peer)
    await _run("ip", "link", "set", host.peer, "netns", host.netns)
    await _run("ip", "addr", "add", f"{host.root_address}/24", "dev", host.link)
    await _run("ip", "link", "set", host.link, "up")
    await _run(*netns, "addr", "add", f"{host.address}/24", "dev", host.peer)
    await _run(*netns, "link", "set", host.peer, "up")
    await _run(*netns, "link", "set", "lo", "up")
    # Permanent neighbour entries: a cut (the host's end down) then drops
    # packets silently, with no ARP failure, and nothing is routed elsewhere.
    peer_mac = (await _output(*netns, "-br", "link", "show", host.peer)).split()[2]
    root_mac = (await _output("ip", "-br", "link", "show", host.link)).split()[2]
    await _run("ip", "neigh", "replace", host.address, "lladdr", peer_mac, "dev", host.link,
               "nud", "permanent")  # fmt: skip
    await _run(*netns, "neigh", "replace", host.root_address, "lladdr", root_mac, "dev",
               host.peer, "nud", "permanent")  # fmt: skip
    if host.routed:
        forwarding = Path("/proc/sys/net/ipv4/conf") / host.link / "forwarding"
        await trio.Path(forwarding).write_text("1\n")
        await _route_to_hosts(host)


async def _route_to_hosts(host: TestHost) -> None:
    """Route the test hosts' network via the link's root end (the kernel drops
    the route whenever the host's end goes down: :meth:`TestHost.cut`)."""
    await _run("ip", "-n", host.netns, "route", "replace", HOSTS_NETWORK, "via", host.root_address)


async def _try(*command: str) -> bool:
    """Run ``command``; whether it succeeded (never raises)."""
    result = await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False)
    return result.returncode == 0


async def _remove(hosts: Sequence[TestHost]) -> None:
    """Delete what :func:`_make` made, whatever of it exists; never raises."""
    for host in hosts:
        for command in (
            ("ip", "netns", "del", host.netns),
            ("ip", "link", "del", host.link),
        ):
            await _try(*command)
