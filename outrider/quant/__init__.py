"""Quantized weights served as they are stored: GGUF block formats, FP8 and AWQ/GPTQ 4-bit (formats.py), their
torch dequantizers (dequant.py), weights and modules that keep them quantized (weight.py, layers.py), loading them
from checkpoints (checkpoint.py) and writing test checkpoints (writers.py). Kernels: outrider/kernels/quant_gemm.py.
"""
