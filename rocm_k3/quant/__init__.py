"""OCP microscaling formats used by K3: MXFP4 (E2M1 + E8M0 per 32) and MXFP8 (FP8 E4M3 OCP or FNUZ + E8M0).

These are plain library functions (validated, pure PyTorch). The model calls the dispatching versions in
:mod:`rocm_k3.ops.quant`, which have the same signatures plus ``backend=``.
"""

from rocm_k3.quant.blocks import BLOCK_SIZE
from rocm_k3.quant.e2m1 import (
    E2M1_MAGNITUDES,
    E2M1_MAX,
    decode_e2m1,
    e2m1_values,
    encode_e2m1,
    pack_nibbles,
    unpack_nibbles,
)
from rocm_k3.quant.e8m0 import E8M0_NAN, SCALE_RULES, decode_e8m0, encode_e8m0, scale_exponent
from rocm_k3.quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from rocm_k3.quant.mxfp8 import FP8_FORMATS, FP8Format, dequantize_mxfp8, fp8_dtype_for_arch, quantize_mxfp8

__all__ = ["BLOCK_SIZE", "E2M1_MAGNITUDES", "E2M1_MAX", "E8M0_NAN", "FP8_FORMATS", "FP8Format", "SCALE_RULES",
           "decode_e2m1", "decode_e8m0", "dequantize_mxfp4", "dequantize_mxfp8", "e2m1_values", "encode_e2m1",
           "encode_e8m0", "fp8_dtype_for_arch", "pack_nibbles", "quantize_mxfp4", "quantize_mxfp8", "scale_exponent",
           "unpack_nibbles"]
