"""Low-precision formats (FP8, NVFP4, MX), their tensor types, quantize_, and scaled GEMM."""
