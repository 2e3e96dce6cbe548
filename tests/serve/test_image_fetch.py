"""The remote image fetcher (``--allow-remote-images``) against a hostile image host on 127.0.0.1: the address
policy (loopback, private, link-local, unspecified, multicast, reserved, IPv4-mapped IPv6 refused unless allowed),
one deadline per request over all of its images, streamed size limits with and without Content-Length, redirect
limits with every hop re-checked, and a pool whose threads come back at the deadline."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
import time

import pytest

from rocm_k3.entrypoints.address_policy import AddressPolicy
from rocm_k3.entrypoints.image_fetch import FetchLimits, ImageFetcher, ImageFetchError
from tests.image_hosts import image_host, wait_until

BODY = b"\x89PNG fake image bytes " * 10
LIMIT = 256 * 1024

REFUSED = [  # (address, reason named in the refusal, refused even with allow_private)
    ("127.0.0.1", "loopback", False),
    ("127.1.2.3", "loopback", False),
    ("10.1.2.3", "private", False),
    ("172.16.0.1", "private", False),
    ("192.168.1.1", "private", False),
    ("169.254.169.254", "link-local", False),  # the cloud metadata address
    ("100.64.0.1", "non-global", False),  # carrier-grade NAT
    ("::1", "loopback", False),
    ("fe80::1", "link-local", False),
    ("fe80::1%lo", "link-local", False),
    ("fc00::1", "private", False),
    ("::ffff:127.0.0.1", "loopback", False),  # IPv4-mapped IPv6
    ("::ffff:10.0.0.1", "private", False),
    ("::ffff:169.254.169.254", "link-local", False),
    ("2002:7f00:1::", "loopback", False),  # 6to4 around 127.0.0.1
    ("64:ff9b::a9fe:a9fe", "link-local", False),  # NAT64 around 169.254.169.254
    ("0.0.0.0", "unspecified", True),
    ("::", "unspecified", True),
    ("::ffff:0.0.0.0", "unspecified", True),
    ("224.0.0.1", "multicast", True),
    ("ff02::1", "multicast", True),
    ("240.0.0.1", "reserved", True),
    ("255.255.255.255", "reserved", True),
]
PUBLIC = ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808"]


@pytest.mark.parametrize("address, reason, always", REFUSED, ids=[a for a, _, _ in REFUSED])
def test_address_policy_refuses_non_public_addresses(address: str, reason: str, always: bool) -> None:
    refusal = AddressPolicy().refusal(address)
    assert refusal is not None and f"{reason} address" in refusal and address in refusal
    allowed = AddressPolicy(allow_private=True).refusal(address)
    assert (allowed is not None) == always, allowed
    if not always:
        assert "--allow-private-image-hosts" in refusal


@pytest.mark.parametrize("address", PUBLIC)
def test_address_policy_takes_public_addresses(address: str) -> None:
    assert AddressPolicy().refusal(address) is None
    assert AddressPolicy(allow_private=True).refusal(address) is None


def test_address_policy_rejects_non_addresses() -> None:
    assert "not an IP address" in AddressPolicy().refusal("localhost")
    with pytest.raises(ValueError, match="allow_private"):
        AddressPolicy(allow_private="yes")


def _fetch(fetcher: ImageFetcher, *urls: str) -> dict[str, bytes]:
    return asyncio.run(fetcher.fetch_all([(f"messages[0].content[{i}]", url) for i, url in enumerate(urls)]))


def _fails(fetcher: ImageFetcher, *urls: str, match: str) -> float:
    """Seconds until the fetch of ``urls`` failed with an ImageFetchError matching ``match``."""
    start = time.monotonic()
    with pytest.raises(ImageFetchError, match=match):
        _fetch(fetcher, *urls)
    return time.monotonic() - start


@pytest.fixture()
def host():
    with image_host(BODY) as h:
        yield h


def _fetcher(workers: int = 4, **limits) -> ImageFetcher:
    return ImageFetcher(workers, FetchLimits(**{"timeout_s": 5.0, "max_bytes": LIMIT, "allow_private": True,
                                                **limits}))


def test_fetches_with_redirects_within_the_limit(host) -> None:
    fetcher = _fetcher(max_redirects=3)
    got = _fetch(fetcher, host.url("/ok.png"), host.url("/hops/3"), host.url("/ok.png"))
    assert got == {host.url("/ok.png"): BODY, host.url("/hops/3"): BODY}  # a URL given twice: fetched once
    _fails(fetcher, host.url("/hops/4"), match=r"content\[0\]: .*more than 3 redirects")
    _fails(fetcher, host.url("/loop"), match="more than 3 redirects")
    _fails(fetcher, host.url("/missing"), match="answered 404")


def test_loopback_and_private_hosts_are_refused_by_default(host) -> None:
    fetcher = _fetcher(allow_private=False)
    port = host.base.rsplit(":", 1)[1]
    for url, name, reason in [(host.url("/ok.png"), "127.0.0.1", "loopback"),
                              (f"http://localhost:{port}/ok.png", "localhost", "loopback"),
                              (f"http://[::1]:{port}/ok.png", "::1", "loopback"),
                              (f"http://[::ffff:127.0.0.1]:{port}/ok.png", "::ffff:127.0.0.1", "loopback"),
                              ("http://10.0.0.1/cat.png", "10.0.0.1", "private"),
                              ("http://169.254.169.254/latest/meta-data", "169.254.169.254", "link-local")]:
        _fails(fetcher, url, match=rf"content\[0\]: .*host '{name}' is refused: .*{reason} address")
    assert host.connections == 0  # refused before connecting


def test_each_redirect_hop_is_checked(host) -> None:
    fetcher = _fetcher()  # loopback allowed: the first hop connects
    port = host.base.rsplit(":", 1)[1]
    for target, match in [(f"http://0.0.0.0:{port}/ok.png", "'0.0.0.0' is refused: .*unspecified"),
                          (f"http://224.0.0.1:{port}/ok.png", "multicast"),
                          (f"ftp://127.0.0.1:{port}/ok.png", "only http and https"),
                          ("file:///etc/passwd", "only http and https")]:
        _fails(fetcher, host.url(f"/to?url={target}"), match=match)
    assert host.connections == 4  # each redirect answered, no connection to its target


@pytest.mark.parametrize("route", ["/huge-declared", "/huge-close", "/huge-chunked"])
def test_bodies_past_the_limit_are_cut_off(host, route: str) -> None:
    took = _fails(_fetcher(), host.url(route), match=f"larger than the limit of {LIMIT} bytes")
    if route == "/huge-declared":
        _fails(_fetcher(), host.url(route), match=r"Content-Length 1000000000")
    assert took < 3
    wait_until(lambda: host.active == 0, 5, "the image host to see the client hang up")
    assert host.sent < 64 * 2**20  # stopped reading early: at most socket buffers past the limit (of 1 GB)


def test_one_deadline_covers_every_image_of_a_request(host) -> None:
    fetcher = _fetcher(workers=2, timeout_s=1.0)
    slow = [host.url(f"/slow?{i}") for i in range(6)] + [host.url(f"/slow-headers?{i}") for i in range(4)]
    took = _fails(fetcher, *slow, match=r"did not finish within 1 s \(--image-fetch-timeout\); still waiting for")
    assert 0.9 < took < 2.5  # one timeout for all ten images, not ten
    # the pool's threads were given back at the deadline (sockets shut), and queued fetches never ran
    wait_until(lambda: host.active == 0, 2, "the slow fetches to hang up")
    assert host.connections <= 2 + 2  # at most the two running (plus a race at the deadline), never all ten
    start = time.monotonic()
    assert _fetch(fetcher, host.url("/ok.png")) == {host.url("/ok.png"): BODY}
    assert time.monotonic() - start < 1


def test_a_request_with_many_slow_images_leaves_pool_threads_to_others(host) -> None:
    fetcher = _fetcher(workers=4, timeout_s=3.0)  # 2 threads at most for one request

    async def both() -> tuple[float, BaseException | None]:
        slow = asyncio.ensure_future(fetcher.fetch_all([(f"a[{i}]", host.url(f"/slow?{i}")) for i in range(8)]))
        await asyncio.sleep(0.2)  # the slow request has taken its share of the pool
        start = time.monotonic()
        got = await fetcher.fetch_all([("b", host.url("/ok.png"))])
        took = time.monotonic() - start
        assert got == {host.url("/ok.png"): BODY} and not slow.done()
        return took, (await asyncio.gather(slow, return_exceptions=True))[0]

    took, slow_error = asyncio.run(both())
    assert took < 1
    assert isinstance(slow_error, ImageFetchError) and "still waiting for 8" in str(slow_error)
    assert host.connections <= 2 + 1 + 2  # the slow request never held more than its two threads (+ a race)


def test_a_failed_image_ends_the_request_s_other_fetches(host) -> None:
    fetcher = _fetcher(workers=4, timeout_s=10.0)  # both fetches of the request run at once
    took = _fails(fetcher, host.url("/slow"), host.url("/missing"), match=r"content\[1\]: .*answered 404")
    assert took < 2
    wait_until(lambda: host.active == 0, 2, "the slow fetch to hang up")


def test_https_checks_the_certificate_against_the_host_name(tmp_path, monkeypatch) -> None:
    """The connection goes to the resolved address, but TLS still verifies the certificate for the URL's host."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost"], check=True, capture_output=True, timeout=30)
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(cert, key)
    with image_host(BODY, tls=server_tls) as host:
        port = host.base.rsplit(":", 1)[1]
        _fails(_fetcher(), host.url("/ok.png"), match="CERTIFICATE_VERIFY_FAILED")  # not a trusted certificate
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # trust it (read when the fetch makes its TLS context)
        assert _fetch(_fetcher(), f"https://localhost:{port}/hops/1") == {f"https://localhost:{port}/hops/1": BODY}
        _fails(_fetcher(), host.url("/ok.png"), match="IP address mismatch|doesn't match")  # issued for localhost


