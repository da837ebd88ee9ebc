#pragma once
#include <stddef.h>
#include <stdint.h>
int inproc_start(void* addr, size_t len, uintptr_t* addrs, uint64_t max);
uint64_t inproc_end(void);  // accesses counted
