"""TCP transport on loopback: the producer's ``BlockStore`` serves checksummed payloads; ``BlockClient`` fetches.

An entry is a tensor's bytes split into rows along its first dimension (an MLA layer's pages: one row per block; a
KDA state: one row), each row with its own checksum. Wire format: every message is a 4-byte big-endian header
length, a JSON header, then ``header["nbytes"]`` raw bytes. Requests: ``{"op": "get", "key": K, "first": f}`` ->
``{"found": bool, "checksums": [...], "nbytes": n, "meta": {...}}`` + the bytes of rows f.. (a consumer whose
prefix cache holds the first f blocks fetches only the rest); ``{"op": "release", "transfer_id": T}`` ->
``{"released": n}`` (the consumer confirms, the producer frees). Entries also expire after ``ttl_s`` so a consumer
that dies leaks nothing on the producer.
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

import torch

from rocm_k3.kv_transfer.checksum import digest, verify

_LEN = struct.Struct(">I")


class TransferError(RuntimeError):
    """A fetch that failed: producer unreachable, timeout, missing entry or checksum mismatch."""


def entry_key(transfer_id: str, layer_name: str) -> str:
    return f"{transfer_id}/{layer_name}"


@dataclasses.dataclass
class StoreEntry:
    """data: the entry's bytes ([rows * row_nbytes] uint8, CPU); checksums: one per row; meta: dtype and shape
    ([rows, ...]) of the tensor the bytes hold."""

    data: torch.Tensor
    checksums: tuple[str, ...]
    meta: dict[str, Any]
    expires_at: float

    @property
    def rows(self) -> int:
        return len(self.checksums)

    @property
    def row_nbytes(self) -> int:
        return self.data.numel() // max(1, self.rows)

    def rows_from(self, first: int) -> tuple[memoryview, tuple[str, ...], dict[str, Any]]:
        """The bytes, checksums and meta of rows ``first``..; a TransferError for a row past the end."""
        if not 0 <= first < self.rows:
            raise TransferError(f"first row {first} outside the entry's {self.rows} rows")
        view = memoryview(self.data.numpy())[first * self.row_nbytes:]
        return view, self.checksums[first:], {**self.meta, "shape": [self.rows - first, *self.meta["shape"][1:]]}


def row_checksums(data: torch.Tensor, rows: int) -> tuple[str, ...]:
    """One digest per row of ``data`` ([rows * n] uint8)."""
    if rows < 1 or data.numel() % rows:
        raise ValueError(f"{data.numel()} bytes do not split into {rows} rows")
    n, view = data.numel() // rows, memoryview(data.numpy())
    return tuple(digest(view[r * n : (r + 1) * n]) for r in range(rows))


def verify_rows(payload: "bytes | memoryview", checksums: list[str], key: str) -> None:
    """A TransferError naming the first row of ``payload`` whose digest is not its checksum."""
    view = memoryview(payload)
    if not checksums or len(view) % len(checksums):
        raise TransferError(f"{key!r}: {len(view)} bytes do not split into {len(checksums)} rows")
    n = len(view) // len(checksums)
    for r, expected in enumerate(checksums):
        if not verify(view[r * n : (r + 1) * n], expected):
            raise TransferError(f"checksum mismatch for {key!r} row {r} ({n} bytes)")


def _send(sock: socket.socket, header: dict[str, Any], payload: "bytes | memoryview" = b"") -> None:
    raw = json.dumps({**header, "nbytes": len(payload)}).encode()
    sock.sendall(_LEN.pack(len(raw)) + raw)
    if len(payload):
        sock.sendall(payload)


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
                self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # header, then payload
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

    def put(self, key: str, tensor: torch.Tensor) -> int:
        """Publish a copy of ``tensor`` ([rows, ...]) under ``key``, one checksum per row; returns its bytes."""
        t = tensor.detach().to("cpu").contiguous()
        data = t.reshape(-1).view(torch.uint8).clone()  # [rows * row bytes]
        meta = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
        entry = StoreEntry(data, row_checksums(data, t.shape[0]), meta, time.monotonic() + self.ttl_s)
        self._added(entry)
        with self._lock:
            self._expire_locked()
            old = self._entries.pop(key, None)
            self._entries[key] = entry
        if old is not None:
            self._dropped(old)
        return data.numel()

    def _added(self, entry: StoreEntry) -> None:
        """Hook: a transport that serves entries from registered memory registers ``entry.data`` here."""

    def _dropped(self, entry: StoreEntry) -> None:
        """Hook: the entry left the store (released, expired or replaced)."""

    def release(self, transfer_id: str) -> int:
        """Drop every entry of ``transfer_id``; returns how many were dropped."""
        prefix = transfer_id + "/"
        with self._lock:
            dropped = [self._entries.pop(k) for k in [k for k in self._entries if k.startswith(prefix)]]
        for entry in dropped:
            self._dropped(entry)
        return len(dropped)

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
        with self._lock:
            dropped, self._entries = list(self._entries.values()), {}
        for entry in dropped:
            self._dropped(entry)

    def _expire_locked(self) -> None:
        now = time.monotonic()
        for k in [k for k, e in self._entries.items() if e.expires_at < now]:
            self._dropped(self._entries.pop(k))

    def _found(self, header: dict[str, Any]) -> tuple[dict[str, Any], "memoryview | bytes"] | None:
        """(reply header, bytes) for a get of ``header``'s key from row ``first``, or None when not (yet) there."""
        entry = self.entry(str(header.get("key")))
        if entry is None:
            return None
        view, checksums, meta = entry.rows_from(int(header.get("first", 0)))
        return {"found": True, "checksums": list(checksums), "meta": meta}, view

    def _serve(self, sock: socket.socket, header: dict[str, Any]) -> None:
        op = header.get("op")
        if op == "get":
            try:
                found = self._found(header)
            except (TransferError, ValueError) as exc:
                _send(sock, {"error": str(exc)})
                return
            if found is None:
                _send(sock, {"found": False})
            else:
                _send(sock, *found)
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
                self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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

    def _poll(self, request: dict[str, Any], wait_s: float | None) -> tuple[dict[str, Any], bytes]:
        """Send ``request`` until the store has its entry, up to ``wait_s`` (default: timeout_s)."""
        deadline = time.monotonic() + (self.timeout_s if wait_s is None else wait_s)
        while True:
            header, payload = self._call(request)
            if "error" in header:
                raise TransferError(f"{request.get('key')!r} from {self.address}: {header['error']}")
            if header.get("found"):
                return header, payload
            if time.monotonic() >= deadline:
                raise TransferError(f"timed out waiting for {request.get('key')!r} from {self.address}")
            time.sleep(0.01)

    def get(self, key: str, first: int = 0, wait_s: float | None = None) -> tuple[bytes, dict[str, Any]]:
        """The verified bytes and meta of ``key``'s rows ``first``.., polling up to ``wait_s`` for the entry."""
        header, payload = self._poll({"op": "get", "key": key, "first": first}, wait_s)
        verify_rows(payload, header["checksums"], key)
        return payload, header["meta"]

    def release(self, transfer_id: str) -> int:
        header, _ = self._call({"op": "release", "transfer_id": transfer_id})
        return int(header.get("released", 0))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
