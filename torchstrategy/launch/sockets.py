"""This process's sockets, named by their inodes: to know which a process group opened, and
to break those connections when a peer stopped answering.

A collective blocked on a peer whose machine became unreachable (its link down, the
process frozen) waits for the backend's timeout: no connection closes, and torch gives no
way to interrupt it (``ProcessGroup.abort`` does not wake a gloo collective already
waiting). Shutting down the group's own sockets does: the backend sees its connections
closed, as when a peer dies, and the collective fails at once.

Linux only (``/proc/self/fd``); elsewhere no socket is ever named, and nothing is broken.
"""
from __future__ import annotations

import contextlib
import os
import socket

_FD_DIRECTORY = "/proc/self/fd"


def _socket_fds() -> dict[int, str]:
    """fd -> socket inode, for every socket this process holds now."""
    found: dict[int, str] = {}
    try:
        names = os.listdir(_FD_DIRECTORY)
    except OSError:  # not Linux (or /proc not mounted)
        return found
    for name in names:
        with contextlib.suppress(OSError):  # closed meanwhile
            target = os.readlink(f"{_FD_DIRECTORY}/{name}")
            if target.startswith("socket:["):
                found[int(name)] = target[len("socket:["):-1]
    return found


def socket_inodes() -> frozenset[str]:
    """The inodes of the sockets this process holds now (empty where /proc is missing)."""
    return frozenset(_socket_fds().values())


def _ports(fd: int) -> tuple[int, int] | None:
    """(local port, remote port; 0 for a listener) of TCP socket `fd`, None for any other
    socket or one closed meanwhile."""
    try:
        held = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        if held.family not in (socket.AF_INET, socket.AF_INET6) or \
                held.type != socket.SOCK_STREAM:
            return None
        local = held.getsockname()[1]
        try:
            remote = held.getpeername()[1]
        except OSError:  # not connected: a listener
            remote = 0
        return local, remote
    except OSError:
        return None
    finally:
        held.detach()


def opened_since(before: frozenset[str], except_port: int | None = None) -> frozenset[str]:
    """The TCP sockets of this process that are not in `before` (inodes), without those
    whose local or remote port is `except_port`: the rendezvous store's, whose server (in
    replica 0's process) and clients outlive a process group made meanwhile."""
    opened = set()
    for fd, inode in _socket_fds().items():
        if inode in before:
            continue
        ports = _ports(fd)
        if ports is not None and (except_port is None or except_port not in ports):
            opened.add(inode)
    return frozenset(opened)


def shut_down(inodes: frozenset[str]) -> int:
    """Shuts down (both directions) each connected socket of this process whose inode is in
    `inodes` (listeners are skipped) and returns how many. A socket closed since `inodes` were taken is skipped: an inode
    names one socket for as long as it exists, so a file descriptor reused by a newer
    socket is never touched. The descriptors stay open: their owner closes them."""
    count = 0
    for fd, inode in _socket_fds().items():
        if inode not in inodes:
            continue
        try:
            held = socket.socket(fileno=fd)
        except OSError:  # closed (or not a socket any more) between the listing and here
            continue
        try:
            # A listener is left alone: its owner's accept() would fail (gloo aborts the
            # process on that), and it carries no collective.
            if not held.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                held.shutdown(socket.SHUT_RDWR)
                count += 1
        except OSError:  # not connected, or already shut down
            pass
        finally:
            held.detach()   # the fd stays its owner's
    return count
