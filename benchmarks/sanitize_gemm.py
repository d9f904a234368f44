"""One ragged-shape GEMM for compute-sanitizer (memcheck / racecheck) runs on the device.

compute-sanitizer --tool memcheck  python benchmarks/sanitize_gemm.py
compute-sanitizer --tool racecheck python benchmarks/sanitize_gemm.py
"""

import torch

from coda.matmul import gemm

m, n, k = 333, 520, 200  # ragged in M, N and K; several tiles and both warpgroups busy
a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
b = torch.randn(n, k, device="cuda").to(torch.bfloat16)
out = gemm(a, b)
torch.cuda.synchronize()
err = (out.float() - a.float() @ b.float().t()).abs().max().item()
print(f"sanitize_gemm {m}x{n}x{k}: max abs err {err:.4f}")
assert err < 0.5
