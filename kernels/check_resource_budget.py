#!/usr/bin/env python3
"""Static gate of the CUDA kernels: compares the built objects of kernels/ with kernels/resource_budget.txt.

For every kernel (__global__ function) in the given object files, and every architecture it was compiled for
(one SASS section per entry of CMAKE_CUDA_ARCHITECTURES), `cuobjdump -res-usage` gives its registers, stack,
static shared memory and local memory. Every kernel must match a `kernel` line of the budget (the first
that matches), use at most its registers and static shared memory, and no stack and no local memory (no spills).
Every `kernel` line must match at least one kernel (no stale lines). `sass-require` / `sass-forbid` lines check
the disassembly (`cuobjdump -sass`, which needs nvdisasm) of the kernels they match: at least one instruction /
no instruction matching the regular expression. A line holds for every architecture unless it names one
(`arch sm_XY` after the kernel pattern); the first line that matches both the kernel and its architecture applies.
A line naming an architecture that was not built is not stale.

Usage: check_resource_budget.py --budget FILE --cuobjdump PATH [--nvdisasm PATH] OBJECT...
Objects may be given as ';'-separated lists (CMake's $<TARGET_OBJECTS>); only objects compiled from kernels/*.cu
are read. Exit status 0 when every check holds, 1 otherwise.
"""
import argparse
import fnmatch
import os
import re
import shutil
import subprocess
import sys


def demangle(names):
    cxxfilt = shutil.which("c++filt")
    if cxxfilt is None or not names:
        return {n: n for n in names}
    out = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return dict(zip(names, out.splitlines()))


