// Recoverable errors are values that say what failed (see STYLE.md #5).
#pragma once
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>
#include <variant>

namespace memtrace {

struct Error {
  std::string message;  // "attach uprobe free+3 in /lib/.../libc.so.6: Operation not permitted"
  int err = 0;          // errno when the failure came from the system, else 0

  static Error sys(std::string what, int e = errno) {
    return Error{what + ": " + std::strerror(e), e};
  }
  static Error msg(std::string what) { return Error{std::move(what), 0}; }
};

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}
  Result(Error e) : v_(std::move(e)) {}
  bool ok() const { return v_.index() == 0; }
  explicit operator bool() const { return ok(); }
  T& value() & { return std::get<0>(v_); }
  T&& value() && { return std::get<0>(std::move(v_)); }
  const T& value() const& { return std::get<0>(v_); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  const Error& error() const { return std::get<1>(v_); }

 private:
  std::variant<T, Error> v_;
};

template <>
class [[nodiscard]] Result<void> {
 public:
  Result() = default;
  Result(Error e) : err_(std::move(e)), ok_(false) {}
  bool ok() const { return ok_; }
  explicit operator bool() const { return ok_; }
  const Error& error() const { return err_; }

 private:
  Error err_;
  bool ok_ = true;
};

}  // namespace memtrace
