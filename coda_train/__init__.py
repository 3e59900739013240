"""coda-train: Llama pretraining on CODA (GEMM + epilogue) programs. Importing needs no GPU."""

__version__ = "0.1.0"
