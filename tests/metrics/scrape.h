// What the --metrics tests need of HTTP and of the text format: a GET on
// 127.0.0.1 with plain sockets, and the samples of a scrape by series.
#pragma once
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <map>
#include <sstream>
#include <string>

namespace memtrace::testing {

struct HttpReply {
  int status = 0;  // 0: no answer
  std::string body;
};

inline int connect_local(uint16_t port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval tv{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// `raw` as the request (default: GET path), the whole answer until the
// server closes.
inline HttpReply http_get(uint16_t port, const std::string& path, const std::string& raw = "") {
  HttpReply r;
  int fd = connect_local(port);
  if (fd < 0) return r;
  std::string req = raw.empty() ? "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n" : raw;
  if (send(fd, req.data(), req.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(req.size())) {
    close(fd);
    return r;
  }
  std::string all;
  char b[65536];
  ssize_t n;
  while ((n = recv(fd, b, sizeof b, 0)) > 0) all.append(b, n);
  close(fd);
  if (all.rfind("HTTP/1.1 ", 0) != 0) return r;
  r.status = std::stoi(all.substr(9, 3));
  size_t body = all.find("\r\n\r\n");
  if (body != std::string::npos) r.body = all.substr(body + 4);
  return r;
}

// A free TCP port on 127.0.0.1 (the kernel's pick; free until someone takes it).
inline uint16_t free_port() {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

// Samples by series ("name{labels}" exactly as written), and how many
// series appeared more than once (a scrape Prometheus would refuse).
struct Exposition {
  std::map<std::string, std::string> samples;
  int duplicates = 0;
  bool has(const std::string& series) const { return samples.count(series) > 0; }
  long long value(const std::string& series) const {
    auto it = samples.find(series);
    return it == samples.end() ? -1 : std::stoll(it->second);
  }
};

inline Exposition parse_exposition(const std::string& text) {
  Exposition e;
  std::istringstream is(text);
  for (std::string line; std::getline(is, line);) {
    if (line.empty() || line[0] == '#') continue;
    size_t sp = line.rfind(' ');
    if (sp == std::string::npos) continue;
    if (!e.samples.emplace(line.substr(0, sp), line.substr(sp + 1)).second) e.duplicates++;
  }
  return e;
}

// cgroup: the process's (a label of every process's series where it is
// known: the traced processes of the integration tests, never the unit
// tests' snapshots).
inline std::string series(const std::string& name, long pid, const std::string& comm, const std::string& by = "",
                          const std::string& cgroup = "") {
  std::string s = name + "{pid=\"" + std::to_string(pid) + "\",comm=\"" + comm + "\"";
  if (!cgroup.empty()) s += ",cgroup=\"" + cgroup + "\"";
  if (!by.empty()) s += ",by=\"" + by + "\"";
  return s + "}";
}

}  // namespace memtrace::testing
