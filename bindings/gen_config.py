#!/usr/bin/env python3
"""Generates the config accessors of the Java and Rust bindings from kvret_config in include/kvret.h, so that a new
config field is one edit of the header (plus its default and validation in the library) and a run of this script.
It also generates each per-design parameter struct's class (kvret_pq_params -> PqParams.java, and the Rust
PqParams in bindings/rust/kvret/src/params.rs), whole files.

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

RUST_PARAMS = ROOT / "bindings" / "rust" / "kvret" / "src" / "params.rs"

# The per-design parameter structs: group (the kvret_config pointer and kvret_<group>_params), the prefix of the
# group's flat fields in kvret_config (whose enum or boolean kind a struct field shares), the class name.
GROUPS = {"pq": ("pq_", "PqParams"), "cluster": ("cluster_", "ClusterParams"), "quant": ("quant_", "QuantParams"),
          "crush": ("hamming_", "CrushParams"), "session": ("session_", "SessionParams")}

SKIP = {"struct_size", "device_type", "device_id", "disk_path", "session_shared_url", *GROUPS}
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


def fields(struct="kvret_config"):
    """(C type, name, doc) of every field of a struct of kvret.h, in order."""
    text = HEADER.read_text()
    body = re.search(rf"typedef struct {struct} \{{(.*?)\}} {struct};", text, re.S).group(1)
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


def struct_doc(struct):
    """The doc comment in front of a struct's typedef, as one line."""
    text = HEADER.read_text()
    m = re.search(rf"/\*\*((?:(?!\*/).)*?)\*/\s*typedef struct {struct} \{{", text, re.S)
    return " ".join(line.strip().lstrip("*").strip() for line in m.group(1).split("\n")).strip()


def java_params(group):
    """The whole of org/kvret/<Group>Params.java."""
    prefix, cls = GROUPS[group]
    struct, native = f"kvret_{group}_params", f"Native{cls}"
    getters, setters, copies = [], [], []
    for ctype, name, doc in fields(struct):
        if name == "struct_size":
            continue
        flat, c, s = prefix + name, camel(name), swig(name)
        if flat in ENUMS:
            jt = ENUMS[flat][0]
            get, put = f"{jt}.fromCode(fields.get{s}())", "value.code"
        elif flat in BOOLS:
            jt, get, put = "boolean", f"fields.get{s}() != 0", "value ? 1 : 0"
        else:
            jt, get, put = JAVA_TYPES[ctype], f"fields.get{s}()", "value"
        getters += javadoc(f"{struct}.{name}: {doc}", "  ")
        getters += [f"  public {jt} {c}() {{", f"    return {get};", "  }", ""]
        setters += javadoc(f"{struct}.{name}: {doc}", "    ")
        setters += [f"    public Builder {c}({jt} value) {{", f"      fields.set{s}({put});", "      return this;",
                    "    }", ""]
        copies.append(f"    to.set{s}(from.get{s}());")
    doc = struct_doc(struct)
    lines = ["// Generated from include/kvret.h by bindings/gen_config.py; do not edit by hand.",
             "package org.kvret;", "", "import java.lang.ref.Cleaner;", ""]
    lines += javadoc(f"{doc} An immutable {struct}: build one with {{@link #builder()}} and give it to "
                     f"{{@link Config.Builder#{group}}}. Its values are checked when the context is made "
                     f"(KvretException, Status.INVALID_ARGUMENT, naming the field, e.g. config.{group}."
                     f"{fields(struct)[1][1]}).", "")
    lines += [f"public final class {cls} {{", "  private static final Cleaner CLEANER = NativeHandles.CLEANER;", "",
              f"  private final {native} fields;", "",
              f"  private {cls}({native} fields) {{", "    this.fields = fields;",
              "    CLEANER.register(this, fields::delete);", "  }", "",
              "  /** The library's defaults. */", f"  public static {cls} defaults() {{",
              "    return builder().build();",
              "  }", "", "  public static Builder builder() {", "    return new Builder();", "  }", "",
              "  /** A builder starting from this struct's values. */", "  public Builder toBuilder() {",
              "    Builder builder = new Builder();", "    copy(fields, builder.fields);", "    return builder;",
              "  }", "",
              f"  {native} fields() {{", "    return fields;", "  }", "",
              f"  private static void copy({native} from, {native} to) {{", *copies, "  }", ""]
    lines += getters
    lines += ["  public static final class Builder {", f"    private final {native} fields = new {native}();", "",
              "    private Builder() {", "      CLEANER.register(this, fields::delete);",
              f"      KvretNative.{struct}_init(fields);", "    }", "",
              f"    public {cls} build() {{", f"      {native} copy = new {native}();",
              f"      KvretNative.{struct}_init(copy);", "      copy(fields, copy);", f"      return new {cls}(copy);",
              "    }", ""]
    lines += setters[:-1]
    lines += ["  }", "}", ""]
    return "\n".join(lines)


