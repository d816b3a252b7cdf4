# Builds the Rust consumer (this directory) as a user's crate outside the repository: copied to a scratch directory,
# its dependencies pointed at the crates installed in <prefix>/share/kvret/rust, built offline with nothing else
# to find kvret (no PKG_CONFIG_PATH, KVRET_LIB_DIR or LIBRARY_PATH: the installed kvret-sys reads its own prefix's
# kvret.pc), then run with no LD_LIBRARY_PATH (build.rs sets the run path). Checks what it prints: its checks passed,
# the version is the installed kvret.pc's, and the libkvret it loaded lies in the prefix (not in a build tree).
#   cmake -DCARGO=... -DPKG_CONFIG=... -DPREFIX=<install prefix> -DLIBDIR=lib -DSOURCE=<this dir>
#         -DTARGET_DIR=<cargo target dir> -P consumer.cmake
file(REAL_PATH "${PREFIX}" prefix)
set(crates "${prefix}/share/kvret/rust")
foreach(file Cargo.toml kvret/Cargo.toml kvret/LICENSE kvret-sys/Cargo.toml kvret-sys/build.rs kvret-sys/LICENSE)
  if(NOT EXISTS "${crates}/${file}" OR IS_SYMLINK "${crates}/${file}")
    message(FATAL_ERROR "the install lacks the file share/kvret/rust/${file}")
  endif()
endforeach()

# A scratch directory outside the repository (and outside the build tree), the same one for each build tree.
string(MD5 tag "${TARGET_DIR}")
if(DEFINED ENV{TMPDIR})
  set(scratch "$ENV{TMPDIR}/kvret-rust-consumer-${tag}")
else()
  set(scratch "/tmp/kvret-rust-consumer-${tag}")
endif()
file(REMOVE_RECURSE "${scratch}")
file(COPY "${SOURCE}/src" "${SOURCE}/build.rs" "${SOURCE}/Cargo.lock" DESTINATION "${scratch}")
file(READ "${SOURCE}/Cargo.toml" manifest)
string(REPLACE "\"../../../bindings/rust/" "\"${crates}/" installed "${manifest}")
string(FIND "${installed}" "../../../" left)
if(installed STREQUAL manifest OR NOT left EQUAL -1)
  message(FATAL_ERROR "Cargo.toml: the dependencies are not all paths into bindings/rust")
endif()
file(WRITE "${scratch}/Cargo.toml" "${installed}")

set(ENV{CARGO_TARGET_DIR} "${TARGET_DIR}")
set(ENV{CARGO_TERM_COLOR} "never")
# Nothing may point at kvret: not at a build tree, not at the prefix either.
foreach(var KVRET_LIB_DIR KVRET_INCLUDE_DIR LIBRARY_PATH LD_LIBRARY_PATH PKG_CONFIG_PATH PKG_CONFIG_LIBDIR)
  unset(ENV{${var}})
endforeach()
set(ENV{PKG_CONFIG} "${PKG_CONFIG}")

set(ENV{PKG_CONFIG_PATH} "${prefix}/${LIBDIR}/pkgconfig")
execute_process(COMMAND ${PKG_CONFIG} --modversion kvret OUTPUT_VARIABLE version RESULT_VARIABLE failed
                OUTPUT_STRIP_TRAILING_WHITESPACE)
unset(ENV{PKG_CONFIG_PATH})
if(failed)
  message(FATAL_ERROR "pkg-config found no kvret in ${prefix}/${LIBDIR}/pkgconfig")
endif()

execute_process(COMMAND ${CARGO} build --offline --manifest-path "${scratch}/Cargo.toml" RESULT_VARIABLE failed)
if(failed)
  message(FATAL_ERROR "the Rust consumer in ${scratch} did not build against ${crates}")
endif()

execute_process(COMMAND ${TARGET_DIR}/debug/kvret-consumer OUTPUT_VARIABLE output RESULT_VARIABLE failed)
message(STATUS "${output}")
if(failed)
  message(FATAL_ERROR "the Rust consumer failed (run with no LD_LIBRARY_PATH)")
endif()
foreach(expected "kvret-consumer: OK" "kvret-consumer: version ${version}\n" "kvret-consumer: libkvret ${prefix}/")
  string(FIND "${output}" "${expected}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "the Rust consumer's output lacks '${expected}'")
  endif()
endforeach()
file(REMOVE_RECURSE "${scratch}")
