#!/usr/bin/env python3
"""Generates the config accessors of the Java and Rust bindings from kvret_config in include/kvret.h, so that a new
config field is one edit of the header (plus its default and validation in the library) and a run of this script.

    python3 bindings/gen_config.py          # rewrites the generated blocks
    python3 bindings/gen_config.py --check  # exits 1 if a generated block is not what the header gives (CTest)

Each binding file holds its generated code between marker comments; everything else in it is written by hand.
Fields whose accessors are hand-written (struct_size, the device pair, the strings disk_path and session_shared_url)
are skipped; enum and boolean fields are listed below, every other field maps by its C type."""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
HEADER = ROOT / "include" / "kvret.h"
JAVA = ROOT / "bindings" / "java" / "src" / "org" / "kvret" / "Config.java"
RUST = ROOT / "bindings" / "rust" / "kvret" / "src" / "config.rs"

SKIP = {"struct_size", "device_type", "device_id", "disk_path", "session_shared_url"}
ENUMS = {"kv_dtype": ("KvDtype", "KvDtype"), "gqa_fold": ("GqaFold", "GqaFold"),
         "index_kind": ("IndexKind", "IndexKind"), "cache_policy": ("CachePolicy", "CachePolicy"),
         "session_policy": ("SessionPolicy", "SessionPolicy"), "rope_layout": ("RopeLayout", "RopeLayout"),
         "hamming_importance": ("Importance", "Importance")}  # Java, Rust
BOOLS = {"background_build", "check_finite", "rope_keys"}
JAVA_TYPES = {"int32_t": "int", "int64_t": "long", "uint64_t": "long", "float": "float"}
# Rust: the integer counts and sizes (every int32_t/int64_t field is validated >= 0 by the library: no negative
# sentinel) take any primitive integer (`impl ConfigInt`: usize like the rest of the Rust API, or the C type); a value
# the C field cannot hold is recorded by Config::int_field and refused by Context::new.
RUST_TYPES = {"int32_t": "impl ConfigInt", "int64_t": "impl ConfigInt", "uint64_t": "u64", "float": "f32"}
RUST_INT_FIELDS = {"int32_t", "int64_t"}


def fields():
    """(C type, name, doc) of every kvret_config field, in order."""
    text = HEADER.read_text()
    body = re.search(r"typedef struct kvret_config \{(.*?)\} kvret_config;", text, re.S).group(1)
    out = []
    for m in re.finditer(r"^\s*([a-z_0-9 ]+?\*?)\s+([a-z_0-9]+);\s*/\*\*<(.*?)\*/", body, re.S | re.M):
        doc = " ".join(line.strip() for line in m.group(3).split("\n")).strip()
        out.append((m.group(1).strip(), m.group(2), doc))
    return out


def camel(name):
    head, *rest = name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def swig(name):
    return name[:1].upper() + name[1:]


def javadoc(doc, indent):
    words, lines, line = doc.replace("*/", "* /").split(), [], ""
    for w in words:
        if len(line) + len(w) + 1 > 100 - len(indent) - 3 and line:
            lines.append(line)
            line = w
        else:
            line = f"{line} {w}" if line else w
    lines.append(line)
    if len(lines) == 1 and len(indent) + 8 + len(lines[0]) <= 120:
        return [f"{indent}/** {lines[0]} */"]
    return [f"{indent}/**"] + [f"{indent} * {l}" for l in lines] + [f"{indent} */"]


def java_blocks(fs):
    getters, setters = [], []
    for ctype, name, doc in fs:
        if name in SKIP:
            continue
        c, s = camel(name), swig(name)
        if name in ENUMS:
            jt = ENUMS[name][0]
            get, put = f"{jt}.fromCode(fields.get{s}())", "value.code"
        elif name in BOOLS:
            jt, get, put = "boolean", f"fields.get{s}() != 0", "value ? 1 : 0"
        else:
            jt, get, put = JAVA_TYPES[ctype], f"fields.get{s}()", "value"
        getters += javadoc(f"kvret_config.{name}: {doc}", "  ")
        getters += [f"  public {jt} {c}() {{", f"    return {get};", "  }", ""]
        setters += javadoc(f"kvret_config.{name}: {doc}", "    ")
        setters += [f"    public Builder {c}({jt} value) {{", f"      fields.set{s}({put});", "      return this;",
                    "    }", ""]
    return getters[:-1], setters[:-1]


def rust_block(fs):
    out = []
    for ctype, name, doc in fs:
        if name in SKIP:
            continue
        if name in ENUMS:
            ty, conv = ENUMS[name][1], "value as i32"
        elif name in BOOLS:
            ty, conv = "bool", "value.into()"
        elif ctype in RUST_INT_FIELDS:
            ty, conv = RUST_TYPES[ctype], f'self.int_field("{name}", value)'
        else:
            ty, conv = RUST_TYPES[ctype], "value"
        out += [f"    /// `kvret_config.{name}`: {line}" if i == 0 else f"    /// {line}"
                for i, line in enumerate(wrap(doc, 100))]
        out += [f"    pub fn {name}(mut self, value: {ty}) -> Self {{", f"        self.raw.{name} = {conv};",
                "        self", "    }", ""]
    return out[:-1]


def wrap(text, width):
    lines, line = [], ""
    for w in text.split():
        if line and len(line) + len(w) + 1 > width:
            lines.append(line)
            line = w
        else:
            line = f"{line} {w}" if line else w
    return lines + [line]


def replace(text, begin, end, lines, path):
    pattern = re.compile(rf"(^[ \t]*{re.escape(begin)}\n)(.*?)(^[ \t]*{re.escape(end)}$)", re.S | re.M)
    if not pattern.search(text):
        sys.exit(f"{path}: markers '{begin}' ... '{end}' not found")
    return pattern.sub(lambda m: m.group(1) + "\n".join(lines) + "\n" + m.group(3), text, count=1)


def main():
    fs = fields()
    getters, setters = java_blocks(fs)
    java = JAVA.read_text()
    java_new = replace(java, "// <generated getters>", "// </generated getters>", getters, JAVA)
    java_new = replace(java_new, "// <generated setters>", "// </generated setters>", setters, JAVA)
    rust = RUST.read_text()
    rust_new = replace(rust, "// <generated setters>", "// </generated setters>", rust_block(fs), RUST)
    stale = [p for p, old, new in ((JAVA, java, java_new), (RUST, rust, rust_new)) if old != new]
    if "--check" in sys.argv:
        if stale:
            print("not generated from include/kvret.h (run python3 bindings/gen_config.py):",
                  ", ".join(str(p.relative_to(ROOT)) for p in stale))
            return 1
        print(f"config accessors match kvret.h ({len(fs)} fields)")
        return 0
    JAVA.write_text(java_new)
    RUST.write_text(rust_new)
    print("rewrote", ", ".join(str(p.relative_to(ROOT)) for p in stale) or "nothing")
    return 0


if __name__ == "__main__":
    sys.exit(main())
