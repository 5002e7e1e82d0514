# pipeoffloadCudaLibraries.cmake: the NVIDIA libraries pipeoffload's CUDA backend links, found the
# same way for both routes to pipeoffload::cuda: an installed package (pipeoffloadConfig.cmake,
# installed beside this file) and a checkout's CMakeLists.txt (-DPIPEOFFLOAD_CUDA=ON). Which
# libraries, and the GPU architectures, are listed in pipeoffloadCuda.txt beside this file (the
# list meson.build reads too).
#
#   _pipeoffload_cuda_list(<key> <var>)
#
# Sets <var> to pipeoffloadCuda.txt's list <key> (architectures, toolkit_libraries,
# separate_libraries); a fatal error when the file has no such line.
#
#   _pipeoffload_cuda_libraries(<libs> <includes> <missing>)
#
# Needs find_package(CUDAToolkit) found. Sets <libs> to what to link after the backend's own
# libraries (the toolkit's as CUDA::<name> targets, then the separate libraries' files, in the
# list's order), <includes> to the directories of the separate libraries' headers (cudnn.h,
# nccl.h), and <missing> to a list naming what was not found (empty when everything was). The
# separate libraries (cuDNN, NCCL) ship apart from the toolkit: they are looked for in
# <NAME>_ROOT (variable or environment), the toolkit's directories and the system's;
# PIPEOFFLOAD_<NAME>_LIBRARY and PIPEOFFLOAD_<NAME>_INCLUDE_DIR override.
function(_pipeoffload_cuda_list key out_var)
  # CMAKE_CURRENT_FUNCTION_LIST_DIR (CMake 3.17, as find_package(CUDAToolkit)): this file's folder.
  set(list_file "${CMAKE_CURRENT_FUNCTION_LIST_DIR}/pipeoffloadCuda.txt")
  file(STRINGS "${list_file}" lines REGEX "^${key}:")
  list(LENGTH lines count)
  if(NOT count EQUAL 1)
    message(FATAL_ERROR "${list_file} should have one line '${key}: ...'; it has ${count}")
  endif()
  string(REGEX REPLACE "^${key}:" "" values "${lines}")
  string(REGEX MATCHALL "[^ \t]+" values "${values}")
  set(${out_var} "${values}" PARENT_SCOPE)
endfunction()

function(_pipeoffload_cuda_libraries libs_var includes_var missing_var)
  set(libs "")
  set(includes "")
  set(missing "")
  _pipeoffload_cuda_list(toolkit_libraries toolkit)
  _pipeoffload_cuda_list(separate_libraries separate)
  foreach(name IN LISTS toolkit)
    if(TARGET CUDA::${name})
      list(APPEND libs CUDA::${name})
    else()
      list(APPEND missing "CUDA::${name} (lib${name}, part of the CUDA toolkit)")
    endif()
  endforeach()
  foreach(name IN LISTS separate)
    string(TOUPPER "${name}" var)
    find_library(PIPEOFFLOAD_${var}_LIBRARY ${name}
      HINTS ${${var}_ROOT} $ENV{${var}_ROOT} ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_TARGET_DIR}
      PATH_SUFFIXES lib64 lib)
    find_path(PIPEOFFLOAD_${var}_INCLUDE_DIR ${name}.h
      HINTS ${${var}_ROOT} $ENV{${var}_ROOT} ${CUDAToolkit_INCLUDE_DIRS} ${CUDAToolkit_TARGET_DIR}
      PATH_SUFFIXES include)
    if(PIPEOFFLOAD_${var}_LIBRARY AND PIPEOFFLOAD_${var}_INCLUDE_DIR)
      list(APPEND libs "${PIPEOFFLOAD_${var}_LIBRARY}")
      list(APPEND includes "${PIPEOFFLOAD_${var}_INCLUDE_DIR}")
    else()
      list(APPEND missing "${var} (lib${name} and ${name}.h; set ${var}_ROOT)")
    endif()
  endforeach()
  list(REMOVE_DUPLICATES includes)
  set(${libs_var} "${libs}" PARENT_SCOPE)
  set(${includes_var} "${includes}" PARENT_SCOPE)
  set(${missing_var} "${missing}" PARENT_SCOPE)
endfunction()
