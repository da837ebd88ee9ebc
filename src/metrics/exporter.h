// --metrics ADDR:PORT: Prometheus metrics while tracing.
//
// The heap model belongs to the drain thread. A scrape (on the server's
// thread) asks it for a snapshot: it sets a flag and makes wake_fd()
// readable (the drain thread's epoll holds it); the drain thread, between
// two drains, copies the counters (metrics/snapshot.h) and publishes them
// under a mutex. Nothing is copied while nobody scrapes; a drain thread busy
// for longer than `fresh_wait_ms` gets the scrape the previous snapshot
// (memtrace_snapshot_age_seconds says how old).
#pragma once
#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "common/fd.h"
#include "common/result.h"
#include "metrics/exposition.h"
#include "metrics/http_server.h"
#include "metrics/snapshot.h"

namespace memtrace::metrics {

struct ExporterOptions {
  ExpositionOptions exposition;
  int fresh_wait_ms = 2000;  // how long a scrape waits for the drain thread
  HttpLimits http;
};

class Exporter {
 public:
  // Parses and binds ADDR:PORT now; one line on error.
  static Result<std::unique_ptr<Exporter>> listen(const std::string& address, ExporterOptions o = {});
  ~Exporter();

  std::string url() const { return server_->url() + "/metrics"; }
  void start();  // the server's thread
  void stop();   // scrapes waiting get what was published last

  // The drain thread: wake_fd() in its poll set, and serve() between drains.
  int wake_fd() const { return wake_.get(); }
  // If a scrape waits, take a snapshot now (make()) and hand it over.
  void serve(const std::function<Snapshot()>& make);

  const HttpServer::Stats& http_stats() const { return server_->stats(); }

 private:
  Exporter() = default;
  HttpResponse handle(const HttpRequest& r);  // the server's thread

  ExporterOptions o_;
  std::unique_ptr<HttpServer> server_;
  Fd wake_;  // eventfd
  std::atomic<uint64_t> requested_{0};  // scrapes that asked
  std::atomic<uint64_t> published_{0};  // the last of them answered (written under mu_)
  std::mutex mu_;
  std::condition_variable cv_;
  std::shared_ptr<const Snapshot> latest_;  // under mu_
  bool stopping_ = false;                  // under mu_
  std::unique_ptr<Selection> selection_;   // the server's thread only
};

}  // namespace memtrace::metrics
