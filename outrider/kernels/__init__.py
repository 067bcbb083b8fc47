"""GPU kernels (Triton) and the small fused ops that dispatch to them.

Only `ops` is safe to import anywhere: it holds the torch fallbacks and imports Triton lazily, for CUDA
tensors. The other modules import Triton at load and are reached only from the CUDA path.
"""
