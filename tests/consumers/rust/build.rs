//! The program's run path: the directory of the libkvret that kvret-sys linked (its `DEP_KVRET_LIBDIR`), so that
//! the program runs with no LD_LIBRARY_PATH. A dependency's build script cannot set a program's link arguments; this
//! one is the program's own.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_KVRET_LIBDIR");
    if let Ok(dir) = std::env::var("DEP_KVRET_LIBDIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}
