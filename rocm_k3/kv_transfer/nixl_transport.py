"""NIXL transport: the payload bytes move by NIXL (UCX backend) reads from the producer's registered memory; the
small control messages (where an entry lives, its row checksums, the release) go over the store's TCP side channel.

The producer registers every published entry's bytes with its NIXL agent (host memory on the CPU: ``DRAM``) and
deregisters them when the entry leaves the store (released, expired or replaced). Side-channel requests added to
``socket_transport``'s: ``{"op": "nixl_md"}`` -> ``{"agent", "md_version"}`` and the agent's metadata as the
payload, ``{"op": "desc", "key": K, "first": f}`` -> ``{"found", "checksums", "meta", "addr", "length", "agent",
"md_version"}`` (rows f.. of the entry, no payload). A remote agent's metadata lists the memory registered when it
was taken, so a consumer reloads it when an entry's ``md_version`` (registrations so far) is newer than its copy. The consumer reads those bytes into a registered buffer of its own
and verifies every row's checksum before handing them on, exactly as over TCP.
"""

from __future__ import annotations

import importlib
import time
import uuid
from typing import Any

import torch

from rocm_k3.kv_transfer.socket_transport import BlockClient, BlockStore, StoreEntry, TransferError, _send, verify_rows

_MEM = "DRAM"  # host memory (a VRAM pool would be registered as "VRAM" on a GPU)


