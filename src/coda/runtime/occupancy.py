"""How many SMs a persistent GEMM grid can hold at once (runtime layer: asked of the CUDA
driver once per device and cluster size; the kernel key carries the answer).

coda's GEMM kernels are persistent: one CTA per SM (their shared memory allows no second
one), grouped in clusters of ``cluster_m * cluster_n`` CTAs that must land on SMs of one
GPC together. A device's SMs need not divide into whole clusters: an H200 (132 SMs)
holds 66 clusters of 2 but only 30 of 4 (120 SMs). A grid of more clusters than fit
runs the extra ones after the others finish, each still owning its share of the tiles,
so the kernel's time nearly doubles at its end (the 2 x 2 clusters measured 1.4-1.8x
slower with a grid of 33 on an H200). ``grid_sms`` is the SM count a kernel sizes its
grid by: ``cluster size x the clusters that fit``.

The driver's answer (``cuOccupancyMaxActiveClusters``) is for an empty probe kernel with
the kernels' block size and the most dynamic shared memory a block may take: one CTA per
SM, as the GEMM kernels run.
"""

from __future__ import annotations

import torch

from . import checks

#: an empty kernel, JIT-compiled by the driver in milliseconds (no CuTeDSL compile)
_PROBE_PTX = b"""
.version 7.8
.target sm_90
.address_size 64
.visible .entry coda_occupancy_probe()
{
    ret;
}
"""

_grid_sms: dict[tuple[torch.device, int], int] = {}


def grid_sms(device: torch.device, cluster_size: int) -> int:
    """The SMs that a grid of ``cluster_size``-CTA clusters, one CTA per SM, occupies at
    once on ``device`` (a Hopper GPU): at most its SM count, a multiple of
    ``cluster_size``. Remembered per (device, cluster size)."""
    key = (device, cluster_size)
    got = _grid_sms.get(key)
    if got is None:
        sms = checks.hopper_device(device)
        if cluster_size > 1 and device.type == "cuda":  # (else a test's stand-in device)
            try:
                fit = _clusters_that_fit(device, cluster_size)
            except RuntimeError:  # (e.g. a driver that refuses the probe during a capture)
                return sms - sms % cluster_size  # as before the probe; asked again next time
            sms = min(sms, cluster_size * fit)
        got = _grid_sms[key] = sms
    return got


def _clusters_that_fit(device: torch.device, cluster_size: int) -> int:
    from cuda.bindings import driver

    # (imported here: ``import coda`` does not load CuTeDSL)
    from ..mainloop.kernel import NUM_CONSUMER_WGS, THREADS_PER_WG

    def ok(result):
        err, *rest = result
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver call failed while sizing the GEMM grid: {err}")
        return rest[0] if rest else None

    torch.cuda.init()
    index = device.index if device.index is not None else torch.cuda.current_device()
    dev = ok(driver.cuDeviceGet(index))
    ctx = ok(driver.cuDevicePrimaryCtxRetain(dev))
    ok(driver.cuCtxPushCurrent(ctx))
    module = None
    try:
        module = ok(driver.cuModuleLoadData(_PROBE_PTX))
        fn = ok(driver.cuModuleGetFunction(module, b"coda_occupancy_probe"))
        attr = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
        smem = ok(driver.cuDeviceGetAttribute(attr, dev))
        fattr = driver.CUfunction_attribute
        most = fattr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        ok(driver.cuFuncSetAttribute(fn, most, smem))
        allow = fattr.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
        ok(driver.cuFuncSetAttribute(fn, allow, 1))
        config = driver.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = cluster_size, 1, 1
        # the threads of a GEMM CTA: a producer and two consumer warpgroups
        threads = THREADS_PER_WG * (NUM_CONSUMER_WGS + 1)
        config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
        config.sharedMemBytes = smem
        dims = driver.CUlaunchAttributeValue()
        dims.clusterDim.x, dims.clusterDim.y, dims.clusterDim.z = cluster_size, 1, 1
        cluster = driver.CUlaunchAttribute()
        cluster.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        cluster.value = dims
        config.attrs, config.numAttrs = [cluster], 1
        return int(ok(driver.cuOccupancyMaxActiveClusters(fn, config)))
    finally:
        if module is not None:
            driver.cuModuleUnload(module)
        driver.cuCtxPopCurrent()
        driver.cuDevicePrimaryCtxRelease(dev)
