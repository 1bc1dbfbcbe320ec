#!/usr/bin/env python3
"""Lists a core Wasm module's imports and exports (section 2 and 7 of the binary).

Usage: wasm_imports.py MODULE.wasm  — exits 1 when the module imports anything.
"""
import sys


def leb(data, i):
    result = shift = 0
    while True:
        b = data[i]
        i += 1
        result |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return result, i


def name(data, i):
    n, i = leb(data, i)
    return data[i : i + n].decode(), i + n


def main(path):
    data = open(path, "rb").read()
    assert data[:8] == b"\0asm\x01\0\0\0", "not a core Wasm module"
    i, imports, exports = 8, [], []
    while i < len(data):
        section, i = data[i], i + 1
        size, i = leb(data, i)
        end = i + size
        if section in (2, 7):
            count, j = leb(data, i)
            for _ in range(count):
                if section == 2:
                    module, j = name(data, j)
                    field, j = name(data, j)
                    kind = data[j]
                    imports.append(f"{module}.{field} (kind {kind})")
                    # Skip the import's type: func idx, table, memory, global, tag.
                    j += 1
                    if kind == 0 or kind == 4:
                        _, j = leb(data, j + (1 if kind == 4 else 0))
                    elif kind == 1:
                        j += 1
                        flags, j = leb(data, j)
                        _, j = leb(data, j)
                        if flags & 1:
                            _, j = leb(data, j)
                    elif kind == 2:
                        flags, j = leb(data, j)
                        _, j = leb(data, j)
                        if flags & 1:
                            _, j = leb(data, j)
                    elif kind == 3:
                        j += 2
                else:
                    field, j = name(data, j)
                    kind = data[j]
                    _, j = leb(data, j + 1)
                    exports.append(f"{field} (kind {kind})")
        i = end
    print(f"{path}: {len(data)} bytes")
    print(f"imports ({len(imports)}):", *imports, sep="\n  ")
    print(f"exports ({len(exports)}):", *exports, sep="\n  ")
    return 1 if imports else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
