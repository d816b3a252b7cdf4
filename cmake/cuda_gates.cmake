# Static gates of the CUDA kernels (kernels/*.cu), for CI machines without a GPU:
#  1. ptxas reports every register spill and every use of local memory in a kernel of kernels/
#     (-warn-spills, -warn-lmem-usage), and the build fails on it (-Werror=all-warnings);
#  2. the CTest test cuda_resource_budget (labels cpu;cuda_gates) compares the registers and static shared memory of
#     every kernel in the built objects (cuobjdump -res-usage) with kernels/resource_budget.txt, and checks the
#     disassembly rules listed there (cuobjdump -sass, which needs nvdisasm), e.g. 16-byte loads in decode attention.
# The shared-memory sizes are also static_asserts in the .cuh files. Included from the top-level CMakeLists.txt after
# the kernels are added to kvret_core (KVRET_CUDA_SOURCES). cuobjdump and nvdisasm come with a full CUDA toolkit or
# as PyPI wheels (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm; scripts/install-deps.sh installs them); set
# KVRET_CUOBJDUMP / KVRET_NVDISASM to point elsewhere.
if(NOT KVRET_HAVE_CUDA)
  return()
endif()
option(KVRET_CUDA_GATES "Fail the build on ptxas spills / local memory in kernels/ and test the kernels' resource budget" ON)
if(NOT KVRET_CUDA_GATES)
  return()
endif()

set_property(SOURCE ${KVRET_CUDA_SOURCES} APPEND PROPERTY COMPILE_OPTIONS
             $<$<COMPILE_LANGUAGE:CUDA>:-Xptxas=-warn-spills,-warn-lmem-usage> $<$<COMPILE_LANGUAGE:CUDA>:-Werror=all-warnings>)

find_package(Python3 COMPONENTS Interpreter)
set(_kvret_gate_hints ${CUDAToolkit_BIN_DIR})
if(Python3_Interpreter_FOUND)
  execute_process(COMMAND ${Python3_EXECUTABLE} -c
                          "import sysconfig; print(sysconfig.get_paths()['purelib']); print(sysconfig.get_paths()['platlib'])"
                  OUTPUT_VARIABLE _kvret_site OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  string(REPLACE "\n" ";" _kvret_site "${_kvret_site}")
  foreach(site IN LISTS _kvret_site)
    list(APPEND _kvret_gate_hints ${site}/nvidia/cu13/bin ${site}/nvidia/cuda_cuobjdump/bin ${site}/nvidia/cuda_nvdisasm/bin)
  endforeach()
endif()
find_program(KVRET_CUOBJDUMP cuobjdump HINTS ${_kvret_gate_hints})
find_program(KVRET_NVDISASM nvdisasm HINTS ${_kvret_gate_hints})
message(STATUS "kvret: CUDA gates: cuobjdump ${KVRET_CUOBJDUMP}, nvdisasm ${KVRET_NVDISASM}")

if(KVRET_BUILD_TESTS AND Python3_Interpreter_FOUND)
  # A missing cuobjdump or nvdisasm fails the test with a message saying how to install it: a gate is never skipped.
  add_test(NAME cuda_resource_budget
           COMMAND Python3::Interpreter ${PROJECT_SOURCE_DIR}/kernels/check_resource_budget.py
                   --budget ${PROJECT_SOURCE_DIR}/kernels/resource_budget.txt --cuobjdump ${KVRET_CUOBJDUMP}
                   --nvdisasm ${KVRET_NVDISASM} "$<TARGET_OBJECTS:kvret_core>")
  set_tests_properties(cuda_resource_budget PROPERTIES LABELS "cpu;cuda_gates")
endif()
