#include "metrics/exporter.h"

#include <sys/eventfd.h>
#include <unistd.h>

namespace memtrace::metrics {

Result<std::unique_ptr<Exporter>> Exporter::listen(const std::string& address, ExporterOptions o) {
  auto a = parse_listen_address(address);
  if (!a) return a.error();
  auto server = HttpServer::listen(*a, o.http);
  if (!server) return server.error();
  std::unique_ptr<Exporter> e(new Exporter());
  e->o_ = o;
  e->server_ = std::move(*server);
  e->wake_ = Fd(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!e->wake_.valid()) return Error::sys("--metrics: eventfd");
  e->selection_ = std::make_unique<Selection>(o.exposition);
  return e;
}

Exporter::~Exporter() { stop(); }

void Exporter::start() {
  server_->start([this](const HttpRequest& r) { return handle(r); });
}

void Exporter::stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (server_) server_->stop();
}

void Exporter::serve(const std::function<Snapshot()>& make) {
  if (requested_.load(std::memory_order_acquire) == published_.load(std::memory_order_relaxed)) return;
  uint64_t n;
  (void)!read(wake_.get(), &n, sizeof n);  // first: a request after this wakes the poll again
  uint64_t want = requested_.load(std::memory_order_acquire);
  auto snap = std::make_shared<const Snapshot>(make());
  {
    std::lock_guard<std::mutex> lk(mu_);
    latest_ = std::move(snap);
    published_.store(want, std::memory_order_relaxed);
  }
  cv_.notify_all();
}

HttpResponse Exporter::handle(const HttpRequest& r) {
  const std::string plain = "text/plain; charset=utf-8";
  if (r.path != "/metrics") return {404, plain, "not found: memtrace-bpf serves GET /metrics\n"};
  if (r.method != "GET" && r.method != "HEAD") return {405, plain, "memtrace-bpf serves GET /metrics\n"};
  uint64_t want = requested_.fetch_add(1, std::memory_order_acq_rel) + 1;
  uint64_t one = 1;
  (void)!write(wake_.get(), &one, sizeof one);
  std::shared_ptr<const Snapshot> s;
  {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait_for(lk, std::chrono::milliseconds(o_.fresh_wait_ms),
                 [&] { return published_.load(std::memory_order_relaxed) >= want || stopping_; });
    s = latest_;
  }
  if (!s) return {503, plain, "no data yet: the tracer has not taken a snapshot\n"};
  return {200, "text/plain; version=0.0.4; charset=utf-8",
          selection_->render(*s, std::chrono::steady_clock::now() - s->taken)};
}

}  // namespace memtrace::metrics
