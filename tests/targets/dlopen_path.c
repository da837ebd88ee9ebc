/* dlopen_path: dlopens the library argv[1] names by its path (as ld loads
 * its -plugin, gcc's liblto_plugin.so; a name without '/': the file of that
 * name next to this program, as programs load their plugins) and leaks one
 * block of 4321 bytes through its gone_lib_outer (libmt_gone_outer.so, a
 * copy somewhere no other process maps). Prints "dlopen_path <pid>". */
#include <dlfcn.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

int main(int argc, char **argv) {
  if (argc < 2) return 2;
  char path[PATH_MAX];
  snprintf(path, sizeof path, "%s", argv[1]);
  if (!strchr(argv[1], '/')) {
    ssize_t n = readlink("/proc/self/exe", path, sizeof path - 1);
    if (n <= 0) return 5;
    path[n] = 0;
    snprintf(strrchr(path, '/') + 1, sizeof path - (strrchr(path, '/') + 1 - path), "%s", argv[1]);
  }
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    fprintf(stderr, "dlopen: %s\n", dlerror());
    return 3;
  }
  void *(*outer)(size_t) = (void *(*)(size_t))dlsym(h, "gone_lib_outer");
  if (!outer) return 4;
  outer(4321);
  printf("dlopen_path %d\n", (int)getpid());
  return 0;
}
