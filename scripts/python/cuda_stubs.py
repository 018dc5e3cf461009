#!/usr/bin/env python3
"""Build do-nothing CUDA libraries so that PyPI's Linux torch wheel imports without its
multi-GB CUDA wheels (nvidia-*, cuda-*), for CPU-only use.

    python cuda_stubs.py SITE_PACKAGES/torch          (run by setup.sh)

PyPI's Linux x86_64 torch wheel is built against CUDA: libtorch_cuda.so, libtorch_python.so,
libtorch_cpu.so, ... list libcudart.so.13, libcublas.so.13, libcudnn.so.9, libnccl.so.2, ...
as DT_NEEDED, so `import torch` fails when those wheels are left out (`pip install --no-deps`).
CPU code never calls into them; the loader only needs (a) a file with each soname, (b) the
symbol-version nodes the torch libraries require of it (`readelf -V`), and (c) definitions of
the symbols bound at load time. This script reads all of that from the installed torch's own
ELF files (binutils' `readelf`), writes one C file per missing library defining every symbol
torch takes from it, and compiles it (`cc -shared`) into `torch/lib/` (on every torch
library's RPATH, as `$ORIGIN`, *after* the nvidia/* wheel directories: real CUDA wheels
installed later take precedence).

`cudaGetDeviceCount` reports zero devices; every other stub function returns 100
(cudaErrorNoDevice for the CUDA runtime) without touching its arguments, and the few
`...GetErrorString`-style functions return a fixed message; so `torch.cuda.is_available()` is
False and the CPU paths are the stock ones. A marker file
`torch/lib/CUDA_STUBS.txt` lists what was built.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

# CUDA libraries that may be stubbed: the runtime and math libraries torch links to. The
# driver (libcuda.so.1) is not: torch dlopen()s it itself, and only libcaffe2_nvrtc.so (loaded on
# demand for GPU JIT) links to it.
STUBBABLE = re.compile(
    r"^lib(cudart|cublas|cublasLt|cudnn|cufft|cufile|cupti|curand|cusolver|cusparse|cusparseLt"
    r"|nccl|nvrtc|nvrtc-builtins|nvshmem_host|nvJitLink|nvToolsExt)\.so(\.\d+)*$"
)
# Unversioned undefined symbols (libraries without symbol versioning) are attributed by prefix.
UNVERSIONED_PREFIX = [
    ("cusparseLt", "libcusparseLt.so"),
    ("cuFile", "libcufile.so"),
    ("nccl", "libnccl.so"),
    ("nvshmem", "libnvshmem_host.so"),
    ("cupti", "libcupti.so"),
    ("cudnn", "libcudnn.so"),
    ("cublasLt", "libcublasLt.so"),
    ("cublas", "libcublas.so"),
    ("cusolver", "libcusolver.so"),
    ("cusparse", "libcusparse.so"),
    ("cufft", "libcufft.so"),
    ("nvrtc", "libnvrtc.so"),
    ("cuda", "libcudart.so"),
]
STRING_FN = re.compile(r"(Error|Status)(String|Name)$|GetErrorString|GetLastError$")


def readelf(*args):
    return subprocess.run(
        ["readelf", "-W", *args], check=True, capture_output=True, text=True
    ).stdout


def elf_files(torch_dir):
    for d, _, files in os.walk(torch_dir):
        for f in files:
            p = os.path.join(d, f)
            if (f.endswith(".so") or ".so." in f) and not os.path.islink(p):
                with open(p, "rb") as fh:
                    if fh.read(4) == b"\x7fELF":
                        yield p


def needed(path):
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", readelf("-d", path))


def verneed(path):
    """version name -> file that must provide it"""
    out, cur = {}, None
    for line in readelf("-V", path).splitlines():
        m = re.search(r"File: (\S+)\s+Cnt:", line)
        if m:
            cur = m.group(1)
            continue
        m = re.search(r"Name: (\S+)\s+Flags:", line)
        if m and cur:
            out[m.group(1)] = cur
    return out


def undefined(path):
    """(name, version or None, type) of each undefined dynamic symbol"""
    for line in readelf("--dyn-syms", path).splitlines():
        f = line.split()
        if len(f) >= 8 and f[6] == "UND" and f[7]:
            name = f[7]
            ver = None
            if "@" in name:
                name, ver = name.split("@", 1)
                ver = ver.lstrip("@").split(" ")[0]
            yield name, ver, f[3]


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    torch_dir = os.path.abspath(sys.argv[1])
    lib_dir = os.path.join(torch_dir, "lib")
    for tool in ("readelf", "cc"):
        if shutil.which(tool) is None:
            sys.exit(f"cuda_stubs.py: `{tool}` not found (apt-get install binutils gcc)")
    files = list(elf_files(torch_dir))
    present = set(os.listdir(lib_dir))

    # stub soname -> {"versions": set, "syms": {name: (version, type)}}
    stubs = {}
    for p in files:
        for so in needed(p):
            if STUBBABLE.match(so) and so not in present:
                stubs.setdefault(so, {"versions": set(), "syms": {}})
    if not stubs:
        print("cuda_stubs.py: torch needs no CUDA library (a CPU build?): nothing to do")
        return
    by_base = {so.split(".so")[0] + ".so": so for so in stubs}
    for p in files:
        vn = verneed(p)
        for ver, so in vn.items():
            if so in stubs:
                stubs[so]["versions"].add(ver)
        for name, ver, typ in undefined(p):
            if ver is not None:
                so = vn.get(ver)
                if so in stubs:
                    stubs[so]["syms"][name] = (ver, typ)
            else:
                for prefix, base in UNVERSIONED_PREFIX:
                    if name.startswith(prefix):
                        so = by_base.get(base)
                        if so is not None and name not in stubs[so]["syms"]:
                            stubs[so]["syms"][name] = (None, typ)
                        break

    with tempfile.TemporaryDirectory() as tmp:
        for so, s in sorted(stubs.items()):
            c = [
                "/* CPU-only stand-in generated by scripts/python/cuda_stubs.py */",
                'static const char msg[] = "CUDA unavailable: CPU-only torch (stub library)";',
            ]
            for name, (ver, typ) in sorted(s["syms"].items()):
                if name == "cudaGetDeviceCount":
                    # zero devices, success: torch and the profiler then skip CUDA quietly
                    c.append(f"int {name}(int *n) {{ if (n) *n = 0; return 0; }}")
                elif typ == "OBJECT":
                    c.append(f"long {name}[64];")
                elif STRING_FN.search(name) and "GetLastError" not in name:
                    c.append(f"const char *{name}(void) {{ return msg; }}")
                else:
                    c.append(f"int {name}(void) {{ return 100; }}")
            src = os.path.join(tmp, so + ".c")
            with open(src, "w") as f:
                f.write("\n".join(c) + "\n")
            cmd = ["cc", "-shared", "-fPIC", "-O1", "-w", "-o", os.path.join(lib_dir, so), src,
                   f"-Wl,-soname,{so}"]
            versions = sorted(s["versions"])
            if versions:
                # every symbol torch binds with a version goes in the node of that version
                script = []
                for v in versions:
                    names = [n for n, (sv, _) in s["syms"].items() if sv == v]
                    body = " ".join(f"{n};" for n in sorted(names))
                    script.append(f"{v} {{ global: {body} }};")
                vs = os.path.join(tmp, so + ".map")
                with open(vs, "w") as f:
                    f.write("\n".join(script) + "\n")
                cmd.append(f"-Wl,--version-script={vs}")
            subprocess.run(cmd, check=True)
            print(f"cuda_stubs.py: {so}: {len(s['syms'])} symbols, versions {versions or '-'}")
    with open(os.path.join(lib_dir, "CUDA_STUBS.txt"), "w") as f:
        f.write(
            "Do-nothing stand-ins for CUDA libraries, built by scripts/python/cuda_stubs.py so "
            "that this CUDA build of torch runs on CPU without the nvidia-* wheels:\n"
        )
        f.write("".join(f"{so}\n" for so in sorted(stubs)))


if __name__ == "__main__":
    main()
