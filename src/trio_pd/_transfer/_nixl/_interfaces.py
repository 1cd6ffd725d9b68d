"""Waiting for the network interface that holds an address to be up (Linux, IPv4).

NIXL's UCX backend puts into an agent's metadata the network interfaces that
are up when the agent is created, and never adds one that comes up later. A
producer started while its link was down (the soak found it: a test host's
link cut during a restart) therefore advertised loopback only, and stayed
unreachable for its life once the link was back. ``open_connector`` calls
:func:`wait_for_interface` with the advertised address before it creates
the agent (``ConnectorConfig.interface_timeout``); :func:`interface_state`
is the check (no I/O but two ``ioctl`` calls per interface).
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import socket
import struct
import sys

import trio

from trio_pd._config import ConnectorConfig

logger = logging.getLogger("trio_pd")

POLL = 0.1
"""How often :func:`wait_for_interface` checks again, in seconds."""

_SIOCGIFFLAGS = 0x8913
_SIOCGIFADDR = 0x8915
_IFF_UP = 0x1
_IFF_RUNNING = 0x40


def interface_state(address: str) -> tuple[str, bool] | None:
    """``(name, up)`` of the interface that holds IPv4 ``address`` here, where
    up means administratively up and with a carrier; ``None`` when there is
    nothing to check (not Linux, not an IPv4 address, loopback, or no local
    interface holds it: an address behind NAT, say).

    Only each interface's primary IPv4 address is seen (the ioctl interface).
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        wanted = ipaddress.ip_address(address)
    except ValueError:
        return None
    if wanted.version != 4 or wanted.is_loopback:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue  # (no IPv4 address)
            if socket.inet_ntoa(answer[20:24]) != str(wanted):
                continue
            flags = struct.unpack("H", fcntl.ioctl(probe.fileno(), _SIOCGIFFLAGS, request)[16:18])
            up = flags[0] & (_IFF_UP | _IFF_RUNNING) == _IFF_UP | _IFF_RUNNING
            return name, bool(up)
    return None


def _down(address: str) -> bool:
    state = interface_state(address)
    return state is not None and not state[1]


async def wait_for_interface(engine_id: str, address: str, config: ConnectorConfig) -> None:
    """Return once the interface that holds ``address`` is up (at once when it
    is, or when there is nothing to check: see :func:`interface_state`).

    Raises:
        OSError: it stayed down for ``config.interface_timeout`` seconds; the
            message names the engine, the interface and the address.
    """
    timeout = config.interface_timeout
    state = interface_state(address)
    if state is None or state[1]:
        await trio.lowlevel.checkpoint()
        return
    name = state[0]
    logger.warning(
        "engine %s: interface %s, which holds the advertised address %s, is down: waiting "
        "up to %g s for it before creating the NIXL agent (NIXL advertises only the "
        "interfaces up at that moment)",
        engine_id,
        name,
        address,
        timeout,
    )
    with trio.move_on_after(timeout):
        while _down(address):  # noqa: ASYNC110 -- nothing to wait on: the kernel's state
            await trio.sleep(POLL)
        logger.info("engine %s: interface %s is up", engine_id, name)
        return
    raise OSError(
        f"engine {engine_id!r}: interface {name}, which holds the advertised address "
        f"{address}, stayed down for {timeout:g} s (interface_timeout); a NIXL agent "
        "created now would advertise no route to this engine"
    )
