#include "metrics/http_server.h"

#include <arpa/inet.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <strings.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

namespace memtrace::metrics {
namespace {

using Clock = std::chrono::steady_clock;

int ms_left(Clock::time_point deadline) {
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return ms > 0 ? static_cast<int>(ms) : 0;
}

// Waits until fd is ready for `events`, stop_fd is readable, or the
// deadline: 1 ready, 0 timed out, -1 stopped or failed.
int wait_fd(int fd, short events, int stop_fd, Clock::time_point deadline) {
  for (;;) {
    int left = ms_left(deadline);
    if (left == 0) return 0;
    pollfd p[2] = {{fd, events, 0}, {stop_fd, POLLIN, 0}};
    int n = ::poll(p, 2, left);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 || p[1].revents) return -1;
    if (n == 0) return 0;
    return 1;  // ready, or an error/hangup the next call reports
  }
}

const char* reason(int status) {
  switch (status) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 431: return "Request Header Fields Too Large";
    case 503: return "Service Unavailable";
  }
  return "Error";
}

std::string numeric_host(const sockaddr_storage& ss) {
  char buf[INET6_ADDRSTRLEN] = "?";
  if (ss.ss_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6&>(ss).sin6_addr, buf, sizeof buf);
    return "[" + std::string(buf) + "]";
  }
  inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in&>(ss).sin_addr, buf, sizeof buf);
  return buf;
}

uint16_t port_of(const sockaddr_storage& ss) {
  return ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<const sockaddr_in6&>(ss).sin6_port
                                        : reinterpret_cast<const sockaddr_in&>(ss).sin_port);
}

}  // namespace

Result<ListenAddress> parse_listen_address(const std::string& s) {
  auto bad = [&](const std::string& why) { return Error::msg("--metrics '" + s + "': " + why); };
  ListenAddress a;
  std::string port;
  if (!s.empty() && s[0] == '[') {
    size_t close = s.find(']');
    if (close == std::string::npos || close + 1 >= s.size() || s[close + 1] != ':')
      return bad("expected [IPv6]:PORT");
    a.host = s.substr(1, close - 1);
    port = s.substr(close + 2);
  } else {
    size_t colon = s.rfind(':');
    if (colon == std::string::npos) return bad("expected HOST:PORT or :PORT");
    a.host = s.substr(0, colon);
    if (a.host.find(':') != std::string::npos) return bad("write an IPv6 address in brackets, as [::1]:9464");
    port = s.substr(colon + 1);
  }
  if (port.empty() || port.size() > 5 || !std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return bad("the port must be a number, 0-65535");
  unsigned long p = std::stoul(port);
  if (p > 65535) return bad("port " + port + " is not 0-65535");
  a.port = static_cast<uint16_t>(p);
  return a;
}

// The addresses of host, without asking DNS or NSS (a static program's
// getaddrinfo would need the NSS libraries of the glibc it was built with):
// an IP address, a name in /etc/hosts, or localhost. "" : every address,
// IPv6's wildcard first (it takes IPv4 too, IPV6_V6ONLY off).
static Result<std::vector<sockaddr_storage>> addresses_of(const std::string& host, uint16_t port) {
  std::vector<sockaddr_storage> out;
  auto add = [&](const std::string& text) {
    sockaddr_storage ss{};
    std::string ip = text, zone;
    if (size_t pct = ip.find('%'); pct != std::string::npos) {
      zone = ip.substr(pct + 1);
      ip.resize(pct);
    }
    auto* v4 = reinterpret_cast<sockaddr_in*>(&ss);
    auto* v6 = reinterpret_cast<sockaddr_in6*>(&ss);
    if (zone.empty() && inet_pton(AF_INET, ip.c_str(), &v4->sin_addr) == 1) {
      v4->sin_family = AF_INET;
      v4->sin_port = htons(port);
    } else if (inet_pton(AF_INET6, ip.c_str(), &v6->sin6_addr) == 1) {
      v6->sin6_family = AF_INET6;
      v6->sin6_port = htons(port);
      if (!zone.empty() && !(v6->sin6_scope_id = if_nametoindex(zone.c_str()))) return false;
    } else {
      return false;
    }
    out.push_back(ss);
    return true;
  };
  if (host.empty()) {
    add("::");
    add("0.0.0.0");
    return out;
  }
  if (add(host)) return out;
  std::ifstream hosts("/etc/hosts");
  for (std::string line; std::getline(hosts, line);) {
    std::istringstream is(line.substr(0, line.find('#')));
    std::string ip, name;
    is >> ip;
    while (is >> name)
      if (strcasecmp(name.c_str(), host.c_str()) == 0) {
        add(ip);
        break;
      }
  }
  if (out.empty() && strcasecmp(host.c_str(), "localhost") == 0) add("127.0.0.1");
  if (out.empty())
    return Error::msg(host + " is not an IP address or a name in /etc/hosts (memtrace-bpf does not ask DNS)");
  return out;
}

Result<std::unique_ptr<HttpServer>> HttpServer::listen(const ListenAddress& a, HttpLimits limits) {
  std::string what = "metrics address " + (a.host.find(':') != std::string::npos ? "[" + a.host + "]" : a.host) +
                     ":" + std::to_string(a.port);
  auto addrs = addresses_of(a.host, a.port);
  if (!addrs) return Error::msg(what + ": " + addrs.error().message);
  Error last = Error::msg(what + ": no address to listen on");
  std::unique_ptr<HttpServer> s(new HttpServer());
  for (const sockaddr_storage& ss : *addrs) {
    Fd fd(socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd.valid()) {
      last = Error::sys(what + ": socket");
      continue;
    }
    int one = 1, zero = 0;
    setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (ss.ss_family == AF_INET6 && a.host.empty()) setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
    socklen_t len = ss.ss_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
    if (bind(fd.get(), reinterpret_cast<const sockaddr*>(&ss), len) != 0) {
      last = Error::sys(what);
      continue;
    }
    if (::listen(fd.get(), 16) != 0) {
      last = Error::sys(what + ": listen");
      continue;
    }
    s->listen_ = std::move(fd);
    break;
  }
  if (!s->listen_.valid()) return last;
  s->stop_ = Fd(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!s->stop_.valid()) return Error::sys(what + ": eventfd");
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  getsockname(s->listen_.get(), reinterpret_cast<sockaddr*>(&ss), &len);
  s->url_ = "http://" + numeric_host(ss) + ":" + std::to_string(port_of(ss));
  s->limits_ = limits;
  return s;
}

HttpServer::~HttpServer() { stop(); }

std::string HttpServer::url() const { return url_; }

void HttpServer::start(Handler handler) {
  if (thread_.joinable()) return;
  handler_ = std::move(handler);
  thread_ = std::thread([this] {
    // Signals are the drain thread's (SIGCHLD wakes its poll, SIGINT stops it).
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, nullptr);
    loop();
  });
}

