"""Test-harness stand-in for vLLM's compiled vllm._C_stable_libtorch (ActiveKV's GPU harness only, never in a wheel).

Registers in torch.library `_C` only what vLLM 0.32.0's eager CUDA path reaches without the compiled extension
(../README.md): five capability queries answering False, and silu_and_mul in plain torch.
"""

import torch

_lib = torch.library.Library("_C", "FRAGMENT")

for _name in (
    "cutlass_scaled_mm_supports_fp8",
    "cutlass_scaled_mm_supports_block_fp8",
    "cutlass_scaled_mm_supports_fp4",
    "cutlass_group_gemm_supported",
    "mxfp4_experts_quant_supported",
):
    _lib.define(f"{_name}(int cuda_device_capability) -> bool")
    _lib.impl(_name, lambda cuda_device_capability: False, "CompositeExplicitAutograd")


def _silu_and_mul(result: torch.Tensor, input: torch.Tensor) -> None:
    d = input.shape[-1] // 2
    result.copy_(torch.nn.functional.silu(input[..., :d]) * input[..., d:])


_lib.define("silu_and_mul(Tensor(a!) result, Tensor input) -> ()")
_lib.impl("silu_and_mul", _silu_and_mul, "CompositeExplicitAutograd")
