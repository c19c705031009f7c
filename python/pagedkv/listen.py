"""Listening sockets bound where they are configured, and nowhere else.

torch's ``TCPStore`` listens on every interface whatever host it is given; handing it a socket
made here (``master_listen_fd=``) keeps a store on the configured host (a loopback store is
reachable from this machine only). Used by the tensor-parallel group and the gloo KV transport.
"""

from __future__ import annotations

import socket

from pagedkv.errors import ConfigError

__all__ = ["listening_socket"]


def listening_socket(host: str, port: int, what: str) -> socket.socket:
    """A TCP socket listening on ``host:port`` only (port 0: the kernel picks one; read it with
    ``getsockname()``). ``ConfigError`` naming ``what`` when the host does not resolve or the
    address cannot be bound."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise ConfigError(f"{what}: cannot resolve {host}:{port}: {e}") from e
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise ConfigError(f"{what}: cannot listen on {host}:{port}: {e}") from e
    return sock
