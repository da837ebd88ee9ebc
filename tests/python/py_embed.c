/* An interpreter that lives in libpython3.11.so (issue 32): what a
 * --enable-shared build's python3 is, and what every program that embeds
 * Python is. Runs the script given, then stops without finalizing (as
 * py_frames_target.py does itself).
 *   py_embed SCRIPT */
#include <Python.h>
#include <unistd.h>

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  FILE* f = fopen(argv[1], "r");
  if (!f) return 3;
  Py_Initialize();
  int rc = PyRun_SimpleFileEx(f, argv[1], 1);
  fflush(stdout);
  _exit(rc ? 1 : 0);
}
