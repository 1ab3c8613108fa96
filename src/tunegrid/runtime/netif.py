"""Which network interface holds an address: a rank on a node of a multi-node cell binds its collectives (gloo,
NCCL's bootstrap) to the interface of its node's address, not to whatever its host name resolves to (often a
loopback address in /etc/hosts, which peers on other nodes cannot reach). Linux only; standard library only.
"""

from __future__ import annotations

import fcntl
import socket
import struct
from collections.abc import MutableMapping

SIOCGIFADDR = 0x8915
NODE_ADDR_ENV = "TUNEGRID_NODE_ADDR"  # the address of the node a rank runs on (set by tunegrid.run.nodes)
SOCKET_IFNAME_ENVS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def interface_address(name: str) -> str | None:
    """The IPv4 address of interface `name`, None where it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_of(address: str) -> str | None:
    """The name of this host's interface that holds `address` (IPv4), None where none does."""
    for _, name in socket.if_nameindex():
        if interface_address(name) == address:
            return name
    return None


def pin_interface(environ: MutableMapping[str, str]) -> str | None:
    """Where the node's address is given (NODE_ADDR_ENV) and no socket interface is named, name the interface that
    holds it for gloo and NCCL (in `environ`, before the process group starts); returns the name set, if any."""
    address = environ.get(NODE_ADDR_ENV)
    if not address or any(environ.get(name) for name in SOCKET_IFNAME_ENVS):
        return None
    name = interface_of(address)
    if name is not None:
        for variable in SOCKET_IFNAME_ENVS:
            environ[variable] = name
    return name
