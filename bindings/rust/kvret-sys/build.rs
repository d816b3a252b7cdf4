//! Finds libkvret and its header, with no external crates:
//!  - `KVRET_LIB_DIR` (and optionally `KVRET_INCLUDE_DIR`): a build tree or any directory holding libkvret.so;
//!  - otherwise `pkg-config` (or `$PKG_CONFIG`), requiring kvret >= 0.1.0 and < 0.2.0 (the 0.1 ABI). A copy of
//!    this crate installed by `cmake --install` (`<prefix>/share/kvret/rust/kvret-sys`) looks in its own prefix's
//!    `pkgconfig` directory first, so that it links the libkvret installed beside it with no `PKG_CONFIG_PATH`.
//!
//! The directory of the libkvret linked is passed on as `DEP_KVRET_LIBDIR` to the build scripts of crates that
//! depend on this one: a program's build script can make it its run path (Cargo does not pass a dependency's
//! link arguments on to a program).
//!
//! It also compiles and runs a tiny C program (with `$CC` or `cc`) that prints the size and field offsets of every
//! struct in kvret.h, and turns them into a generated test, so that the Rust declarations cannot drift from the
//! header's layout. Without a working C compiler (or when cross-compiling) that test is generated as a no-op.

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const MIN_VERSION: &str = "0.1.0";
const MAX_VERSION_EXCLUSIVE: &str = "0.2.0";

