// A small HTTP/1.1 server for --metrics: plain sockets, one connection at a
// time on a thread of its own, every request bounded in time and size, so a
// slow or hostile client costs the scrapes a few seconds at most and the
// tracing nothing. Each response closes its connection.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "common/fd.h"
#include "common/result.h"

namespace memtrace::metrics {

struct ListenAddress {
  std::string host;  // "" : every address (":PORT")
  uint16_t port = 0;  // 0: the kernel picks a free one
};
// "HOST:PORT", "[IPv6]:PORT" or ":PORT"; port 0-65535. The error is one
// line: "--metrics ':99999': port must be 0-65535".
Result<ListenAddress> parse_listen_address(const std::string& s);

struct HttpLimits {
  int request_ms = 2000;        // the whole request head must arrive within this
  size_t request_bytes = 8192;  // request line and headers, at most
  int write_ms = 5000;          // the whole response must be taken within this
};

struct HttpRequest {
  std::string method, path;  // path without its query string
};
struct HttpResponse {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
};

class HttpServer {
 public:
  using Handler = std::function<HttpResponse(const HttpRequest&)>;
  // Binds and listens now (before any tracing). HOST is an IP address, a
  // name in /etc/hosts or localhost: a static program does not ask DNS.
  // "metrics address 127.0.0.1:9464: Address already in use".
  static Result<std::unique_ptr<HttpServer>> listen(const ListenAddress& a, HttpLimits limits = {});
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Serves on a thread of its own until stop(): handler for each complete
  // request (on that thread).
  void start(Handler handler);
  void stop();
  std::string url() const;  // http://HOST:PORT (the bound port)

  struct Stats {
    std::atomic<uint64_t> requests{0};  // answered (any status)
    std::atomic<uint64_t> timeouts{0};  // a request or a response that did not complete in time
    std::atomic<uint64_t> refused{0};   // too large or malformed (431, 400)
  };
  const Stats& stats() const { return stats_; }

 private:
  HttpServer() = default;
  void loop();
  void serve(int fd);
  bool send_all(int fd, const std::string& data);

  Fd listen_;
  Fd stop_;  // eventfd: readable when stop() is called
  std::string url_;
  HttpLimits limits_;
  Handler handler_;
  std::thread thread_;
  Stats stats_;
};

}  // namespace memtrace::metrics