def rust_params():
    """The whole of bindings/rust/kvret/src/params.rs."""
    out = ["// Generated from include/kvret.h by bindings/gen_config.py; do not edit by hand.",
           "//! The per-design parameter structs (`kvret_pq_params`, ...), given to [`Config`](crate::Config) by",
           "//! [`Config::pq`](crate::Config::pq) and its siblings.", "",
           "use crate::config::{store_int, ConfigInt, Importance, SessionPolicy};",
           "use crate::error::{rust_error, Result, Status};", "use crate::sys;", ""]
    for group, (prefix, cls) in GROUPS.items():
        struct = f"kvret_{group}_params"
        doc = struct_doc(struct)
        out += [f"/// {line}" for line in wrap(f"`{struct}`: {doc} Setters never fail: a value out of range is "
                                              "reported by `Context::new`, naming the field, e.g. "
                                              f"`config.{group}.{fields(struct)[1][1]}`.", 116)]
        out += ["#[derive(Debug, Clone)]", f"pub struct {cls} {{", f"    raw: sys::{struct},",
                "    rejected: Vec<(&'static str, String)>,", "}", "",
                f"impl Default for {cls} {{", "    fn default() -> Self {", "        Self::new()", "    }", "}", "",
                f"impl {cls} {{", f"    /// The library's defaults (`{struct}_init`).", "    pub fn new() -> Self {",
                f"        // SAFETY: an all-zero {struct} is a valid value to initialize.",
                f"        let mut raw: sys::{struct} = unsafe {{ std::mem::zeroed() }};",
                f"        crate::error::check(unsafe {{ sys::{struct}_init(&mut raw) }}).expect(\"{struct}_init\");",
                f"        {cls} {{ raw, rejected: Vec::new() }}", "    }", "",
                f"    /// All fields, as `{struct}`.", f"    pub fn raw(&self) -> &sys::{struct} {{",
                "        &self.raw",
                "    }", "",
                "    /// The values the setters could not store, as an error (status InvalidArgument).",
                "    pub(crate) fn check(&self) -> Result<()> {", "        match self.rejected.first() {",
                "            None => Ok(()),",
                "            Some((_, message)) => Err(rust_error(Status::InvalidArgument, message)),", "        }",
                "    }", ""]
        for ctype, name, fdoc in fields(struct):
            if name == "struct_size":
                continue
            flat = prefix + name
            if flat in ENUMS:
                ty, conv = ENUMS[flat][1], "value as i32"
            elif flat in BOOLS:
                ty, conv = "bool", "value.into()"
            elif ctype in RUST_INT_FIELDS:
                ty, conv = RUST_TYPES[ctype], f'store_int(&mut self.rejected, "{group}.{name}", value)'
            else:
                ty, conv = RUST_TYPES[ctype], "value"
            out += [f"    /// `{struct}.{name}`: {line}" if i == 0 else f"    /// {line}"
                    for i, line in enumerate(wrap(fdoc, 100))]
            out += [f"    pub fn {name}(mut self, value: {ty}) -> Self {{", f"        self.raw.{name} = {conv};",
                    "        self", "    }", ""]
        out = out[:-1] + ["}", ""]
    return "\n".join(out)


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
    outputs = [(JAVA, java, java_new), (RUST, rust, rust_new)]
    for group, (_, cls) in GROUPS.items():
        path = JAVA.parent / f"{cls}.java"
        outputs.append((path, path.read_text() if path.exists() else "", java_params(group)))
    outputs.append((RUST_PARAMS, RUST_PARAMS.read_text() if RUST_PARAMS.exists() else "", rust_params()))
    stale = [p for p, old, new in outputs if old != new]
    if "--check" in sys.argv:
        if stale:
            print("not generated from include/kvret.h (run python3 bindings/gen_config.py):",
                  ", ".join(str(p.relative_to(ROOT)) for p in stale))
            return 1
        print(f"config accessors match kvret.h ({len(fs)} fields, {len(GROUPS)} parameter structs)")
        return 0
    for path, old, new in outputs:
        if old != new:
            path.write_text(new)
    print("rewrote", ", ".join(str(p.relative_to(ROOT)) for p in stale) or "nothing")
    return 0


if __name__ == "__main__":
    sys.exit(main())
