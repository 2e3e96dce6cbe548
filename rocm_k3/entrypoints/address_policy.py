"""Which IP addresses the server may connect to when it fetches a remote image (SSRF guard).

An address is *public* when it is globally routable unicast. Every other address has a reason:

- ``unspecified`` (0.0.0.0, ::), ``multicast`` and ``reserved`` (240.0.0.0/4, 255.255.255.255, IPv6 reserved
  ranges) are always refused;
- ``loopback``, ``link-local`` (169.254/16 with the cloud metadata address, fe80::/10), ``private`` (10/8,
  172.16/12, 192.168/16, fc00::/7, ...) and ``non-global`` (100.64/10, documentation ranges, ...) are
  refused unless ``allow_private`` (the server's ``--allow-private-image-hosts``).

IPv6 addresses that carry an IPv4 address (IPv4-mapped ``::ffff:a.b.c.d``, 6to4, Teredo, NAT64 ``64:ff9b::/96``)
are judged by the IPv4 address inside as well, so ``::ffff:127.0.0.1`` is loopback. The check is made on the
address the fetcher actually connects to (it resolves a host once and connects to that address), never on a name.
"""

from __future__ import annotations

import dataclasses
import ipaddress

ALWAYS_REFUSED = ("unspecified", "multicast", "reserved")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def address_kind(addr: IPAddress) -> str | None:
    """Why ``addr`` is not a public unicast address (one of the module docstring's reasons), or None."""
    if addr.is_unspecified:
        return "unspecified"
    if addr.is_multicast:
        return "multicast"
    if addr.is_loopback:
        return "loopback"
    if addr.is_link_local:
        return "link-local"
    if addr.is_reserved:
        return "reserved"
    if addr.is_private:
        return "private"
    if not addr.is_global:
        return "non-global"
    return None


def embedded_ipv4(addr: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries (IPv4-mapped, 6to4, Teredo client, NAT64), else None."""
    if isinstance(addr, ipaddress.IPv4Address):
        return None
    if addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    if addr.sixtofour is not None:
        return addr.sixtofour
    if addr.teredo is not None:
        return addr.teredo[1]
    if addr in _NAT64:
        return ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF)
    return None


@dataclasses.dataclass(frozen=True)
class AddressPolicy:
    """``refusal(ip)``: None when the fetcher may connect to ``ip``, else a sentence saying why not."""

    allow_private: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.allow_private, bool):
            raise ValueError(f"allow_private: expected a bool, got {self.allow_private!r}")

    def refusal(self, ip: str) -> str | None:
        try:
            addr = ipaddress.ip_address(ip.split("%", 1)[0])  # drop an IPv6 zone id (fe80::1%eth0)
        except ValueError:
            return f"{ip!r} is not an IP address"
        inner = embedded_ipv4(addr)
        # an IPv4-mapped or NAT64 address reaches the IPv4 address itself; 6to4 and Teredo are judged on both
        stands_for_ipv4 = addr.version == 6 and (addr.ipv4_mapped is not None or addr in _NAT64)
        candidates = [inner] if stands_for_ipv4 else [addr, inner]
        for candidate in candidates:
            kind = address_kind(candidate) if candidate is not None else None
            if kind is None or (self.allow_private and kind not in ALWAYS_REFUSED):
                continue
            article = "an" if kind[0] in "aeiou" else "a"
            carried = f" (it carries the IPv4 address {inner})" if candidate is inner else ""
            hint = "" if kind in ALWAYS_REFUSED else " (--allow-private-image-hosts allows it)"
            return f"{ip} is {article} {kind} address{carried}{hint}"
        return None
