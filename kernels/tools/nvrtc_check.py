#!/usr/bin/env python3
"""Compile kernel sources with NVRTC (no GPU needed) and print ptxas's resource report.

usage: LD_LIBRARY_PATH=<nvrtc lib dir> python3 kernels/tools/nvrtc_check.py src/foo.cu [arch]

Our own `#include "x.cuh"` lines are inlined, as the Rust loader does. Prints the log and the
`.entry` parameter lists of the PTX. A development aid; CI runs the Rust test instead.
"""
import ctypes, os, re, sys

def inline(path, seen=None):
    seen = set() if seen is None else seen
    out = []
    for line in open(path):
        m = re.match(r'\s*#include\s+"([^"]+)"', line)
        if m:
            inc = os.path.normpath(os.path.join(os.path.dirname(path), m.group(1)))
            if inc not in seen:
                seen.add(inc)
                out.append(inline(inc, seen))
            continue
        if line.strip() == "#pragma once":
            continue
        out.append(line)
    return "".join(out)

def main():
    src_path = sys.argv[1]
    arch = sys.argv[2] if len(sys.argv) > 2 else "sm_90a"
    lib = ctypes.CDLL("libnvrtc.so.13")
    src = inline(src_path).encode()
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, src_path.encode(), 0, None, None) == 0
    opts = [f"-arch={arch}".encode(), b"-std=c++17", b"--ptxas-options=-v", b"-lineinfo"]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    print(log.value.decode())
    if rc != 0:
        print("COMPILE FAILED", rc)
        sys.exit(1)
    # PTX for the parameter lists (compile again for compute_ to get PTX text).
    lib.nvrtcGetPTXSize.restype = ctypes.c_int
    if lib.nvrtcGetPTXSize(prog, ctypes.byref(n)) == 0 and n.value > 0:
        ptx = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetPTX(prog, ptx)
        for m in re.finditer(r"\.entry\s+(\w+)\s*\(([^)]*)\)", ptx.value.decode()):
            params = re.findall(r"\.param\s+\.(\w+)", m.group(2))
            print("entry", m.group(1), params)
    else:
        print("(no PTX from an sm_ target; use compute_90a to list entries)")

main()
