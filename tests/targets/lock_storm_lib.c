/* Loaded and unloaded in a loop by lock_storm: its constructor and
 * destructor allocate while ld.so holds its load lock. */
#include <stdlib.h>

static void* volatile kept;

__attribute__((constructor)) static void storm_lib_init(void) { kept = malloc(48); }
__attribute__((destructor)) static void storm_lib_fini(void) { free(kept); }

int lock_storm_lib_answer(void) { return 42; }
