"""TCP transport on loopback: the producer's ``BlockStore`` serves checksummed payloads; ``BlockClient`` fetches.

Wire format: every message is a 4-byte big-endian header length, a JSON header, then ``header["nbytes"]`` raw
bytes. Requests: ``{"op": "get", "key": K}`` -> ``{"found": bool, "checksum": str, "nbytes": n, "meta": {...}}``
+ payload; ``{"op": "release", "transfer_id": T}`` -> ``{"released": n}`` (the consumer confirms, the producer
frees). Entries also expire after ``ttl_s`` so a consumer that dies leaks nothing on the producer.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import socketserver
import struct
import threading
import time
from typing import Any

from rocm_k3.kv_transfer.checksum import digest, verify

_LEN = struct.Struct(">I")


class TransferError(RuntimeError):
    """A fetch that failed: producer unreachable, timeout, missing entry or checksum mismatch."""


def entry_key(transfer_id: str, layer_name: str) -> str:
    return f"{transfer_id}/{layer_name}"


@dataclasses.dataclass
class StoreEntry:
    payload: bytes
    checksum: str
    meta: dict[str, Any]
    expires_at: float


def _send(sock: socket.socket, header: dict[str, Any], payload: bytes = b"") -> None:
    raw = json.dumps({**header, "nbytes": len(payload)}).encode()
    sock.sendall(_LEN.pack(len(raw)) + raw + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise TransferError(f"connection closed with {left} of {n} bytes unread")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket) -> tuple[dict[str, Any], bytes]:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    header = json.loads(_recv_exact(sock, n))
    return header, _recv_exact(sock, int(header.get("nbytes", 0)))


class BlockStore:
    """Producer side: holds published payloads and serves them on ``host:port`` (port 0 picks a free one)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, ttl_s: float = 60.0) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self._entries: dict[str, StoreEntry] = {}
        self._lock = threading.Lock()
        store = self

        class _Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                try:
                    while True:
                        header, _ = _recv(self.request)
                        store._serve(self.request, header)
                except (TransferError, OSError, ValueError):
                    return

        class _Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = _Server((host, port), _Handler)
        self.address: tuple[str, int] = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, name="kv-store", daemon=True)
        self._thread.start()

    def put(self, key: str, payload: bytes, meta: dict[str, Any]) -> None:
        entry = StoreEntry(payload, digest(payload), meta, time.monotonic() + self.ttl_s)
        with self._lock:
            self._expire_locked()
            self._entries[key] = entry

    def release(self, transfer_id: str) -> int:
        """Drop every entry of ``transfer_id``; returns how many were dropped."""
        prefix = transfer_id + "/"
        with self._lock:
            keys = [k for k in self._entries if k.startswith(prefix)]
            for k in keys:
                del self._entries[k]
        return len(keys)

    def num_entries(self) -> int:
        with self._lock:
            self._expire_locked()
            return len(self._entries)

    def entry(self, key: str) -> StoreEntry | None:
        with self._lock:
            return self._entries.get(key)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _expire_locked(self) -> None:
        now = time.monotonic()
        for k in [k for k, e in self._entries.items() if e.expires_at < now]:
            del self._entries[k]

    def _serve(self, sock: socket.socket, header: dict[str, Any]) -> None:
        op = header.get("op")
        if op == "get":
            entry = self.entry(str(header.get("key")))
            if entry is None:
                _send(sock, {"found": False})
            else:
                _send(sock, {"found": True, "checksum": entry.checksum, "meta": entry.meta}, entry.payload)
        elif op == "release":
            _send(sock, {"released": self.release(str(header.get("transfer_id")))})
        else:
            _send(sock, {"error": f"unknown op {op!r}"})


class BlockClient:
    """Consumer side: one connection to a producer's store; every payload is checksum-verified before return."""

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.address = (host, port)
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None

    def _conn(self) -> socket.socket:
        if self._sock is None:
            try:
                self._sock = socket.create_connection(self.address, timeout=self.timeout_s)
            except OSError as exc:
                raise TransferError(f"producer {self.address} unreachable: {exc}") from None
        return self._sock

    def _call(self, header: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        sock = self._conn()
        try:
            _send(sock, header)
            return _recv(sock)
        except (OSError, ValueError) as exc:  # socket.timeout is an OSError
            self.close()
            raise TransferError(f"transfer from {self.address} failed: {exc}") from None

    def get(self, key: str, wait_s: float | None = None) -> tuple[bytes, dict[str, Any]]:
        """The verified payload and meta of ``key``, polling up to ``wait_s`` (default: timeout_s) for it."""
        deadline = time.monotonic() + (self.timeout_s if wait_s is None else wait_s)
        while True:
            header, payload = self._call({"op": "get", "key": key})
            if header.get("found"):
                break
            if time.monotonic() >= deadline:
                raise TransferError(f"timed out waiting for {key!r} from {self.address}")
            time.sleep(0.01)
        if not verify(payload, header["checksum"]):
            raise TransferError(f"checksum mismatch for {key!r} ({len(payload)} bytes)")
        return payload, header["meta"]

    def release(self, transfer_id: str) -> int:
        header, _ = self._call({"op": "release", "transfer_id": transfer_id})
        return int(header.get("released", 0))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
