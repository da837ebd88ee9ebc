/* Linked into ctor_alloc: its constructor runs before the program's entry
 * point (ld.so's _dl_init) and allocates CTOR_BLOCKS blocks of 100, 200,
 * ... bytes; the program frees some of them and leaks the rest. */
#include <stdlib.h>

#define CTOR_BLOCKS 6

static void* blocks[CTOR_BLOCKS];

__attribute__((constructor)) static void ctor_alloc_init(void) {
  for (int i = 0; i < CTOR_BLOCKS; i++) blocks[i] = malloc(100 * (size_t)(i + 1));
}

void* ctor_alloc_block(int i) { return i >= 0 && i < CTOR_BLOCKS ? blocks[i] : NULL; }
int ctor_alloc_blocks(void) { return CTOR_BLOCKS; }
