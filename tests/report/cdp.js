// A headless Chromium driven over the DevTools protocol on a pipe
// (--remote-debugging-pipe: requests on fd 3, replies and events on fd 4,
// each message JSON ended by a NUL). No npm package: node's own
// child_process is all it needs.
"use strict";
const { spawn } = require("child_process");
const fs = require("fs");
const os = require("os");
const path = require("path");

class Browser {
  // chromium: the program; every request a page makes that is not for a
  // file: URL is failed by the browser itself (no proxy, no DNS), and
  // recorded by the caller through Network events.
  static async launch(chromium, { width = 1280, height = 1600 } = {}) {
    const profile = fs.mkdtempSync(path.join(os.tmpdir(), "memtrace-cdp-"));
    const args = [
      "--headless=new",
      "--remote-debugging-pipe",
      "--no-sandbox",
      "--disable-gpu",
      "--no-first-run",
      "--no-default-browser-check",
      "--disable-extensions",
      "--disable-background-networking",
      "--disable-component-update",
      "--disable-sync",
      "--metrics-recording-only",
      "--proxy-server=127.0.0.1:9",
      "--host-resolver-rules=MAP * ~NOTFOUND",
      `--user-data-dir=${profile}`,
      `--window-size=${width},${height}`,
      "about:blank",
    ];
    // Its own process group: close() ends its helpers (renderer, zygote,
    // crashpad) with it.
    // TMPDIR: its sockets' directories go in the profile, removed with it.
    const tmp = path.join(profile, "tmp");
    fs.mkdirSync(tmp);
    const proc = spawn(chromium, args, {
      stdio: ["ignore", "ignore", "pipe", "pipe", "pipe"],
      detached: true,
      env: { ...process.env, TMPDIR: tmp },
    });
    const b = new Browser(proc, profile);
    proc.stderr.on("data", (d) => {
      b.stderr += d;
      if (b.stderr.length > 65536) b.stderr = b.stderr.slice(-65536);
    });
    await b.send("Target.setDiscoverTargets", { discover: true });
    return b;
  }

  constructor(proc, profile) {
    this.proc = proc;
    this.profile = profile;
    this.stderr = "";
    this.seq = 0;
    this.pending = new Map();
    this.listeners = [];
    this.exited = false;
    let buf = Buffer.alloc(0);
    proc.stdio[4].on("data", (chunk) => {
      buf = Buffer.concat([buf, chunk]);
      let i;
      while ((i = buf.indexOf(0)) >= 0) {
        const msg = JSON.parse(buf.subarray(0, i).toString("utf8"));
        buf = buf.subarray(i + 1);
        this.dispatch(msg);
      }
    });
    proc.once("exit", (code, sig) => {
      this.exited = true;
      for (const [, p] of this.pending) p.reject(new Error(`chromium exited (${code ?? sig}) during ${p.method}: ${this.stderr.slice(-2000)}`));
      this.pending.clear();
    });
  }

  dispatch(msg) {
    if (msg.id !== undefined) {
      const p = this.pending.get(msg.id);
      if (!p) return;
      this.pending.delete(msg.id);
      if (msg.error) p.reject(new Error(`${p.method}: ${msg.error.message}`));
      else p.resolve(msg.result);
      return;
    }
    for (const l of this.listeners) l(msg);
  }

  send(method, params = {}, sessionId = undefined) {
    if (this.exited) return Promise.reject(new Error(`chromium is gone: ${method}`));
    const id = ++this.seq;
    const msg = { id, method, params };
    if (sessionId) msg.sessionId = sessionId;
    this.proc.stdio[3].write(JSON.stringify(msg) + "\0");
    return new Promise((resolve, reject) => this.pending.set(id, { resolve, reject, method }));
  }

  on(f) {
    this.listeners.push(f);
  }

  // A new tab, attached: its session's commands go through page.send.
  async newPage() {
    const { targetId } = await this.send("Target.createTarget", { url: "about:blank" });
    const { sessionId } = await this.send("Target.attachToTarget", { targetId, flatten: true });
    return new Page(this, sessionId);
  }

  // Ends chromium and every process of its group, then removes its profile.
  async close() {
    const gone = this.exited ? Promise.resolve() : new Promise((resolve) => this.proc.once("exit", resolve));
    try {
      process.kill(-this.proc.pid, "SIGKILL");
    } catch (e) {
      if (e.code !== "ESRCH") throw e;
    }
    await gone;
    fs.rmSync(this.profile, { recursive: true, force: true, maxRetries: 20, retryDelay: 50 });
  }
}

class Page {
  constructor(browser, sessionId) {
    this.b = browser;
    this.sessionId = sessionId;
    this.events = [];
    this.waiters = [];
    browser.on((msg) => {
      if (msg.sessionId !== sessionId) return;
      this.events.push(msg);
      this.waiters = this.waiters.filter((w) => !(w.method === msg.method && (w.resolve(msg.params), true)));
    });
  }
  send(method, params = {}) {
    return this.b.send(method, params, this.sessionId);
  }
  waitFor(method, ms) {
    if (this.events.some((e) => e.method === method)) return Promise.resolve();
    return new Promise((resolve, reject) => {
      const t = setTimeout(() => reject(new Error(`no ${method} in ${ms} ms`)), ms);
      this.waiters.push({ method, resolve: (p) => (clearTimeout(t), resolve(p)) });
    });
  }
  // The value of a JavaScript expression in the page (awaited if a promise).
  async eval(expression) {
    const r = await this.send("Runtime.evaluate", { expression, returnByValue: true, awaitPromise: true });
    if (r.exceptionDetails)
      throw new Error(`in page: ${r.exceptionDetails.exception?.description || r.exceptionDetails.text}`);
    return r.result.value;
  }
  async mouse(type, x, y) {
    await this.send("Input.dispatchMouseEvent", { type, x, y, button: "left", buttons: type === "mouseReleased" ? 0 : 1, clickCount: 1 });
  }
  async click(x, y) {
    await this.send("Input.dispatchMouseEvent", { type: "mouseMoved", x, y });
    await this.mouse("mousePressed", x, y);
    await this.mouse("mouseReleased", x, y);
  }
  async drag(x0, y0, x1, y1, steps = 8) {
    await this.send("Input.dispatchMouseEvent", { type: "mouseMoved", x: x0, y: y0 });
    await this.mouse("mousePressed", x0, y0);
    for (let i = 1; i <= steps; i++) {
      const x = x0 + ((x1 - x0) * i) / steps;
      const y = y0 + ((y1 - y0) * i) / steps;
      await this.send("Input.dispatchMouseEvent", { type: "mouseMoved", x, y, button: "left", buttons: 1 });
    }
    await this.mouse("mouseReleased", x1, y1);
  }
}

module.exports = { Browser };
