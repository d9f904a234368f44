"""Runtime layer: CuTeDSL environment, kernel compilation and caching, launching from torch.

Nothing here is imported by ``import coda``: CuTeDSL loads on first use of a kernel.
"""
