# Builds tools/eval in a tree whose top-level CMakeLists.txt does not add it (yet):
#   cmake -S . -B build-bench ... -DCMAKE_PROJECT_kvret_INCLUDE=$PWD/tools/eval/attach.cmake
# Once the top level has kvret_add_part(tools/eval), this file is not needed (and does nothing: the targets exist).
cmake_language(DEFER DIRECTORY ${CMAKE_SOURCE_DIR} CALL include ${CMAKE_SOURCE_DIR}/tools/eval/CMakeLists.txt)
