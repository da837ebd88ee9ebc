// operator new inside a template, -O2 -fomit-frame-pointer (libstdc++'s
// operator new has no frame pointer either).
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define UNW_MARK 123457
int sink;

template <typename T>
struct Holder {
  T* data = nullptr;
  __attribute__((noinline)) void make(size_t n) {
    data = new T[n];
    sink += 1;
  }
};

template <typename T>
__attribute__((noinline)) Holder<T>* build(size_t n) {
  auto* h = new Holder<T>;  // a small allocation first (not UNW_MARK)
  h->make(n);
  sink += 2;
  return h;
}

int main() {
  Holder<char>* volatile h = build<char>(UNW_MARK);
  (void)h;
  return 0;
}
