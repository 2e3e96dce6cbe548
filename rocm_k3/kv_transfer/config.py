"""``--kv-transfer-config``: vLLM's keys (kv_connector, kv_role, kv_ip, kv_port, kv_connector_extra_config)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from typing import Any

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_CONNECTORS = ("SocketConnector", "NixlConnector")


def nixl_installed() -> bool:
    """NIXL's Python API is importable (``nixl_cu12`` of the ``nixl`` extra, or the ``nixl`` meta package)."""
    return any(importlib.util.find_spec(name) is not None for name in ("nixl_cu12", "nixl"))


@dataclasses.dataclass(frozen=True)
class KVTransferConfig:
    """kv_ip/kv_port: where the producer's block store listens (loopback by default); timeout_s: how long a
    consumer waits for a transfer before recomputing the prompt itself."""

    kv_connector: str
    kv_role: str
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    timeout_s: float = 5.0
    kv_connector_extra_config: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_connector must be one of {KV_CONNECTORS}, got {self.kv_connector!r}")
        if self.kv_connector == "NixlConnector" and not nixl_installed():
            raise ValueError("kv_connector 'NixlConnector' needs the nixl package (pip install 'rocm-k3[nixl]', "
                             "i.e. nixl-cu12); without it use 'SocketConnector'")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {KV_ROLES}, got {self.kv_role!r}")
        if not isinstance(self.kv_port, int) or not 0 <= self.kv_port < 65536:
            raise ValueError(f"kv_port must be an int in [0, 65535], got {self.kv_port!r}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def parse(cls, value: "str | dict[str, Any] | KVTransferConfig | None") -> "KVTransferConfig | None":
        """None, a JSON string (the CLI) or a dict (``LLM(kv_transfer_config=...)``) -> the config or None."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        if isinstance(value, dict):
            return cls.from_json(json.dumps(value))
        if isinstance(value, str):
            return cls.from_json(value)
        raise TypeError(f"kv_transfer_config: expected a JSON string or a dict, got {type(value).__name__}")

    @classmethod
    def from_json(cls, text: str) -> "KVTransferConfig":
        """Parse the CLI's JSON; unknown keys and bad JSON are ValueErrors naming the problem."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-transfer-config is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("--kv-transfer-config must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"--kv-transfer-config has unknown keys {unknown}; known: {sorted(known)}")
        for key in ("kv_connector", "kv_role"):
            if key not in raw:
                raise ValueError(f"--kv-transfer-config needs {key!r}")
        return cls(**raw)
