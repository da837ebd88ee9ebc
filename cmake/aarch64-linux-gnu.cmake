# Cross build for aarch64 with Debian's cross toolchain and the arm64
# multiarch -dev packages (scripts/build-arm64.sh installs both):
#   cmake -S . -B build-arm64 -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(MEMTRACE_TRIPLE aarch64-linux-gnu)
set(CMAKE_C_COMPILER ${MEMTRACE_TRIPLE}-gcc)
set(CMAKE_CXX_COMPILER ${MEMTRACE_TRIPLE}-g++)
set(CMAKE_LIBRARY_ARCHITECTURE ${MEMTRACE_TRIPLE})
# The libraries and headers of the arm64 packages live beside the host's in
# /usr (multiarch): search /usr for them, never run what is found there.
set(CMAKE_FIND_ROOT_PATH /usr/${MEMTRACE_TRIPLE})
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)
# pkg-config: the arm64 .pc files only (the host's would name x86-64 libraries).
set(ENV{PKG_CONFIG_LIBDIR} /usr/lib/${MEMTRACE_TRIPLE}/pkgconfig:/usr/share/pkgconfig)
set(ENV{PKG_CONFIG_PATH} "")
# Test programs are run under qemu-system-aarch64 (scripts/test-arm64.sh), not here.
set(CMAKE_CROSSCOMPILING_EMULATOR "")
