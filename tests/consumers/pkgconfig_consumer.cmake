# Builds consumer.c with nothing but `pkg-config --cflags --libs kvret` (plus an rpath to pkg-config's libdir) against
# an installed kvret, then runs it.
#   cmake -DPKG_CONFIG=... -DCC=... -DPKG_CONFIG_DIR=<prefix>/<libdir>/pkgconfig -DSOURCE=consumer.c -DBINARY=...
#         -P pkgconfig_consumer.cmake
set(ENV{PKG_CONFIG_PATH} "${PKG_CONFIG_DIR}")
execute_process(COMMAND ${PKG_CONFIG} --cflags --libs kvret
                OUTPUT_VARIABLE flags RESULT_VARIABLE failed OUTPUT_STRIP_TRAILING_WHITESPACE)
if(failed)
  message(FATAL_ERROR "pkg-config found no kvret in ${PKG_CONFIG_DIR}")
endif()
execute_process(COMMAND ${PKG_CONFIG} --variable=libdir kvret OUTPUT_VARIABLE libdir OUTPUT_STRIP_TRAILING_WHITESPACE)
message(STATUS "pkg-config --cflags --libs kvret: ${flags}")
separate_arguments(flags UNIX_COMMAND "${flags}")
execute_process(
  COMMAND ${CC} -std=c99 -Wall -Wextra -Wpedantic -Werror ${SOURCE} ${flags} -lm -Wl,-rpath,${libdir} -o ${BINARY}
  RESULT_VARIABLE failed)
if(failed)
  message(FATAL_ERROR "the pkg-config consumer did not build")
endif()
execute_process(COMMAND ${BINARY} RESULT_VARIABLE failed)
if(failed)
  message(FATAL_ERROR "the pkg-config consumer failed")
endif()