def read_budget(path):
    kernels, sass = [], []
    with open(path) as f:
        for number, raw in enumerate(f, 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            words = line.split()
            where = f"{path}:{number}"
            arch = None
            if len(words) >= 4 and words[2] == "arch":
                arch = words[3]
                words = words[:2] + words[4:]
            if words[0] == "kernel" and len(words) == 6 and words[2] == "regs" and words[4] == "smem":
                kernels.append({"glob": words[1], "arch": arch, "regs": int(words[3]), "smem": int(words[5]),
                                "where": where, "used": 0})
            elif words[0] in ("sass-require", "sass-forbid") and len(words) >= 3:
                sass.append({"kind": words[0], "glob": words[1], "arch": arch,
                             "regex": re.compile(" ".join(words[2:])), "where": where, "used": 0})
            else:
                sys.exit(f"{where}: cannot parse: {raw.rstrip()}")
    return kernels, sass


def applies(rule, name, arch):
    return fnmatch.fnmatchcase(name, rule["glob"]) and rule["arch"] in (None, arch)


def res_usage(cuobjdump, obj):
    """{(arch, mangled name): {REG, STACK, SHARED, LOCAL}} of the SASS (elf) sections of `obj`."""
    out = subprocess.run([cuobjdump, "-res-usage", obj], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{cuobjdump} -res-usage {obj} failed:\n{out.stderr}")
    usage = {}
    name = None
    arch = "?"
    for line in out.stdout.splitlines():
        m = re.match(r"\s*arch = (\S+)", line)
        if m:
            arch = m.group(1)
            continue
        m = re.match(r"\s*Function (\S+):\s*$", line)
        if m:
            name = m.group(1)
            continue
        if name is not None and "REG:" in line:
            fields = dict(re.findall(r"(\w+(?:\[\d+\])?):(\d+)", line))
            usage[(arch, name)] = {k: int(fields.get(k, 0)) for k in ("REG", "STACK", "SHARED", "LOCAL")}
            name = None
    return usage


def sass_by_function(cuobjdump, obj):
    out = subprocess.run([cuobjdump, "-sass", obj], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{cuobjdump} -sass {obj} failed (it needs nvdisasm):\n{out.stderr}")
    functions = {}
    name = None
    arch = "?"
    for line in out.stdout.splitlines():
        m = re.match(r"\s*arch = (\S+)", line)
        if m:
            arch = m.group(1)
            name = None
            continue
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            name = (arch, m.group(1))
            functions[name] = []
            continue
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;", line)
        if name is not None and m:
            functions[name].append(m.group(1))
    return functions


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", required=True)
    parser.add_argument("--cuobjdump", required=True)
    parser.add_argument("--nvdisasm", default="")
    parser.add_argument("--all-objects", action="store_true", help="read every object given, not only kernels/")
    parser.add_argument("objects", nargs="+")
    args = parser.parse_args()

    if not args.cuobjdump or args.cuobjdump.endswith("NOTFOUND") or not os.path.exists(args.cuobjdump):
        sys.exit(f"cuobjdump not found ({args.cuobjdump!r}): install it (scripts/install-deps.sh installs the "
                 "nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels) and configure again")
    if args.nvdisasm and not args.nvdisasm.endswith("NOTFOUND"):
        os.environ["PATH"] = os.path.dirname(os.path.abspath(args.nvdisasm)) + os.pathsep + os.environ["PATH"]

    objects = [o for arg in args.objects for o in arg.split(";") if o]
    if not args.all_objects:
        objects = [o for o in objects if re.search(r"(^|[/\\])kernels[/\\][^/\\]+\.cu\.o(bj)?$", o)]
    if not objects:
        sys.exit("no object of kernels/*.cu given")

    kernels, sass_rules = read_budget(args.budget)
    failures = []
    checked = 0
    built = set()  # the architectures of the objects' SASS
    for obj in sorted(objects):
        usage = res_usage(args.cuobjdump, obj)
        built.update(arch for arch, _ in usage)
        names = demangle(sorted({mangled for _, mangled in usage}))
        sass = None
        for (arch, mangled), res in sorted(usage.items(), key=lambda kv: (names[kv[0][1]], kv[0][0])):
            name = names[mangled]
            checked += 1
            rule = next((k for k in kernels if applies(k, name, arch)), None)
            status = []
            if rule is None:
                status.append("no budget line")
            else:
                rule["used"] += 1
                if res["REG"] > rule["regs"]:
                    status.append(f"REG {res['REG']} > {rule['regs']}")
                if res["SHARED"] > rule["smem"]:
                    status.append(f"SHARED {res['SHARED']} > {rule['smem']}")
            if res["STACK"] != 0:
                status.append(f"STACK {res['STACK']} != 0")
            if res["LOCAL"] != 0:
                status.append(f"LOCAL {res['LOCAL']} != 0 (spills or local arrays)")
            for s in sass_rules:
                if not applies(s, name, arch):
                    continue
                s["used"] += 1
                if sass is None:
                    sass = sass_by_function(args.cuobjdump, obj)
                hits = [i for i in sass.get((arch, mangled), []) if s["regex"].search(i)]
                if s["kind"] == "sass-require" and not hits:
                    status.append(f"no instruction matches /{s['regex'].pattern}/ ({s['where']})")
                if s["kind"] == "sass-forbid" and hits:
                    status.append(f"{len(hits)} instructions match /{s['regex'].pattern}/, e.g. {hits[0]} "
                                  f"({s['where']})")
            line = (f"{'FAIL' if status else 'ok  '} REG {res['REG']:3d} SHARED {res['SHARED']:6d} "
                    f"STACK {res['STACK']} LOCAL {res['LOCAL']}  {arch:7s} {name}")
            print(line + ("  <- " + "; ".join(status) if status else ""))
            if status:
                failures.append(f"{os.path.basename(obj)}: {arch}: {name}: {'; '.join(status)}")
    for k in kernels + sass_rules:
        if k["used"] == 0 and (k["arch"] is None or k["arch"] in built):
            failures.append(f"{k['where']}: stale line, it matches no kernel: {k['glob']}")
    print(f"{checked} kernels (one per architecture built) in {len(objects)} objects checked against {args.budget}")
    if failures:
        print(f"\n{len(failures)} budget violations:", file=sys.stderr)
        for f in failures:
            print("  " + f, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
