# Installs a build tree into a fresh prefix, as `cmake --install <build> --prefix <prefix>` does for a user.
#   cmake -DBUILD_DIR=... -DPREFIX=... -DLIBDIR=lib -P install_tree.cmake
file(REMOVE_RECURSE "${PREFIX}")
execute_process(COMMAND ${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${PREFIX}" RESULT_VARIABLE failed
                OUTPUT_QUIET)
if(failed)
  message(FATAL_ERROR "cmake --install ${BUILD_DIR} --prefix ${PREFIX} failed")
endif()
foreach(file include/kvret.h ${LIBDIR}/cmake/kvret/kvretConfig.cmake ${LIBDIR}/pkgconfig/kvret.pc)
  if(NOT EXISTS "${PREFIX}/${file}")
    message(FATAL_ERROR "the install lacks ${file}")
  endif()
endforeach()

# kvret.pc names the prefix chosen at configure time. A prefix given only to `cmake --install` is not in it, so
# point the staged copy at where it really is (a relocatable .pc, prefix=${pcfiledir}/../.., would not need this).
set(pc "${PREFIX}/${LIBDIR}/pkgconfig/kvret.pc")
file(READ "${pc}" text)
if(NOT text MATCHES "(^|\n)prefix=\\$\\{pcfiledir\\}")
  string(REGEX REPLACE "(^|\n)prefix=[^\n]*" "\\1prefix=${PREFIX}" text "${text}")
  file(WRITE "${pc}" "${text}")
endif()
