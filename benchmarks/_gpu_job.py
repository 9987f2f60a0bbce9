"""The small CUDA job that benchmarks/gpu.py runs in each slot (sent as a file's text).

Standalone (stdlib only, plus torch or cupy when the slot's Python has them): a
matrix product on the GPU, checked, ``--repeat`` times in one process; prints one JSON
line: which way it ran (``torch``, ``cupy`` or ``driver``: a naive matmul kernel in PTX
through ``libcuda``'s driver API with ctypes, JIT-compiled by the driver), the wall
clock (``time.time()``) at its start and at its first result, each job's seconds and
the GPU memory it held (MiB, where the way can tell). It holds its memory ``--hold``
seconds at the end, so a status sampler can see it.
"""

import argparse
import ctypes
import json
import time

START = time.time()
PTX = b"""
.version 6.0
.target sm_50
.address_size 64
.visible .entry matmul(.param .u64 pa, .param .u64 pb, .param .u64 pc, .param .u32 pn)
{
    .reg .pred p;
    .reg .b32 r<12>;
    .reg .b64 rd<12>;
    .reg .f32 f<4>;
    ld.param.u64 rd1, [pa];
    ld.param.u64 rd2, [pb];
    ld.param.u64 rd3, [pc];
    ld.param.u32 r1, [pn];
    cvta.to.global.u64 rd1, rd1;
    cvta.to.global.u64 rd2, rd2;
    cvta.to.global.u64 rd3, rd3;
    mov.u32 r2, %ctaid.y;
    mov.u32 r3, %ntid.y;
    mov.u32 r4, %tid.y;
    mad.lo.s32 r5, r2, r3, r4;
    mov.u32 r2, %ctaid.x;
    mov.u32 r3, %ntid.x;
    mov.u32 r4, %tid.x;
    mad.lo.s32 r6, r2, r3, r4;
    setp.ge.s32 p, r5, r1;
    @p bra DONE;
    setp.ge.s32 p, r6, r1;
    @p bra DONE;
    mov.f32 f1, 0f00000000;
    mov.u32 r7, 0;
LOOP:
    mad.lo.s32 r8, r5, r1, r7;
    mul.wide.s32 rd4, r8, 4;
    add.s64 rd5, rd1, rd4;
    ld.global.f32 f2, [rd5];
    mad.lo.s32 r9, r7, r1, r6;
    mul.wide.s32 rd6, r9, 4;
    add.s64 rd7, rd2, rd6;
    ld.global.f32 f3, [rd7];
    fma.rn.f32 f1, f2, f3, f1;
    add.s32 r7, r7, 1;
    setp.lt.s32 p, r7, r1;
    @p bra LOOP;
    mad.lo.s32 r10, r5, r1, r6;
    mul.wide.s32 rd8, r10, 4;
    add.s64 rd9, rd3, rd8;
    st.global.f32 [rd9], f1;
DONE:
    ret;
}
\0"""


def with_torch(n):
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("torch.cuda.is_available() is False")
    a = torch.ones((n, n), device="cuda")
    b = torch.full((n, n), 2.0, device="cuda")
    c = (a @ b)[0, 0].item()
    if c != 2.0 * n:
        raise RuntimeError(f"wrong product: {c!r}")
    return torch.cuda.memory_reserved() // (1024 * 1024)


def with_cupy(n):
    import cupy

    a = cupy.ones((n, n), dtype=cupy.float32)
    b = cupy.full((n, n), 2.0, dtype=cupy.float32)
    c = float((a @ b)[0, 0])
    if c != 2.0 * n:
        raise RuntimeError(f"wrong product: {c!r}")
    return cupy.get_default_memory_pool().total_bytes() // (1024 * 1024)


