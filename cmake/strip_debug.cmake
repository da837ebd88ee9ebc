# CPACK_PRE_BUILD_SCRIPTS: the packaged programs lose their debug info (46 MB
# -> ~10 MB for memtrace-bpf) but keep .symtab: memtrace-bpf --check finds the
# allocator of its own (static) process through it, and a crash report still
# names functions.
file(GLOB_RECURSE _bins "${CPACK_TEMPORARY_INSTALL_DIRECTORY}/*/bin/*")
foreach(_b ${_bins})
  execute_process(COMMAND strip --strip-debug "${_b}" RESULT_VARIABLE _rc)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "strip --strip-debug ${_b} failed")
  endif()
endforeach()
