#!/usr/bin/env python3
"""Load and launch every committed Triton cubin once, at the driver level, without the Rust build.

    python3 scripts/gpu/cubin_smoke.py [--kernels DIR] [--out FILE] [--fake] [--arch sm80|sm90]

For every <entry>.<dtype>.<arch>.cubin of candle-fused/kernels (the arch matching the device:
compute capability 8.x -> sm80, 9.0 -> sm90), through libcuda.so.1 (ctypes, no torch):
cuModuleLoadData, cuModuleGetFunction, the function's attributes (static shared memory, registers,
local memory), the shared-memory rule of the launcher (static + dynamic > 48 KB: opt in with
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES; above the device's opt-in maximum: refused),
one launch on tiny sizes (derived from the json's parameter roles and grid rule: B 1, H 2, KV 1,
T 16, D 64 <= BLOCK_D, N 4, C 64, E 256, R 2, V 64; every buffer zeroed, 16-byte aligned and at
least as large as its role's shape), then a context synchronise. One JSON line per cubin is
written to FILE (and stdout) as it goes: "ok": true, or the CUDA error's name. A launch that the
committed launch.rs rule (opt in only when the dynamic size alone exceeds 48 KB) would have made
without the opt-in is retried that way once, to show whether the driver refuses it. A sticky
error (the context is lost) is recorded and the context is recreated for the next cubin.

--fake runs everything against a fake driver in Python (no GPU): it records the calls and checks
them against the cubin itself (ELF .nv.info: parameter count and sizes, the required block) and the
json (block = 32 * num_warps, grid = the rule, opt-in done when static + dynamic > 48 KB, pointers
16-byte aligned and inside an allocation large enough for the shape). Exit status: 0 all ok,
1 a cubin failed, 2 usage, 3 no cubin for this device (skipped).
"""
import argparse
import ctypes
import glob
import json
import math
import os
import re
import struct
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NO_OPTIN = 48 * 1024
# CUfunction_attribute / CUdevice_attribute values (cuda.h)
FA_MAX_THREADS, FA_SHARED, FA_LOCAL, FA_REGS, FA_MAX_DYN_SHARED = 0, 1, 3, 4, 8
DA_MAX_SHARED_OPTIN, DA_CC_MAJOR, DA_CC_MINOR, DA_SMS = 97, 75, 76, 16
ELEM = {"fp32": 4, "f32": 4, "bf16": 2, "fp16": 2, "f16": 2, "i32": 4, "u32": 4, "fp64": 8,
        "i64": 8, "u64": 8, "i8": 1, "u8": 1, "i16": 2}
SCRATCH = ("global_scratch", "profile_scratch")
SLOT = 1 << 20  # bytes per pointer argument (each tiny shape fits; checked)
MAX_PTRS = 16


class CudaError(RuntimeError):
    def __init__(self, what, code, name):
        super().__init__(f"{what}: {name} ({code})")
        self.code, self.name = code, name