fn main() {
    for var in ["KVRET_LIB_DIR", "KVRET_INCLUDE_DIR", "PKG_CONFIG", "PKG_CONFIG_PATH", "PKG_CONFIG_LIBDIR", "CC"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let (lib_dirs, include_dirs) = match env::var_os("KVRET_LIB_DIR") {
        Some(lib_dir) => {
            let include = env::var_os("KVRET_INCLUDE_DIR")
                .map(PathBuf::from)
                .unwrap_or_else(|| manifest_dir.join("../../../include"));
            (vec![PathBuf::from(lib_dir)], vec![include])
        }
        None => pkg_config(),
    };
    for dir in &lib_dirs {
        println!("cargo:rustc-link-search=native={}", dir.display());
    }
    if let Some(dir) = lib_dirs.first() {
        println!("cargo:libdir={}", dir.display());
    }
    println!("cargo:rustc-link-lib=dylib=kvret");

    let header = include_dirs
        .iter()
        .map(|dir| dir.join("kvret.h"))
        .find(|path| path.exists())
        .unwrap_or_else(|| panic!("kvret.h not found in {include_dirs:?} (set KVRET_INCLUDE_DIR)"));
    println!("cargo:rerun-if-changed={}", header.display());
    // For dependents (DEP_KVRET_INCLUDE) and for the header test of this crate.
    println!("cargo:include={}", header.parent().unwrap().display());
    println!("cargo:rustc-env=KVRET_HEADER={}", header.display());

    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    let layout_test = layout_test(&header, &out_dir).unwrap_or_else(|reason| {
        println!("cargo:warning=kvret-sys: struct layout test disabled: {reason}");
        format!("#[test]\n#[ignore = {reason:?}]\nfn struct_layout_matches_kvret_h() {{}}\n")
    });
    fs::write(out_dir.join("layout_test.rs"), layout_test).unwrap();
}

/// The `pkgconfig` directories of the prefix this crate is installed in, when it lies in
/// `<prefix>/share/kvret/rust/kvret-sys` and the prefix holds a `kvret.pc`.
fn installed_pkgconfig_dirs(manifest_dir: &Path) -> Vec<PathBuf> {
    let mut ancestors = manifest_dir.ancestors();
    let names: Vec<_> = ancestors.by_ref().take(4).map(|dir| dir.file_name().and_then(|n| n.to_str())).collect();
    if names != [Some("kvret-sys"), Some("rust"), Some("kvret"), Some("share")] {
        return Vec::new();
    }
    let Some(prefix) = ancestors.next() else { return Vec::new() };
    let mut candidates = vec![prefix.join("lib/pkgconfig"), prefix.join("lib64/pkgconfig")];
    if let Ok(entries) = fs::read_dir(prefix.join("lib")) {
        // lib/<multiarch>/pkgconfig (Debian's libdir)
        candidates.extend(entries.flatten().map(|entry| entry.path().join("pkgconfig")));
    }
    candidates.into_iter().filter(|dir| dir.join("kvret.pc").is_file()).collect()
}

fn pkg_config() -> (Vec<PathBuf>, Vec<PathBuf>) {
    let program = env::var("PKG_CONFIG").unwrap_or_else(|_| "pkg-config".into());
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let mut search = installed_pkgconfig_dirs(&manifest_dir);
    search.extend(env::var_os("PKG_CONFIG_PATH").map(|p| env::split_paths(&p).collect::<Vec<_>>()).unwrap_or_default());
    let search = env::join_paths(search).unwrap();
    let run = |args: &[&str]| -> Result<String, String> {
        let output = Command::new(&program)
            .args(args)
            .env("PKG_CONFIG_PATH", &search)
            .output()
            .map_err(|e| format!("cannot run {program}: {e}"))?;
        if output.status.success() {
            Ok(String::from_utf8_lossy(&output.stdout).into_owned())
        } else {
            Err(String::from_utf8_lossy(&output.stderr).trim().to_owned())
        }
    };
    let range = [format!("kvret >= {MIN_VERSION}"), format!("kvret < {MAX_VERSION_EXCLUSIVE}")];
    for constraint in &range {
        if let Err(reason) = run(&["--exists", "--print-errors", constraint]) {
            panic!(
                "kvret-sys: pkg-config found no `{constraint}` ({reason}).\n\
                 Install libkvret (cmake --install) and point PKG_CONFIG_PATH at its lib/pkgconfig,\n\
                 or set KVRET_LIB_DIR to the directory holding libkvret.so."
            );
        }
    }
    let flags = |args: &[&str], prefix: &str| -> Vec<PathBuf> {
        run(args)
            .unwrap_or_else(|reason| panic!("kvret-sys: pkg-config {args:?} failed: {reason}"))
            .split_whitespace()
            .filter_map(|flag| flag.strip_prefix(prefix).map(PathBuf::from))
            .collect()
    };
    let mut lib_dirs = flags(&["--libs-only-L", "kvret"], "-L");
    if lib_dirs.is_empty() {
        lib_dirs.push(PathBuf::from(run(&["--variable=libdir", "kvret"]).unwrap_or_default().trim()));
    }
    let mut include_dirs = flags(&["--cflags-only-I", "kvret"], "-I");
    include_dirs.push(PathBuf::from(run(&["--variable=includedir", "kvret"]).unwrap_or_default().trim()));
    (lib_dirs, include_dirs)
}

/// The structs of kvret.h and their field names, in declaration order.
fn header_structs(header: &str) -> Vec<(String, Vec<String>)> {
    let text = strip_comments(header);
    let mut structs = Vec::new();
    let mut rest = text.as_str();
    while let Some(start) = rest.find("typedef struct ") {
        rest = &rest[start + "typedef struct ".len()..];
        let Some(open) = rest.find(['{', ';']) else { break };
        if rest.as_bytes()[open] == b';' {
            continue; // an opaque handle
        }
        let name = rest[..open].trim().to_owned();
        let close = rest.find('}').unwrap();
        let fields = rest[open + 1..close]
            .split(';')
            .map(str::trim)
            .filter(|field| !field.is_empty())
            .map(|field| field.rsplit(|c: char| !(c.is_alphanumeric() || c == '_')).next().unwrap().to_owned())
            .collect();
        structs.push((name, fields));
        rest = &rest[close..];
    }
    structs
}

include!("c_text.rs");

/// A Rust test asserting the C sizes, alignments and offsets of every struct of kvret.h.
fn layout_test(header: &Path, out_dir: &Path) -> Result<String, String> {
    if env::var("HOST") != env::var("TARGET") {
        return Err("cross-compiling: the C layout probe cannot run".into());
    }
    let structs = header_structs(&fs::read_to_string(header).map_err(|e| e.to_string())?);
    let mut probe = String::from(
        "#include <stddef.h>\n#include <stdio.h>\n#define KVRET_EXPERIMENTAL\n#include \"kvret.h\"\nint main(void) {\n",
    );
    for (name, fields) in &structs {
        writeln!(probe, "  printf(\"{name} - %zu %zu\\n\", sizeof({name}), _Alignof({name}));").unwrap();
        for field in fields {
            writeln!(probe, "  printf(\"{name} {field} %zu 0\\n\", offsetof({name}, {field}));").unwrap();
        }
    }
    probe.push_str("  return 0;\n}\n");
    let source = out_dir.join("kvret_layout_probe.c");
    let binary = out_dir.join("kvret_layout_probe");
    fs::write(&source, probe).map_err(|e| e.to_string())?;
    let compiler = env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&compiler)
        .arg("-std=c11")
        .arg("-I")
        .arg(header.parent().unwrap())
        .arg(&source)
        .arg("-o")
        .arg(&binary)
        .status()
        .map_err(|e| format!("cannot run the C compiler {compiler}: {e}"))?;
    if !status.success() {
        return Err(format!("{compiler} could not compile the layout probe"));
    }
    let output = Command::new(&binary).output().map_err(|e| e.to_string())?;
    let mut test = String::from("#[test]\nfn struct_layout_matches_kvret_h() {\n");
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let parts: Vec<&str> = line.split_whitespace().collect();
        let [name, field, a, b] = parts[..] else { continue };
        if field == "-" {
            writeln!(test, "    assert_eq!(core::mem::size_of::<{name}>(), {a}, \"sizeof({name})\");").unwrap();
            writeln!(test, "    assert_eq!(core::mem::align_of::<{name}>(), {b}, \"alignof({name})\");").unwrap();
        } else {
            writeln!(
                test,
                "    assert_eq!(core::mem::offset_of!({name}, {field}), {a}, \"offsetof({name}, {field})\");"
            )
            .unwrap();
        }
    }
    test.push_str("}\n");
    Ok(test)
}