def nixl_api() -> Any | None:
    """The NIXL Python API module (``nixl_cu12`` from the ``nixl`` extra, or the ``nixl`` meta package's), or None."""
    for name in ("nixl_cu12", "nixl._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def new_agent(role: str, progress_thread: bool) -> Any:
    """A NIXL agent with the UCX backend and strict thread sync (the store's server threads and the engine's
    thread both touch it); a TransferError when NIXL or its UCX backend is not usable here. The producer (the
    target of the reads) needs UCX's progress thread to answer them; a consumer drives its own reads by polling,
    so it runs without that thread (it polls a core's worth while idle: ~0.4 of a CPU core measured here)."""
    api = nixl_api()
    if api is None:
        raise TransferError("NixlConnector needs the nixl package (pip install 'rocm-k3[nixl]')")
    conf = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"],
                                 sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
    agent = api.nixl_agent(f"rocm-k3-{role}-{uuid.uuid4().hex[:12]}", conf)
    if "UCX" not in agent.backends:
        raise TransferError(f"NIXL's UCX backend is not available (plugins: {agent.get_plugin_list()})")
    return agent


class _ReadTimedOut(TransferError):
    """A READ still in flight when its deadline passed: NIXL may yet write into the landing buffer."""


class NixlError(RuntimeError):
    """NIXL refused a transfer request (e.g. no registration covers the remote range)."""


class NixlBlockStore(BlockStore):
    """Producer side: a ``BlockStore`` whose entries are registered with a NIXL agent and read by descriptor."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, ttl_s: float = 60.0) -> None:
        self.agent = new_agent("producer", progress_thread=True)
        self._regs: dict[int, Any] = {}  # id(entry.data) -> its registration
        self.md_version = 0  # registrations made so far (the metadata a consumer needs to read the newest entry)
        super().__init__(host, port, ttl_s)

    def _added(self, entry: StoreEntry) -> None:
        self._regs[id(entry.data)] = self.agent.register_memory([entry.data])
        self.md_version += 1

    def _dropped(self, entry: StoreEntry) -> None:
        reg = self._regs.pop(id(entry.data), None)
        if reg is not None:
            self.agent.deregister_memory(reg)

    def _serve(self, sock: Any, header: dict[str, Any]) -> None:
        op = header.get("op")
        if op == "nixl_md":
            version = self.md_version
            _send(sock, {"agent": self.agent.name, "md_version": version}, self.agent.get_agent_metadata())
        elif op == "desc":
            entry = self.entry(str(header.get("key")))
            if entry is None:
                _send(sock, {"found": False})
                return
            first = int(header.get("first", 0))
            try:
                _, checksums, meta = entry.rows_from(first)
            except TransferError as exc:
                _send(sock, {"error": str(exc)})
                return
            _send(sock, {"found": True, "checksums": list(checksums), "meta": meta, "agent": self.agent.name,
                         "md_version": self.md_version,
                         "addr": entry.data.data_ptr() + first * entry.row_nbytes,
                         "length": (entry.rows - first) * entry.row_nbytes})
        else:
            super()._serve(sock, header)


class NixlBlockClient(BlockClient):
    """Consumer side: entries located over the side channel, their bytes read by NIXL, rows checksum-verified."""

    def __init__(self, host: str, port: int, timeout_s: float, agent: Any,
                 remotes: dict[tuple[str, int], tuple[str, int]], late: list[tuple[torch.Tensor, Any]]) -> None:
        super().__init__(host, port, timeout_s)
        self.agent = agent
        self._remotes = remotes  # (host, port) -> (remote agent name, md_version loaded); shared by the worker's loads
        # landing buffers of timed-out READs, kept registered and alive as long as the agent (the connector's
        # list): releasing a handle need not abort its transfer, so a late write must land in memory nobody reuses
        # (timeouts are rare: a few buffers at most)
        self._late = late

    def _remote(self, header: dict[str, Any]) -> str:
        """The producer's agent, its metadata (re)loaded when this copy predates the entry's registration (or the
        producer restarted with a new agent)."""
        name, version = self._remotes.get(self.address, ("", -1))
        if name != header.get("agent") or version < int(header.get("md_version", 0)):
            reply, md = self._call({"op": "nixl_md"})
            loaded = self.agent.add_remote_agent(md)
            name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            self._remotes[self.address] = (name, int(reply.get("md_version", 0)))
        return name

    def get(self, key: str, first: int = 0, wait_s: float | None = None) -> tuple[bytes, dict[str, Any]]:
        header, _ = self._poll({"op": "desc", "key": key, "first": first}, wait_s)
        remote = self._remote(header)
        if header.get("agent") != remote:
            raise TransferError(f"{key!r}: producer {self.address} now runs agent {header.get('agent')!r}")
        buf = torch.empty(int(header["length"]), dtype=torch.uint8)  # [length] landing buffer
        reg = self.agent.register_memory([buf])
        late = False
        try:
            try:
                self._read(key, buf, int(header["addr"]), remote)
            except NixlError:
                # a loaded copy of the producer's metadata can keep a freed registration whose address a newer
                # entry reuses (the reload merges): load it afresh once, then give up
                self.agent.remove_remote_agent(remote)
                self._remotes.pop(self.address, None)
                self._read(key, buf, int(header["addr"]), self._remote(header))
        except NixlError as exc:
            raise TransferError(f"NIXL read of {key!r} from {self.address} failed: {exc}") from None
        except _ReadTimedOut:
            late = True
            self._late.append((buf, reg))
            raise
        finally:
            if not late:
                self.agent.deregister_memory(reg)
        payload = buf.numpy().tobytes()
        verify_rows(payload, header["checksums"], key)
        return payload, header["meta"]

    def _read(self, key: str, buf: torch.Tensor, addr: int, remote: str) -> None:
        """One NIXL READ of ``buf.numel()`` bytes at the producer's ``addr`` into ``buf``, within timeout_s; a
        NixlError when NIXL refuses it (its own exceptions), a TransferError when it fails or times out."""
        local = self.agent.get_xfer_descs([buf])
        remote_descs = self.agent.get_xfer_descs([(addr, buf.numel(), 0)], _MEM)
        try:
            handle = self.agent.initialize_xfer("READ", local, remote_descs, remote)
        except Exception as exc:  # the bindings' nixl*Error types (not importable by one name)
            raise NixlError(f"{type(exc).__name__}: {exc}") from None
        try:
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + self.timeout_s
            while state == "PROC":
                if time.monotonic() >= deadline:
                    raise _ReadTimedOut(f"timed out reading {key!r} from {self.address} over NIXL")
                time.sleep(0.0005)
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError(f"NIXL read of {key!r} from {self.address} failed ({state})")
        finally:
            self.agent.release_xfer_handle(handle)