# ------------------------------------------------------------------ the cubin itself (ELF)
def elf_info(image, entry):
    """Static shared bytes (.nv.shared.<entry>), parameter sizes (EIATTR_KPARAM_INFO) and the
    required block (EIATTR_REQNTID) as the cubin declares them; None where absent."""
    out = {"static_shared": None, "param_sizes": None, "reqntid": None}
    try:
        shoff, = struct.unpack_from("<Q", image, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", image, 0x3A)
        secs = [struct.unpack_from("<IIQQQQIIQQ", image, shoff + i * shentsize) for i in range(shnum)]
        stroff = secs[shstrndx][4]
        named = {}
        for s in secs:
            end = image.index(b"\0", stroff + s[0])
            named[image[stroff + s[0]:end].decode()] = (s[4], s[5])
    except (struct.error, ValueError, IndexError):
        return out
    if f".nv.shared.{entry}" in named:
        out["static_shared"] = named[f".nv.shared.{entry}"][1]
    elif any(n.startswith(".nv.info.") for n in named):
        out["static_shared"] = 0
    info = named.get(f".nv.info.{entry}")
    if info:
        data = image[info[0]:info[0] + info[1]]
        params = {}
        for m in re.finditer(re.escape(b"\x04\x17\x0c\x00"), data):
            v = data[m.end():m.end() + 12]
            if len(v) == 12:
                _, ordinal, _, word = struct.unpack("<IHHI", v)
                params[ordinal] = (word >> 18) & 0x3FFF
        if params:
            out["param_sizes"] = [params[i] for i in sorted(params)]
        m = re.search(re.escape(b"\x04\x10\x0c\x00"), data)
        if m:
            out["reqntid"] = list(struct.unpack_from("<III", data, m.end()))
    return out


# ------------------------------------------------------------------ drivers
class Driver:
    """libcuda.so.1 through ctypes."""
    fake = False

    def __init__(self):
        self.cu = ctypes.CDLL("libcuda.so.1")
        c = self.cu
        vp, cint, cuint = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint
        c.cuLaunchKernel.argtypes = [vp] + [cuint] * 7 + [vp, ctypes.POINTER(vp), vp]
        c.cuModuleLoadData.argtypes = [ctypes.POINTER(vp), ctypes.c_char_p]
        c.cuModuleGetFunction.argtypes = [ctypes.POINTER(vp), vp, ctypes.c_char_p]
        c.cuModuleUnload.argtypes = [vp]
        c.cuFuncGetAttribute.argtypes = [ctypes.POINTER(cint), cint, vp]
        c.cuFuncSetAttribute.argtypes = [vp, cint, cint]
        c.cuDeviceGetAttribute.argtypes = [ctypes.POINTER(cint), cint, cint]
        c.cuDeviceGetName.argtypes = [ctypes.c_char_p, cint, cint]
        c.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
        c.cuMemsetD8_v2.argtypes = [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t]
        c.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(vp), cint]
        c.cuDevicePrimaryCtxRelease_v2.argtypes = [cint]
        c.cuCtxSetCurrent.argtypes = [vp]
        self.dev = 0

    def name_of(self, r):
        s = ctypes.c_char_p()
        self.cu.cuGetErrorName(r, ctypes.byref(s))
        return s.value.decode() if s.value else f"CUDA error {r}"

    def ck(self, r, what):
        if r != 0:
            raise CudaError(what, r, self.name_of(r))

    def init(self):
        self.ck(self.cu.cuInit(0), "cuInit")
        d = ctypes.c_int()
        self.ck(self.cu.cuDeviceGet(ctypes.byref(d), 0), "cuDeviceGet")
        self.dev = d.value
        self.open_context()
        ver = ctypes.c_int()
        self.cu.cuDriverGetVersion(ctypes.byref(ver))
        name = ctypes.create_string_buffer(256)
        self.cu.cuDeviceGetName(name, 256, self.dev)
        return {"name": name.value.decode(), "driver_cuda": ver.value,
                "cc": f"{self.attr(DA_CC_MAJOR)}.{self.attr(DA_CC_MINOR)}",
                "sms": self.attr(DA_SMS), "shared_optin_max": self.attr(DA_MAX_SHARED_OPTIN)}

    def open_context(self):
        ctx = ctypes.c_void_p()
        self.ck(self.cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), self.dev), "cuDevicePrimaryCtxRetain")
        self.ck(self.cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def close_context(self):
        """After a sticky error: dropping the last reference destroys this process's context."""
        self.cu.cuDevicePrimaryCtxRelease_v2(self.dev)

    def attr(self, a):
        v = ctypes.c_int()
        self.ck(self.cu.cuDeviceGetAttribute(ctypes.byref(v), a, self.dev), f"device attribute {a}")
        return v.value

    def alloc_zeroed(self, nbytes):
        p = ctypes.c_uint64()
        self.ck(self.cu.cuMemAlloc_v2(ctypes.byref(p), nbytes), "cuMemAlloc")
        self.ck(self.cu.cuMemsetD8_v2(p.value, 0, nbytes), "cuMemsetD8")
        return p.value

    def load(self, image, entry):
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        self.ck(self.cu.cuModuleLoadData(ctypes.byref(mod), image), "cuModuleLoadData")
        self.ck(self.cu.cuModuleGetFunction(ctypes.byref(fn), mod, entry.encode()), "cuModuleGetFunction")
        return mod, fn

    def unload(self, mod):
        self.cu.cuModuleUnload(mod)

    def func_attr(self, fn, a):
        v = ctypes.c_int()
        self.ck(self.cu.cuFuncGetAttribute(ctypes.byref(v), a, fn), f"function attribute {a}")
        return v.value

    def set_max_dyn_shared(self, fn, nbytes):
        self.ck(self.cu.cuFuncSetAttribute(fn, FA_MAX_DYN_SHARED, nbytes), "cuFuncSetAttribute(MAX_DYNAMIC_SHARED)")

    def launch(self, fn, grid, block, shared, args):
        """args: ctypes values in .entry order. Returns the CUresult."""
        params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(v) for v in args])
        return self.cu.cuLaunchKernel(fn, grid[0], grid[1], grid[2], block, 1, 1, shared, None, params, None)

    def sync(self):
        return self.cu.cuCtxSynchronize()


