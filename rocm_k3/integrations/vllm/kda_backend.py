"""The metadata backend of the plugin's KDA layers: vLLM's common state-layer metadata (decodes first;
``query_start_loc_p``, ``state_indices_tensor_p`` / ``_d``, ``has_initial_states_p``), without the causal-conv
kernel tables vLLM's Mamba kernels need (rocm-k3's short-conv op takes ``cu_seqlens`` directly).

It is registered as the state-layer backend type :data:`BACKEND_NAME` by :func:`register_backend`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.v1.attention.backend import AttentionBackend, CommonAttentionMetadata
from vllm.v1.attention.backends.mamba_attn import BaseMambaAttentionMetadata, BaseMambaAttentionMetadataBuilder
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

BACKEND_NAME = "ROCM_K3_KDA"


class RocmK3KDABackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_builder_cls() -> type[RocmK3KDAMetadataBuilder]:
        return RocmK3KDAMetadataBuilder

    @classmethod
    def is_ssm(cls) -> bool:
        return True


@dataclass
class RocmK3KDAMetadata(BaseMambaAttentionMetadata):
    pass


class RocmK3KDAMetadataBuilder(BaseMambaAttentionMetadataBuilder[RocmK3KDAMetadata]):
    metadata_cls = RocmK3KDAMetadata
    needs_causal_conv1d_metadata = False

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False, **kwargs: Any) -> RocmK3KDAMetadata:
        return self._compute_common_metadata(common_attn_metadata)


def register_backend() -> MambaAttentionBackendEnum:
    """The backend's state-layer type, registered once per process."""
    members = MambaAttentionBackendEnum._member_map_
    if BACKEND_NAME not in members:
        MambaAttentionBackendEnum.register(BACKEND_NAME, f"{__name__}.RocmK3KDABackend")
    return members[BACKEND_NAME]
