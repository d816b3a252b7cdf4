# Builds the Rust consumer (Cargo.toml here) against an installed kvret, found only through pkg-config, runs it with
# the prefix's lib on the loader path, and checks what it prints: its checks passed, the version is the installed
# kvret.pc's, and the libkvret it loaded lies in the prefix (not in a build tree).
#   cmake -DCARGO=... -DPKG_CONFIG=... -DPREFIX=<install prefix> -DLIBDIR=lib -DMANIFEST=<this dir>/Cargo.toml
#         -DTARGET_DIR=<cargo target dir> -P consumer.cmake
file(REAL_PATH "${PREFIX}" prefix)
set(ENV{PKG_CONFIG} "${PKG_CONFIG}")
set(ENV{PKG_CONFIG_PATH} "${prefix}/${LIBDIR}/pkgconfig")
set(ENV{CARGO_TARGET_DIR} "${TARGET_DIR}")
set(ENV{CARGO_TERM_COLOR} "never")
# Nothing may point at a build tree: kvret-sys falls back to KVRET_LIB_DIR before pkg-config.
unset(ENV{KVRET_LIB_DIR})
unset(ENV{KVRET_INCLUDE_DIR})
unset(ENV{LIBRARY_PATH})

execute_process(COMMAND ${PKG_CONFIG} --modversion kvret OUTPUT_VARIABLE version RESULT_VARIABLE failed
                OUTPUT_STRIP_TRAILING_WHITESPACE)
if(failed)
  message(FATAL_ERROR "pkg-config found no kvret in ${prefix}/${LIBDIR}/pkgconfig")
endif()

execute_process(COMMAND ${CARGO} build --offline --manifest-path ${MANIFEST} RESULT_VARIABLE failed)
if(failed)
  message(FATAL_ERROR "the Rust consumer did not build against ${prefix}")
endif()

set(ENV{LD_LIBRARY_PATH} "${prefix}/${LIBDIR}")
execute_process(COMMAND ${TARGET_DIR}/debug/kvret-consumer OUTPUT_VARIABLE output RESULT_VARIABLE failed)
message(STATUS "${output}")
if(failed)
  message(FATAL_ERROR "the Rust consumer failed")
endif()
foreach(expected "kvret-consumer: OK" "kvret-consumer: version ${version}\n" "kvret-consumer: libkvret ${prefix}/")
  string(FIND "${output}" "${expected}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "the Rust consumer's output lacks '${expected}'")
  endif()
endforeach()