class FakeDriver:
    """No GPU: records the calls and checks them as the real driver and the cubin would."""
    fake = True
    OPTIN_MAX = {"sm90": 232448, "sm80": 166912}  # H100/H200 and A100 opt-in maxima

    def __init__(self, arch):
        self.arch = arch
        self.calls = []
        self.allocs = []  # (base, size)
        self.next = 0x7F0000000000
        self.funcs = {}

    def name_of(self, r):
        return {1: "CUDA_ERROR_INVALID_VALUE", 700: "CUDA_ERROR_ILLEGAL_ADDRESS"}.get(r, f"CUDA error {r}")

    def init(self):
        cc = "9.0" if self.arch == "sm90" else "8.0"
        return {"name": f"fake driver (no GPU), compute capability {cc}", "driver_cuda": 13000,
                "cc": cc, "sms": 132, "shared_optin_max": self.OPTIN_MAX[self.arch]}

    def open_context(self):
        self.calls.append(("ctx",))

    def close_context(self):
        self.calls.append(("ctx-release",))

    def alloc_zeroed(self, nbytes):
        base = self.next
        self.next += (nbytes + 0xFFFF) & ~0xFFFF
        self.allocs.append((base, nbytes))
        return base

    def load(self, image, entry):
        if image[:4] != b"\x7fELF":
            raise CudaError("cuModuleLoadData", 200, "CUDA_ERROR_INVALID_IMAGE")
        info = elf_info(image, entry)
        if info["param_sizes"] is None:
            raise CudaError("cuModuleGetFunction", 500, "CUDA_ERROR_NOT_FOUND")
        fn = len(self.funcs) + 1
        self.funcs[fn] = {"info": info, "max_dyn": NO_OPTIN - (info["static_shared"] or 0)}
        self.calls.append(("load", entry))
        return fn, fn

    def unload(self, mod):
        self.calls.append(("unload", mod))

    def func_attr(self, fn, a):
        info = self.funcs[fn]["info"]
        return {FA_SHARED: info["static_shared"] or 0, FA_REGS: 0, FA_LOCAL: 0,
                FA_MAX_THREADS: (info["reqntid"] or [1024])[0], FA_MAX_DYN_SHARED: self.funcs[fn]["max_dyn"]}[a]

    def set_max_dyn_shared(self, fn, nbytes):
        static = self.funcs[fn]["info"]["static_shared"] or 0
        if nbytes + static > self.OPTIN_MAX[self.arch]:
            raise CudaError("cuFuncSetAttribute(MAX_DYNAMIC_SHARED)", 1, "CUDA_ERROR_INVALID_VALUE")
        self.funcs[fn]["max_dyn"] = nbytes
        self.calls.append(("optin", fn, nbytes))

    def launch(self, fn, grid, block, shared, args):
        f = self.funcs[fn]
        info = f["info"]
        self.calls.append(("launch", fn, grid, block, shared))
        sizes = [ctypes.sizeof(a) for a in args]
        if sizes != info["param_sizes"]:
            raise AssertionError(f"argument sizes {sizes} != the cubin's {info['param_sizes']}")
        if info["reqntid"] and info["reqntid"] != [block, 1, 1]:
            raise AssertionError(f"block {block} != the cubin's required {info['reqntid']}")
        if not all(1 <= g for g in grid) or grid[0] >= 2 ** 31 or grid[1] > 65535 or grid[2] > 65535:
            return 1
        if shared > f["max_dyn"]:  # the driver refuses it: CUDA_ERROR_INVALID_VALUE
            return 1
        return 0

    def check_pointer(self, p, need):
        """A pointer argument: 16-byte aligned, inside one allocation, `need` bytes available."""
        if p % 16:
            raise AssertionError(f"pointer {p:#x} not 16-byte aligned")
        for base, size in self.allocs:
            if base <= p < base + size:
                if p + need > base + size:
                    raise AssertionError(f"pointer {p:#x}: {need} bytes needed, {base + size - p} available")
                return
        raise AssertionError(f"pointer {p:#x} outside every allocation")

    def sync(self):
        self.calls.append(("sync",))
        return 0