def test_limits_are_validated() -> None:
    for bad in [{"timeout_s": 0}, {"timeout_s": True}, {"max_bytes": 0}, {"max_redirects": -1},
                {"max_redirects": 21}, {"allow_private": 1}]:
        with pytest.raises(ValueError):
            FetchLimits(**bad)
    with pytest.raises(ValueError, match="workers"):
        ImageFetcher(0, FetchLimits())


def test_server_flags() -> None:
    import argparse

    from rocm_k3.args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli(parser.parse_args(["--allow-remote-images", "--image-fetch-timeout", "2.5",
                                                  "--image-fetch-workers", "8", "--image-fetch-max-redirects", "0",
                                                  "--allow-private-image-hosts"]))
    assert (args.allow_remote_images, args.image_fetch_timeout, args.image_fetch_workers,
            args.image_fetch_max_redirects, args.allow_private_image_hosts) == (True, 2.5, 8, 0, True)
    defaults = ServerArgs()
    assert (defaults.image_fetch_timeout, defaults.image_fetch_workers, defaults.allow_private_image_hosts) == \
        (10.0, 4, False)
    for field, bad in [("image_fetch_timeout", 0), ("image_fetch_timeout", -1.0), ("image_fetch_workers", 0),
                       ("image_fetch_workers", 1000), ("image_fetch_max_redirects", -1),
                       ("allow_private_image_hosts", "yes")]:
        with pytest.raises(ValueError, match=field):
            ServerArgs(**{field: bad})
