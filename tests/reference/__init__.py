"""Unwired Python reference of the ActiveKV engine: same algorithms, same torch operations in the same order as the
engine's ATen path (engine/src/*.cpp), so parity is ``torch.equal``. Never imported by the product."""