# ------------------------------------------------------------------ tiny sizes and arguments
def cdiv(a, b):
    return -(-a // b)


TINY = {"B": 1, "H": 2, "KV": 1, "T": 16, "D": 64, "N": 4, "C": 64, "E": 256, "R": 2, "V": 64, "TB": 1}
INTS = {"causal": 1, "window": 0, "ignore_index": -1, "seed_lo": 1, "seed_hi": 0, "site_lo": 0,
        "site_hi": 0, "off_lo": 0, "off_hi": 0, "offset_lo": 0, "offset_hi": 0}
FLOATS = {"p_drop": 0.1, "p": 0.1, "keep": 1 / 0.9, "eps": 1e-5, "grad_scale": 1.0, "beta1": 0.9,
          "one_minus_beta1": 0.1, "beta2": 0.999, "one_minus_beta2": 0.001, "decay": 1.0,
          "step_size": 1e-3, "inv_bc2": 1.0}


def dims_of(m):
    """The tiny sizes for one kernel: the fixed ones, D within BLOCK_D, HALF = D / 2, P = the number
    of partial rows its producer writes (cdiv of rows by ROWS_PER_PROGRAM or elements by BLOCK)."""
    d = dict(TINY)
    cx = m.get("constexprs", {})
    d["D"] = min(d["D"], cx.get("BLOCK_D", d["D"]))
    d["HALF"] = d["D"] // 2
    if "ROWS_PER_PROGRAM" in cx:
        d["P"] = cdiv(d["N"], cx["ROWS_PER_PROGRAM"])
    elif "BLOCK" in cx and any(p["name"] == "PARTIAL" for p in m["params"]):
        d["P"] = cdiv(d["E"], cx["BLOCK"])
    else:
        d["P"] = 2
    assert d["D"] <= cx.get("BLOCK_D", 1 << 30) and d["H"] % d["KV"] == 0 and d["D"] % 2 == 0
    return d


def grid_of(m, d):
    g = eval(m["grid"], {"cdiv": cdiv, "__builtins__": {}}, dict(d))
    return tuple(int(x) for x in g)


def shape_bytes(p, d):
    """Bytes the role's shape ("in [B, H, T, D]") needs, in the pointer's element type."""
    s = re.search(r"\[([^\]]*)\]", p["role"])
    if not s:
        return None
    n = 1
    for item in s.group(1).split(","):
        item = item.strip()
        n *= int(item) if item.isdigit() else d[item]
    return n * ELEM[p["type"].lstrip("*")]


def arguments(m, d, base):
    """(ctypes values in .entry order, [(pointer, bytes needed)])."""
    vals, ptrs, slot = [], [], 0
    for p in m["params"]:
        n, t = p["name"], p["type"]
        if t.startswith("*"):
            if n in SCRATCH:
                vals.append(ctypes.c_uint64(0))
                continue
            need = shape_bytes(p, d)
            if need is None:
                raise ValueError(f"pointer {n}: no shape in its role {p['role']!r}")
            if need > SLOT or slot >= MAX_PTRS:
                raise ValueError(f"pointer {n}: {need} bytes do not fit a {SLOT}-byte slot")
            ptrs.append((base + slot * SLOT, need))
            vals.append(ctypes.c_uint64(base + slot * SLOT))
            slot += 1
        elif t == "i32":
            if n in d:
                vals.append(ctypes.c_int32(d[n]))
            elif n in INTS:
                vals.append(ctypes.c_int32(INTS[n]))
            else:
                raise ValueError(f"i32 parameter {n}: no tiny value known")
        elif t == "fp32":
            if n == "scale":
                v = 1 / math.sqrt(d["D"]) if "H" in {q["name"] for q in m["params"]} else \
                    (1 / (1 - FLOATS["p"]) if "p" in {q["name"] for q in m["params"]} else 1 / d["R"])
                vals.append(ctypes.c_float(v))
            elif n in FLOATS:
                vals.append(ctypes.c_float(FLOATS[n]))
            else:
                raise ValueError(f"fp32 parameter {n}: no tiny value known")
        else:
            raise ValueError(f"parameter {n}: type {t}")
    return vals, ptrs


# ------------------------------------------------------------------ one cubin
def smoke_one(drv, path, dev, base):
    m = json.load(open(path[:-len(".cubin")] + ".json"))
    name = os.path.basename(path)[:-len(".cubin")]
    entry = m["entry"]
    image = open(path, "rb").read()
    elf = elf_info(image, entry)
    rec = {"kind": "smoke", "cubin": name, "entry": entry}
    t0 = time.time()
    mod = None
    try:
        d = dims_of(m)
        grid = grid_of(m, d)
        block = m["block"][0]
        if block != 32 * m["num_warps"]:
            raise ValueError(f"json block {block} != 32 * num_warps {m['num_warps']}")
        dyn = int(m["shared_bytes"])
        vals, ptrs = arguments(m, d, base)
        if len(vals) != len(m["params"]):
            raise ValueError(f"{len(vals)} arguments for {len(m['params'])} parameters")
        rec.update(grid=list(grid), block=block, dyn_shared=dyn, nparams=len(vals))
        mod, fn = drv.load(image, entry)
        static = drv.func_attr(fn, FA_SHARED)
        rec.update(static_shared=static, regs=drv.func_attr(fn, FA_REGS),
                   local_bytes=drv.func_attr(fn, FA_LOCAL), max_threads=drv.func_attr(fn, FA_MAX_THREADS))
        # the json's static size (optional) and the ELF's must agree with the driver's
        for src, v in (("json", m.get("static_shared_bytes")), ("elf", elf["static_shared"])):
            if v is not None and v != static:
                rec.setdefault("notes", []).append(f"static shared: {src} says {v}, the driver {static}")
        if block > rec["max_threads"]:
            raise ValueError(f"block {block} > the function's max threads {rec['max_threads']}")
        if static + dyn > dev["shared_optin_max"]:
            rec.update(ok=False, error=f"refused: {static} + {dyn} bytes of shared memory > the "
                       f"device's opt-in maximum {dev['shared_optin_max']}")
            return rec
        optin = static + dyn > NO_OPTIN
        rec["optin"] = optin
        if optin:
            drv.set_max_dyn_shared(fn, dyn)
        if drv.fake:
            for p, need in ptrs:
                drv.check_pointer(p, need)
            if optin and drv.funcs[fn]["max_dyn"] < dyn:
                raise AssertionError("opt-in not applied")
        r = drv.launch(fn, grid, block, dyn, vals)
        if r != 0:
            rec.update(ok=False, error=drv.name_of(r), where="cuLaunchKernel")
            return rec
        r = drv.sync()
        if r != 0:
            rec.update(ok=False, error=drv.name_of(r), where="cuCtxSynchronize", sticky=True)
            return rec
        rec["ok"] = True
        # The committed launch.rs opts in only when the dynamic size alone exceeds 48 KB: where
        # that differs, show what the driver does without the opt-in (a fresh load: no attribute).
        if optin and dyn <= NO_OPTIN:
            mod2, fn2 = drv.load(image, entry)
            r2 = drv.launch(fn2, grid, block, dyn, vals)
            rec["without_optin"] = "ok" if r2 == 0 else drv.name_of(r2)
            if r2 == 0:
                rs = drv.sync()
                if rs != 0:
                    rec.update(without_optin=drv.name_of(rs), sticky=True)
            drv.unload(mod2)
    except CudaError as e:
        rec.update(ok=False, error=e.name, where=str(e))
    except (AssertionError, ValueError, KeyError) as e:
        rec.update(ok=False, error=f"{type(e).__name__}: {e}")
    finally:
        rec["ms"] = round(1000 * (time.time() - t0), 1)
        if mod is not None and not rec.get("sticky"):
            drv.unload(mod)
    return rec


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernels", default=os.path.join(ROOT, "candle-fused", "kernels"))
    ap.add_argument("--out", help="JSON lines file (appended to as it goes)")
    ap.add_argument("--fake", action="store_true", help="a fake driver in Python (no GPU)")
    ap.add_argument("--arch", choices=("sm80", "sm90"), help="with --fake: the cubins to check (sm90)")
    a = ap.parse_args(argv)
    out = open(a.out, "a") if a.out else None

    def emit(rec):
        line = json.dumps(rec)
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    drv = FakeDriver(a.arch or "sm90") if a.fake else Driver()
    try:
        dev = drv.init()
    except (OSError, CudaError) as e:
        emit({"kind": "smoke-device", "ok": False, "error": str(e)})
        return 1
    # 8.x -> sm80, 9.0 -> sm90 (sm_90a code runs on 9.0 only); anything else has no cubin
    arch = a.arch or ("sm90" if dev["cc"] == "9.0" else "sm80" if dev["cc"].startswith("8.") else None)
    dev.update(kind="smoke-device", arch=arch, fake=drv.fake)
    emit(dev)
    if arch is None:
        emit({"kind": "smoke-summary", "skipped": f"no cubins for compute capability {dev['cc']} "
              "(the launcher takes the composite path)"})
        return 3
    cubins = sorted(glob.glob(os.path.join(a.kernels, f"*.{arch}.cubin")))
    if not cubins:
        emit({"kind": "smoke-summary", "ok": False, "error": f"no *.{arch}.cubin in {a.kernels}"})
        return 1
    base = drv.alloc_zeroed(MAX_PTRS * SLOT)
    failed = []
    for path in cubins:
        rec = smoke_one(drv, path, dev, base)
        emit(rec)
        if not rec.get("ok"):
            failed.append(rec["cubin"])
        if rec.get("sticky"):  # the context is lost: a new one for the next cubin
            drv.close_context()
            drv.open_context()
            base = drv.alloc_zeroed(MAX_PTRS * SLOT)
    emit({"kind": "smoke-summary", "arch": arch, "cubins": len(cubins), "ok": len(cubins) - len(failed),
          "failed": failed, "fake": drv.fake})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
