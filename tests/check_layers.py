#!/usr/bin/env python3
"""The include layering of src/ (docs/architecture.md): a file (C++ and CUDA sources and headers alike) includes only
its own folder and the folders below it. Exits 1, listing the offending includes, when an arrow runs back up, or
when it finds no CUDA source to read (the check would then miss the backend's device code)."""
import pathlib
import re
import sys

ORDER = ["core", "store", "select", "index", "fetch", "backend", "engine", "session", "c_api"]  # bottom to top
root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parents[1]) / "src"
bad = []
read_cuda = 0
for path in sorted(root.rglob("*")):
    if path.suffix not in (".cpp", ".hpp", ".h", ".cu", ".cuh") or path.parent.name not in ORDER:
        continue
    read_cuda += path.suffix in (".cu", ".cuh")
    rank = ORDER.index(path.parent.name)
    for line in path.read_text().splitlines():
        m = re.match(r'\s*#\s*include\s+"([a-z_]+)/', line)
        if m and m.group(1) in ORDER and ORDER.index(m.group(1)) > rank:
            bad.append(f"{path.relative_to(root)}: {line.strip()}")
if read_cuda == 0:
    bad.append("no .cu file found under src/: the layering of the device code is not checked")
unknown = sorted({p.name for p in root.iterdir() if p.is_dir()} - set(ORDER))
if unknown:
    bad.append(f"folders missing from the layer order: {', '.join(unknown)}")
print("\n".join(bad) if bad else f"layering ok: {' < '.join(ORDER)}")
sys.exit(1 if bad else 0)
