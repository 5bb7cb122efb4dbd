"""Discovery: a host:port target becomes the instances it names, one per address.

A DNS name with several addresses (a compose service scaled up) names several instances; an IP
address names itself. Shared by the router (whom to call) and prefill (whom it may call).
"""

import asyncio
import ipaddress
import logging
import socket

log = logging.getLogger(__name__)


async def resolve(target: str) -> set[str]:
    """Every ip:port the target names; empty (and a warning) when its name does not resolve."""
    host, _, port = target.rpartition(":")
    host = host.strip("[]")
    if is_ip(host):
        return {target}
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(
            host, int(port), type=socket.SOCK_STREAM, family=socket.AF_INET
        )
    except OSError as exc:
        log.warning("cannot resolve %s: %s", target, exc)
        return set()
    return {join(str(info[4][0]), port) for info in infos}  # AF_INET: (host, port)


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def join(ip: str, port: str) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
