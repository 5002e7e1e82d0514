# pipeoffloadCudaLibraries.cmake: the NVIDIA libraries pipeoffload's CUDA backend links, found the
# same way for both routes to pipeoffload::cuda: an installed package (pipeoffloadConfig.cmake,
# installed beside this file) and a checkout's CMakeLists.txt (-DPIPEOFFLOAD_CUDA=ON).
#
#   _pipeoffload_cuda_libraries(<libs> <includes> <missing>)
#
# Needs find_package(CUDAToolkit) found. Sets <libs> to what to link after the backend's own
# libraries (CUDA::cudart, CUDA::cublas, CUDA::cublasLt, CUDA::nvrtc, then cuDNN's and NCCL's
# files), <includes> to the directories of cudnn.h and nccl.h, and <missing> to a list naming
# what was not found (empty when everything was). cuDNN and NCCL ship apart from the toolkit:
# they are looked for in <NAME>_ROOT (variable or environment), the toolkit's directories and
# the system's; PIPEOFFLOAD_CUDNN_LIBRARY, PIPEOFFLOAD_CUDNN_INCLUDE_DIR (and NCCL's) override.
function(_pipeoffload_cuda_libraries libs_var includes_var missing_var)
  set(libs "")
  set(includes "")
  set(missing "")
  foreach(name IN ITEMS cudart cublas cublasLt nvrtc)
    if(TARGET CUDA::${name})
      list(APPEND libs CUDA::${name})
    else()
      list(APPEND missing "CUDA::${name} (lib${name}, part of the CUDA toolkit)")
    endif()
  endforeach()
  foreach(name IN ITEMS cudnn nccl)
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
