"""The server's port: held from the start-up check until uvicorn binds it (`reserve_address`),
and with several front-end processes a listening socket for each (`listening_sockets`). A port
that cannot be had is a ConfigError that says to pick another --port."""

import socket
import sys

from nanovllm.core.errors import ConfigError


def reserve_address(host: str, port: int) -> list[socket.socket]:
    """Bind every address of `host` at `port` (as uvicorn binds them), without listening, and
    return the sockets: a busy port is a ConfigError before a model loads for minutes, and
    while the engine starts nothing else is handed the port (a tensor-parallel rendezvous
    asks the OS for a free one, which could otherwise be this one, free until uvicorn binds
    it). `release` them just before uvicorn binds."""
    try:
        addresses = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as e:
        raise ConfigError(f"cannot resolve --host {host!r}: {e.strerror}") from None
    held: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in addresses:
            held.append(_bind(family, kind, proto, address, host, port))
    except BaseException:
        release(held)
        raise
    return held


def _bind(family, kind, proto, address, host: str, port: int) -> socket.socket:
    # without SO_REUSEADDR first: no other socket, even one that sets it, may then share the
    # port; with it (as uvicorn binds) where the first fails, e.g. over TIME_WAIT connections
    # a previous server left
    for reuse in (False, True):
        sock = socket.socket(family, kind, proto)
        if reuse:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            sock.bind(address)
            return sock
        except OSError as e:
            sock.close()
            error = e
    raise _cannot_listen(host, port, error)


def release(held: list[socket.socket]) -> None:
    while held:
        held.pop().close()


def listening_sockets(host: str, port: int, n: int) -> list[socket.socket]:
    """A bound socket for each of `n` front ends. On Linux each has its own, all on one port
    with SO_REUSEPORT, and the kernel spreads new connections over them evenly (by address
    hash). One shared socket, used elsewhere, lets whichever process wakes first take the
    queue (asyncio accepts up to 100 connections a wakeup), which a burst of connections
    then leaves to one process. A port taken since reserve_address released it is a
    ConfigError."""
    own = n > 1 and sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn binds
    socks: list[socket.socket] = []
    try:
        for _ in range(n if own else 1):
            sock = socket.socket(family, socket.SOCK_STREAM)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if own:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            try:
                sock.bind((host, port))
            except OSError as e:
                raise _cannot_listen(host, port, e) from None
            port = sock.getsockname()[1]  # port 0: the others join the port it got
            sock.set_inheritable(True)
    except BaseException:
        release(socks)
        raise
    return socks if own else socks * n


def _cannot_listen(host: str, port: int, e: OSError) -> ConfigError:
    return ConfigError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port")
