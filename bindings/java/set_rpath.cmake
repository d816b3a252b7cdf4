# cmake -DFILE=<ELF file> -DRPATH=<run path> -P set_rpath.cmake
# Replaces the run path of a copied library (e.g. the build tree's) with RPATH, which must not be longer. A library
# linked without a run path (CMAKE_SKIP_BUILD_RPATH) is left as it is: NativeLibrary loads libkvret before it.
file(READ_ELF "${FILE}" RUNPATH runpath RPATH rpath)
if(runpath OR rpath)
  file(RPATH_SET FILE "${FILE}" NEW_RPATH "${RPATH}")
endif()