void HttpServer::stop() {
  if (!thread_.joinable()) return;
  uint64_t one = 1;
  (void)!write(stop_.get(), &one, sizeof one);
  thread_.join();
}

void HttpServer::loop() {
  for (;;) {
    pollfd p[2] = {{listen_.get(), POLLIN, 0}, {stop_.get(), POLLIN, 0}};
    int n = ::poll(p, 2, -1);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 || p[1].revents) return;
    Fd conn(accept4(listen_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (!conn.valid()) {
      // Out of descriptors (EMFILE) leaves the connection queued: wait a
      // little instead of spinning on it.
      if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED)
        if (wait_fd(stop_.get(), POLLIN, stop_.get(), Clock::now() + std::chrono::milliseconds(100)) < 0) return;
      continue;
    }
    serve(conn.get());
  }
}

bool HttpServer::send_all(int fd, const std::string& data) {
  auto deadline = Clock::now() + std::chrono::milliseconds(limits_.write_ms);
  size_t off = 0;
  while (off < data.size()) {
    ssize_t n = send(fd, data.data() + off, data.size() - off, MSG_NOSIGNAL);
    if (n > 0) {
      off += n;
      continue;
    }
    if (n < 0 && errno != EAGAIN && errno != EINTR) return false;
    int w = wait_fd(fd, POLLOUT, stop_.get(), deadline);
    if (w == 0) stats_.timeouts++;
    if (w <= 0) return false;
  }
  return true;
}

void HttpServer::serve(int fd) {
  auto deadline = Clock::now() + std::chrono::milliseconds(limits_.request_ms);
  std::string buf;
  size_t head_end = std::string::npos;
  auto respond = [&](const HttpResponse& r, bool body) {
    std::string out = "HTTP/1.1 " + std::to_string(r.status) + " " + reason(r.status) +
                      "\r\nContent-Type: " + r.content_type +
                      "\r\nContent-Length: " + std::to_string(r.body.size()) + "\r\nConnection: close\r\n\r\n";
    if (body) out += r.body;
    stats_.requests++;
    if (!send_all(fd, out)) return;
    // The client reads the whole response before the close: no reset for
    // bytes it sent that were never read (bounded: 200 ms).
    shutdown(fd, SHUT_WR);
    auto linger = Clock::now() + std::chrono::milliseconds(200);
    char sink[4096];
    while (wait_fd(fd, POLLIN, stop_.get(), linger) == 1)
      if (recv(fd, sink, sizeof sink, 0) <= 0) break;
  };
  auto refuse = [&](int status, const std::string& why) {
    stats_.refused++;
    respond({status, "text/plain; charset=utf-8", why + "\n"}, true);
  };
  for (;;) {
    size_t at = buf.find("\r\n\r\n");
    size_t at2 = buf.find("\n\n");
    head_end = std::min(at, at2);
    if (head_end != std::string::npos) break;
    if (buf.size() > limits_.request_bytes) return refuse(431, "request head larger than " +
                                                                   std::to_string(limits_.request_bytes) + " bytes");
    int w = wait_fd(fd, POLLIN, stop_.get(), deadline);
    if (w == 0) stats_.timeouts++;
    if (w <= 0) return;  // too slow (or stopping): closed without an answer
    char tmp[4096];
    ssize_t n = recv(fd, tmp, std::min(sizeof tmp, limits_.request_bytes + 1 - buf.size()), 0);
    if (n == 0) return;
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      return;
    }
    buf.append(tmp, n);
  }
  // Request line: METHOD SP TARGET SP HTTP/1.x
  std::string line = buf.substr(0, buf.find('\n'));
  if (!line.empty() && line.back() == '\r') line.pop_back();
  size_t s1 = line.find(' '), s2 = s1 == std::string::npos ? s1 : line.find(' ', s1 + 1);
  if (s2 == std::string::npos || line.compare(s2 + 1, 7, "HTTP/1.") != 0) return refuse(400, "malformed request line");
  HttpRequest req;
  req.method = line.substr(0, s1);
  std::string target = line.substr(s1 + 1, s2 - s1 - 1);
  if (target.rfind("http://", 0) == 0) {  // absolute form
    size_t slash = target.find('/', 7);
    target = slash == std::string::npos ? "/" : target.substr(slash);
  }
  req.path = target.substr(0, target.find('?'));
  HttpResponse r = handler_(req);
  respond(r, req.method != "HEAD");
}

}  // namespace memtrace::metrics
