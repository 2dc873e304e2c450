"""Test-harness stand-in for vLLM's compiled flash-attention module (ActiveKV's GPU harness only): empty on purpose.

vllm/vllm_flash_attn/__init__.py raises ImportError without it; the harness calls no flash-attention kernel.
"""
