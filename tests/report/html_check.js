#!/usr/bin/env node
// Loads an HTML report (or a diff's page) in headless Chromium, uses it as a
// person would (switches the value, clicks a frame, drags a time range,
// searches) and prints what it saw as one JSON object;
// tests/report/html_test.cpp and tests/diff/diff_test.cpp make the assertions.
//   node html_check.js --chromium /usr/bin/chromium --page r.html
//        --names f1,f2 [--click f1] [--range A:B ...] [--text SELECTOR ...]
// --names: functions whose flame-graph values (and B - A on a diff's page:
// deltas, fills) are reported in every view; --text: the text of each
// element SELECTOR matches, as the page is first drawn;
// --click: the frame clicked to zoom; --range A:B: a time range dragged on the
// memory-over-time chart, CLOCK_MONOTONIC ns (what the traced program reads
// and the trace's timestamps are).
"use strict";
const path = require("path");
const { Browser } = require("./cdp");

function args() {
  const a = { names: [], ranges: [], texts: [] };
  const v = process.argv.slice(2);
  for (let i = 0; i < v.length; i++) {
    const k = v[i];
    const next = () => {
      if (i + 1 >= v.length) throw new Error(`${k} needs a value`);
      return v[++i];
    };
    if (k === "--chromium") a.chromium = next();
    else if (k === "--page") a.page = path.resolve(next());
    else if (k === "--names") a.names = next().split(",").filter(Boolean);
    else if (k === "--click") a.click = next();
    else if (k === "--range") a.ranges.push(next().split(":").map(Number));
    else if (k === "--text") a.texts.push(next());
    else throw new Error(`unknown argument ${k}`);
  }
  if (!a.chromium || !a.page) throw new Error("--chromium and --page are needed");
  return a;
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function main() {
  const a = args();
  const out = { requests: [], errors: [] };
  const browser = await Browser.launch(a.chromium);
  const deadline = setTimeout(async () => {
    process.stdout.write(JSON.stringify({ error: "timed out after 25 s", partial: out }) + "\n");
    await browser.close();
    process.exit(1);
  }, 25000);
  try {
    const page = await browser.newPage();
    browser.on((m) => {
      if (m.sessionId !== page.sessionId) return;
      const p = m.params || {};
      if (m.method === "Network.requestWillBeSent") out.requests.push(p.request.url);
      if (m.method === "Runtime.exceptionThrown") out.errors.push(`exception: ${p.exceptionDetails.exception?.description || p.exceptionDetails.text}`);
      if (m.method === "Runtime.consoleAPICalled" && (p.type === "error" || p.type === "assert"))
        out.errors.push(`console.${p.type}: ${p.args.map((x) => x.value ?? x.description).join(" ")}`);
      if (m.method === "Log.entryAdded" && p.entry.level === "error") out.errors.push(`log: ${p.entry.text} ${p.entry.url || ""}`);
    });
    for (const d of ["Runtime", "Log", "Network", "Page"]) await page.send(`${d}.enable`);
    await page.send("Emulation.setDeviceMetricsOverride", { width: 1280, height: 1600, deviceScaleFactor: 1, mobile: false });
    const url = "file://" + a.page;
    out.url = url;
    const t0 = Date.now();
    await page.send("Page.navigate", { url });
    await page.waitFor("Page.loadEventFired", 10000);
    // d3-flame-graph draws its frames after a transition.
    const settle = () => sleep(450);
    await settle();
    out.load_ms = Date.now() - t0;

    const total = () => page.eval(`(() => { const t = document.getElementById("total");
      return { value: Number(t.dataset.value), kind: t.dataset.kind, text: t.textContent }; })()`);
    // Each name's value in the flame graph's tree (summed over its frames).
    const values = () => page.eval(`(() => {
      const root = d3.select("#flame").datum(); const names = ${JSON.stringify(a.names)}; const v = {};
      for (const n of names) v[n] = 0;
      root.each((d) => { if (d.data.name in v) v[d.data.name] += d.data.value; });
      return v; })()`);
    // On a diff's page: each name's B - A (summed over its frames) and the
    // fill of its widest frame.
    const deltas = () => page.eval(`(() => {
      const root = d3.select("#flame").datum(); const names = ${JSON.stringify(a.names)}; const v = {};
      root.each((d) => { if (names.includes(d.data.name) && d.data.delta !== undefined) v[d.data.name] = (v[d.data.name] || 0) + d.data.delta; });
      return v; })()`);
    const fills = () => page.eval(`(() => { const v = {};
      for (const n of ${JSON.stringify(a.names)}) {
        const g = [...document.querySelectorAll("#flame g.frame")].filter((g) => g.getAttribute("name") === n)
          .sort((x, y) => y.querySelector("rect").getAttribute("width") - x.querySelector("rect").getAttribute("width"))[0];
        if (g) v[n] = { fill: g.querySelector("rect").getAttribute("fill"), title: g.querySelector("title")?.textContent }; }
      return v; })()`);
    out.title = await page.eval("document.title");
    out.frames_drawn = await page.eval(`document.querySelectorAll("#flame g.frame").length`);
    out.drawn_names = await page.eval(`[...new Set([...document.querySelectorAll("#flame g.frame")]
      .filter((g) => Number(g.querySelector("rect").getAttribute("width")) > 0).map((g) => g.getAttribute("name")))]`);
    out.initial = { total: await total(), values: await values(), deltas: await deltas(), frames: await fills() };
    out.text = {};
    for (const sel of a.texts)
      out.text[sel] = await page.eval(`[...document.querySelectorAll(${JSON.stringify(sel)})].map((e) => e.textContent)`);

    // Every value the select offers.
    out.kinds = {};
    const kinds = await page.eval(`[...document.querySelectorAll("#value option")].map((o) => o.value)`);
    for (const k of kinds) {
      await page.eval(`(() => { const s = document.getElementById("value"); s.value = ${JSON.stringify(k)};
        s.dispatchEvent(new Event("change")); })()`);
      await settle();
      out.kinds[k] = { total: await total(), values: await values(), deltas: await deltas() };
    }
    await page.eval(`(() => { const s = document.getElementById("value"); s.value = "live_bytes";
      s.dispatchEvent(new Event("change")); })()`);
    await settle();

    // A click on a frame zooms: its rectangle becomes as wide as the graph.
    if (a.click) {
      const sel = `#flame g.frame[name=${JSON.stringify(a.click)}]`;
      const geo = () => page.eval(`(() => { const g = [...document.querySelectorAll(${JSON.stringify(sel)})]
          .sort((x, y) => y.querySelector("rect").getAttribute("width") - x.querySelector("rect").getAttribute("width"))[0];
        if (!g) return null; g.scrollIntoView({ block: "center" });
        const r = g.querySelector("rect").getBoundingClientRect();
        return { width: Number(g.querySelector("rect").getAttribute("width")), x: r.left + Math.min(r.width / 2, 20), y: r.top + r.height / 2,
                 graph: Number(document.querySelector("#flame svg").getAttribute("width")) }; })()`);
      const before = await geo();
      out.zoom = { before };
      if (before) {
        await page.click(before.x, before.y);
        await settle();
        out.zoom.after = await geo();
      }
      await page.eval(`document.getElementById("reset-zoom").click()`);
      await settle();
      out.zoom.reset = await geo();
    }

    // Search: the frames that match are highlighted and summed.
    if (a.names.length) {
      await page.eval(`(() => { const s = document.getElementById("search"); s.value = ${JSON.stringify(a.names[0])};
        s.dispatchEvent(new Event("input")); })()`);
      await settle();
      out.search = await page.eval(`document.getElementById("details").textContent`);
      await page.eval(`(() => { const s = document.getElementById("search"); s.value = ""; s.dispatchEvent(new Event("input")); })()`);
    }

    // Time ranges dragged across the memory-over-time chart.
    out.ranges = [];
    for (const [from, to] of a.ranges) {
      const geo = await page.eval(`(() => { const svg = document.querySelector("#timeline svg");
        const o = document.querySelector("#timeline .brush .overlay"); if (!svg || !o) return null;
        o.scrollIntoView({ block: "center" }); const r = o.getBoundingClientRect();
        return { left: r.left, width: r.width, y: r.top + r.height / 2, origin: Number(svg.dataset.originNs), span: Number(svg.dataset.spanNs) }; })()`);
      if (!geo) {
        out.ranges.push({ error: "no brushable timeline" });
        continue;
      }
      const px = (t) => geo.left + ((t - geo.origin) / geo.span) * geo.width;
      await page.drag(px(from), geo.y, px(to), geo.y);
      await settle();
      out.ranges.push({
        from, to, x0: px(from), x1: px(to),
        range: await page.eval(`document.getElementById("range").textContent`),
        total: await total(),
        values: await values(),
      });
      await page.eval(`document.getElementById("range-clear").click()`);
      await settle();
    }
    out.after_ranges = { total: await total() };
  } finally {
    clearTimeout(deadline);
    await browser.close();
  }
  process.stdout.write(JSON.stringify(out) + "\n");
}

main().catch((e) => {
  process.stdout.write(JSON.stringify({ error: String(e && e.stack || e) }) + "\n");
  process.exit(1);
});