class Driver:
    """The driver API through ctypes: a primary context, the PTX module, three buffers."""

    def __init__(self):
        c = ctypes
        self.cu = cu = c.CDLL("libcuda.so.1")
        self.check(cu.cuInit(0), "cuInit")
        dev = c.c_int()
        self.check(cu.cuDeviceGet(c.byref(dev), 0), "cuDeviceGet")
        self.ctx = c.c_void_p()
        self.check(cu.cuDevicePrimaryCtxRetain(c.byref(self.ctx), dev), "cuDevicePrimaryCtxRetain")
        self.check(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        mod = c.c_void_p()
        self.check(cu.cuModuleLoadData(c.byref(mod), c.c_char_p(PTX)), "cuModuleLoadData (PTX JIT)")
        self.fn = c.c_void_p()
        self.check(cu.cuModuleGetFunction(c.byref(self.fn), mod, b"matmul"), "cuModuleGetFunction")
        cu.cuMemAlloc_v2.argtypes = [c.POINTER(c.c_uint64), c.c_size_t]
        cu.cuMemcpyHtoD_v2.argtypes = [c.c_uint64, c.c_void_p, c.c_size_t]
        cu.cuMemcpyDtoH_v2.argtypes = [c.c_void_p, c.c_uint64, c.c_size_t]
        cu.cuLaunchKernel.argtypes = [c.c_void_p] + [c.c_uint] * 7 + [c.c_void_p] * 3

    def check(self, code, what):
        if code:
            name = ctypes.c_char_p()
            self.cu.cuGetErrorName(code, ctypes.byref(name))
            raise RuntimeError(f"{what} failed: {code} {(name.value or b'?').decode()}")

    def matmul(self, n):
        c = ctypes
        size = n * n * 4
        host_a = (c.c_float * (n * n))(*([1.0] * (n * n)))
        host_b = (c.c_float * (n * n))(*([2.0] * (n * n)))
        out = (c.c_float * (n * n))()
        bufs = [c.c_uint64() for _ in range(3)]
        for b in bufs:
            self.check(self.cu.cuMemAlloc_v2(c.byref(b), size), "cuMemAlloc")
        self.check(self.cu.cuMemcpyHtoD_v2(bufs[0], host_a, size), "cuMemcpyHtoD")
        self.check(self.cu.cuMemcpyHtoD_v2(bufs[1], host_b, size), "cuMemcpyHtoD")
        nn = c.c_uint32(n)
        params = (c.c_void_p * 4)(*[c.cast(c.pointer(x), c.c_void_p) for x in bufs + [nn]])
        grid = (n + 15) // 16
        self.check(self.cu.cuLaunchKernel(self.fn, grid, grid, 1, 16, 16, 1, 0, None, params, None),
                   "cuLaunchKernel")
        self.check(self.cu.cuCtxSynchronize(), "cuCtxSynchronize")
        self.check(self.cu.cuMemcpyDtoH_v2(out, bufs[2], size), "cuMemcpyDtoH")
        for b in bufs:
            self.cu.cuMemFree_v2(b)
        if out[0] != 2.0 * n or out[n * n - 1] != 2.0 * n:
            raise RuntimeError(f"wrong product: {out[0]!r}")
        return None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--hold", type=float, default=0.0)
    parser.add_argument("--way", default="auto", choices=("auto", "torch", "cupy", "driver"))
    args = parser.parse_args()
    errors = []
    run = None
    for way in ("torch", "cupy", "driver") if args.way == "auto" else (args.way,):
        try:
            if way == "driver":
                d = Driver()
                run = d.matmul
            else:
                run = with_torch if way == "torch" else with_cupy
                run(8)  # the import and the context, as the driver way's constructor does
            break
        except Exception as exc:  # noqa: BLE001 - the next way, then report every failure
            errors.append(f"{way}: {exc}")
            run = None
    if run is None:
        print(json.dumps({"ok": False, "error": "; ".join(errors), "start": START}))
        return
    jobs, first, mem = [], None, None
    for _ in range(args.repeat):
        t = time.time()
        mem = run(args.n)
        jobs.append(time.time() - t)
        first = first or time.time()
    time.sleep(args.hold)
    print(json.dumps({"ok": True, "way": way, "start": START, "first": first, "jobs": jobs,
                      "memory_mib": mem, "tried": errors}))


if __name__ == "__main__":
    main()
