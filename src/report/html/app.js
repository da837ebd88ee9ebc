// The HTML report's page (issue 19): reads the data report::write_html put in
// #memtrace-data and draws, per process image, the memory-over-time chart
// (a brushed time range filters the flame graph to the allocations live in
// it), the flame graph (d3-flame-graph) of the chosen value, the peak, the
// leaks, temporary allocations, lifetimes and churn. Everything it shows
// comes from that data; nothing is fetched. Names from the traced programs
// are set as text (d3 .text, textContent), never parsed as HTML.
(function () {
  "use strict";
  const { data, group, bytes, amount, seconds, frameName, frameLocation, el, table, buildTree, flameGraph } = memtracePage();

  // The flame graph's values; a kind is offered when the image has its column.
  const KINDS = [
    { key: "live_bytes", label: "live bytes at the end", unit: "bytes", count: "live_blocks" },
    { key: "peak_bytes", label: "live bytes at the peak", unit: "bytes" },
    { key: "alloc_bytes", label: "bytes allocated", unit: "bytes", count: "alloc_count" },
    { key: "alloc_count", label: "allocation count", unit: "allocations" },
    { key: "temporary", label: "temporary allocations", unit: "allocations" },
    { key: "pages", label: "pages touched (page faults)", unit: "pages" },
  ];
  const kindOf = (key) => KINDS.find((k) => k.key === key);

  // ---- formatting
  function duration(ns) {
    if (ns < 1e3) return `${ns} ns`;
    if (ns < 1e6) return `${+(ns / 1e3).toPrecision(3)} µs`;
    if (ns < 1e9) return `${+(ns / 1e6).toPrecision(3)} ms`;
    return `${+(ns / 1e9).toPrecision(3)} s`;
  }
  // ---- state
  const images = data.images;
  const state = { img: null, kind: "live_bytes", range: null };
  if (!images.length) {
    document.getElementById("summary").textContent = "No process allocated anything while traced.";
    return;
  }
  let best = 0;
  images.forEach((im, i) => {
    if (im.summary.allocs > images[best].summary.allocs) best = i;
  });

  const procSelect = document.getElementById("process");
  images.forEach((im, i) => {
    let label = `${im.comm} (${im.pid})`;
    if (im.image) label += ` image ${im.image}`;
    if (im.container && im.container.id) label += ` [${im.container.id.slice(0, 12)}]`;
    label += `: ${group(im.summary.allocs)} allocations`;
    procSelect.append(el("option", { value: i }, label));
  });
  procSelect.value = String(best);
  procSelect.addEventListener("change", () => selectImage(Number(procSelect.value)));

  const valueSelect = document.getElementById("value");
  valueSelect.addEventListener("change", () => {
    state.kind = valueSelect.value;
    drawFlame();
  });
  const flame = flameGraph(
    (d) => {
      const pct = ((100 * d.value) / (state.treeValue || 1)).toFixed(2);
      const loc = d.data.f !== undefined ? frameLocation(d.data.f) : "";
      return `${d.data.name}: ${amount(d.value, state.unit)} (${pct}%)${loc ? " — " + loc : ""}`;
    },
    () => state.unit,
  );
  document.getElementById("range-clear").addEventListener("click", () => clearRange());

  const footer = document.getElementById("footer");
  footer.textContent =
    `memtrace-bpf HTML report, written ${data.generated}` +
    (data.duration_ns ? `, ${seconds(data.duration_ns)} traced` : "") +
    `. Flame graphs by d3-flame-graph, charts by d3.`;

  // ---- per image
  function selectImage(i) {
    const im = images[i];
    state.img = im;
    state.range = null;
    document.title = `memtrace-bpf: ${im.comm} (${im.pid})`;
    drawSummary(im);
    valueSelect.textContent = "";
    for (const k of KINDS)
      if (im.values[k.key]) valueSelect.append(el("option", { value: k.key }, k.label));
    if (!im.values[state.kind]) state.kind = "live_bytes";
    valueSelect.value = state.kind;
    drawTimeline(im);
    drawFlame();
    drawPeak(im);
    drawLeaks(im);
    drawTemporary(im);
    drawLifetimes(im);
    drawChurn(im);
    const note = document.getElementById("cap-note");
    note.textContent = im.other_stacks
      ? `This page holds whole the ${group(im.kept_stacks)} stacks with the largest values of ${group(im.stacks_total)}; ` +
        `the other ${group(im.other_stacks)} are folded into frames "(N other stacks)", each under the longest ` +
        `call path it shares with a stack kept whole: every total stays exact.`
      : "";
  }

  function drawSummary(im) {
    const s = im.summary;
    const box = document.getElementById("summary");
    box.textContent = "";
    const items = [
      `${im.ended === "exec" ? "in use at exec" : im.ended === "exit" ? "in use at exit" : "in use"}: ` +
        `${bytes(s.in_use_bytes)} in ${group(s.in_use_blocks)} blocks`,
      `${group(s.allocs)} allocations, ${group(s.frees)} frees, ${bytes(s.bytes_allocated)} allocated`,
      `peak ${bytes(s.peak_in_use_bytes)}`,
    ];
    if (s.temporary_allocs !== undefined) items.push(`${group(s.temporary_allocs)} temporary`);
    if (s.mmap_bytes_direct) items.push(`${bytes(s.mmap_bytes_direct)} mapped directly`);
    const py = s.domains && s.domains.python;
    if (py && (py.allocs || py.in_use_blocks)) {
      const ma = s.domains.malloc;
      items.push(`malloc domain: ${bytes(ma.in_use_bytes)} in ${group(ma.in_use_blocks)} blocks, ${group(ma.allocs)} allocations`);
      items.push(`python domain (pymalloc): ${bytes(py.in_use_bytes)} in ${group(py.in_use_blocks)} blocks, ${group(py.allocs)} allocations`);
    }
    if (s.pages_first_touched !== undefined) items.push(`${group(s.pages_first_touched)} pages touched`);
    if (im.exit_code !== null && im.exit_code !== undefined) items.push(`exit status ${im.exit_code}`);
    const ct = im.container;
    if (ct) items.push(`container ${ct.runtime ? ct.runtime + " " : ""}${ct.id.slice(0, 12)}${ct.pod ? ", pod " + ct.pod : ""}`);
    if (im.cgroup) items.push(`cgroup ${im.cgroup}`);
    for (const t of items) box.append(el("span", {}, t));
  }

  // ---- memory over time
  function drawTimeline(im) {
    const box = document.getElementById("timeline");
    box.textContent = "";
    updateRangeText();
    const tl = im.timeline;
    if (!tl || !tl.ts.length) {
      box.append(el("div", { class: "note" }, "No memory-over-time data for this process."));
      return;
    }
    const width = Math.max(400, box.clientWidth || document.body.clientWidth - 40);
    const height = 220;
    const m = { top: 26, right: 20, bottom: 28, left: 70 };
    const w = width - m.left - m.right;
    const h = height - m.top - m.bottom;
    const series = [{ key: "in_use", label: "heap in use", values: tl.in_use }];
    if (tl.mapped) series.push({ key: "mapped", label: "mapped (mmap)", values: tl.mapped });
    if (tl.touched_pages && data.faults)
      series.push({ key: "rss", label: "RSS by page faults", values: tl.touched_pages.map((p) => p * data.page_size) });
    const tmax = Math.max(tl.ts[tl.ts.length - 1] + (tl.step_ns || 0), im.duration_ns || 0, 1);
    const x = d3.scaleLinear().domain([0, tmax / 1e9]).range([0, w]);
    const ymax = d3.max(series, (s) => d3.max(s.values)) || 1;
    const y = d3.scaleLinear().domain([0, ymax]).nice().range([h, 0]);
    // Where the chart's time axis starts (the events' clock) and how long it is.
    const svg = d3.select(box).append("svg").attr("width", width).attr("height", height)
      .attr("data-origin-ns", im.t0_ns).attr("data-span-ns", tmax);
    const g = svg.append("g").attr("transform", `translate(${m.left},${m.top})`);
    g.append("g").attr("transform", `translate(0,${h})`).call(d3.axisBottom(x).ticks(8).tickFormat((d) => `${d} s`));
    g.append("g").call(d3.axisLeft(y).ticks(5).tickFormat((d) => bytes(d)));
    for (const s of series) {
      const line = d3
        .line()
        .curve(d3.curveStepAfter)
        .x((_, i) => x(tl.ts[i] / 1e9))
        .y((v) => y(v));
      g.append("path").attr("class", `line ${s.key}`).attr("d", line(s.values));
    }
    if (im.peak_ts !== undefined) {
      const px = x(im.peak_ts / 1e9);
      g.append("line").attr("class", "peak").attr("x1", px).attr("x2", px).attr("y1", 0).attr("y2", h);
      const right = px > w - 40;
      g.append("text").attr("x", right ? px - 4 : px + 4).attr("y", 12).attr("font-size", 11)
        .attr("text-anchor", right ? "end" : "start").text("peak");
    }
    // The legend: one row above the plot.
    const legend = g.append("g").attr("class", "legend").attr("transform", "translate(0,-18)");
    series.forEach((s, i) => {
      legend.append("line").attr("class", `line ${s.key}`).attr("x1", i * 170).attr("x2", i * 170 + 18).attr("y1", 6).attr("y2", 6);
      legend.append("text").attr("x", i * 170 + 24).attr("y", 10).text(s.label);
    });
    if (!im.spans) {
      box.append(el("div", { class: "note" }, "No allocation spans in this report: a time range cannot filter the flame graph."));
      return;
    }
    const brush = d3
      .brushX()
      .extent([[0, 0], [w, h]])
      .on("end", (ev) => {
        if (!ev.sourceEvent) return; // moved by clearRange
        if (!ev.selection) {
          clearRange();
          return;
        }
        const [a, b] = ev.selection.map((px) => x.invert(px) * 1e9);
        state.range = [Math.max(0, a), b];
        updateRangeText();
        drawFlame();
      });
    state.brush = { g: g.append("g").attr("class", "brush").call(brush), brush };
  }

  function clearRange() {
    state.range = null;
    if (state.brush) state.brush.g.call(state.brush.brush.move, null);
    updateRangeText();
    drawFlame();
  }

  function updateRangeText() {
    const r = state.range;
    document.getElementById("range").textContent = r
      ? `range ${seconds(r[0])} – ${seconds(r[1])}: the flame graph shows the allocations live in it`
      : "";
    document.getElementById("range-clear").hidden = !r;
  }

  // Per stack, bytes and count of the allocations live at some moment in
  // [a, b] (ns from the image's start): a span of a stack is allocations made
  // in one time bucket and freed in one, live in [a, b] when made at or before
  // b's bucket and freed at or after a's.
  function rangeValues(im, a, b) {
    const sp = im.spans;
    const bucket = (t) => Math.floor((t - sp.offset_ns) / sp.bucket_ns);
    const ab = bucket(a);
    const bb = bucket(b);
    const bytesV = new Float64Array(im.stacks.length);
    const countV = new Float64Array(im.stacks.length);
    sp.by_stack.forEach((list, i) => {
      for (let j = 0; j < list.length; j += 4) {
        const alloc = list[j];
        const free = list[j + 1];
        if (alloc <= bb && (free === sp.live || free >= ab)) {
          bytesV[i] += list[j + 2];
          countV[i] += list[j + 3];
        }
      }
    });
    return { bytes: bytesV, count: countV };
  }

  // ---- flame graph
  function drawFlame() {
    const im = state.img;
    const kind = kindOf(state.kind);
    let values;
    let unit = kind.unit;
    let title;
    let extra = "";
    if (state.range) {
      const rv = rangeValues(im, state.range[0], state.range[1]);
      const byCount = kind.unit !== "bytes";
      values = byCount ? rv.count : rv.bytes;
      unit = byCount ? "allocations" : "bytes";
      title = `live in ${seconds(state.range[0])} – ${seconds(state.range[1])}`;
      const other = byCount ? d3.sum(rv.bytes) : d3.sum(rv.count);
      extra = byCount ? ` (${bytes(other)})` : ` in ${group(other)} allocations`;
    } else {
      values = im.values[kind.key];
      title = kind.label;
      if (kind.count) extra = ` in ${group(d3.sum(im.values[kind.count]))} ${kind.key === "live_bytes" ? "blocks" : "allocations"}`;
    }
    const tree = buildTree(`${im.comm} (${im.pid})`, im.stacks, values);
    const total = document.getElementById("total");
    total.textContent = `${title}: ${amount(tree.value, unit)}${extra}`;
    total.dataset.value = String(tree.value);
    total.dataset.kind = state.range ? `range:${unit}` : kind.key;

    state.unit = unit;
    state.treeValue = tree.value;
    flame.draw(tree, im);
  }

  // ---- tables of stacks
  // The stacks with the largest `key`, largest first, n at most.
  function topStacks(im, key, n) {
    const v = im.values[key];
    if (!v) return [];
    const idx = [];
    for (let i = 0; i < v.length; i++) if (v[i]) idx.push(i);
    idx.sort((a, b) => v[b] - v[a]);
    return idx.slice(0, n);
  }

  function drawPeak(im) {
    const box = document.getElementById("peak");
    box.textContent = "";
    const s = im.summary;
    let text = `Peak heap in use: ${bytes(s.peak_in_use_bytes)}`;
    if (im.peak_ts !== undefined) text += `, at ${seconds(im.peak_ts)}`;
    box.append(el("p", {}, text + "."));
    if (!im.values.peak_bytes) {
      box.append(el("div", { class: "note" }, "This report has no stacks live at the peak."));
      return;
    }
    const v = im.values.peak_bytes;
    box.append(el("div", { class: "note" }, "Stacks live at the peak, largest first:"));
    box.append(table(im, topStacks(im, "peak_bytes", 15), [["bytes at the peak", (i) => bytes(v[i]), "num"]]));
  }

  function drawLeaks(im) {
    const box = document.getElementById("leaks");
    box.textContent = "";
    const rows = topStacks(im, "live_bytes", 20);
    const lb = im.values.live_bytes;
    const lc = im.values.live_blocks;
    const n = lb.filter((v) => v).length;
    if (!rows.length) {
      box.append(el("p", {}, "Nothing was live at the end."));
      return;
    }
    box.append(
      el("p", {}, `${bytes(im.summary.in_use_bytes)} in ${group(im.summary.in_use_blocks)} blocks from ${group(n)} stacks; the largest ${rows.length}:`),
    );
    box.append(
      table(im, rows, [
        ["bytes", (i) => group(lb[i]), "num"],
        ["blocks", (i) => group(lc[i]), "num"],
      ]),
    );
  }

  function drawTemporary(im) {
    const box = document.getElementById("temporary");
    box.textContent = "";
    const t = im.values.temporary;
    if (!t) {
      box.append(el("div", { class: "note" }, "This report has no temporary-allocation counts."));
      return;
    }
    const total = d3.sum(t);
    const allocs = im.summary.allocs || 1;
    box.append(
      el(
        "p",
        {},
        `${group(total)} of ${group(im.summary.allocs)} allocations (${((100 * total) / allocs).toFixed(1)}%) were temporary: ` +
          "freed by the thread that made them with no other allocator call of that thread in between (heaptrack's definition).",
      ),
    );
    const ac = im.values.alloc_count;
    box.append(
      table(im, topStacks(im, "temporary", 15), [
        ["temporary", (i) => group(t[i]), "num"],
        ["of allocations", (i) => `${((100 * t[i]) / (ac[i] || 1)).toFixed(0)}%`, "num"],
      ]),
    );
  }

  function drawLifetimes(im) {
    const box = document.getElementById("lifetimes");
    box.textContent = "";
    const lt = im.lifetimes;
    if (!lt) {
      box.append(el("div", { class: "note" }, "This report has no allocation lifetimes."));
      return;
    }
    // Buckets i: freed after [2^i, 2^(i+1)) ns; shown from the first used to the last.
    let lo = lt.freed.findIndex((v) => v);
    let hi = lt.freed.length - 1;
    while (hi >= 0 && !lt.freed[hi]) hi--;
    const bars = [];
    if (lo >= 0)
      for (let i = lo; i <= hi; i++)
        bars.push({ label: `< ${duration(2 ** (i + 1))}`, v: lt.freed[i], bytes: lt.freed_bytes ? lt.freed_bytes[i] : undefined });
    bars.push({ label: "live at end", v: lt.live_at_end, live: true });
    const width = Math.max(400, Math.min(box.clientWidth || 900, 60 + bars.length * 44));
    const height = 180;
    const m = { top: 8, right: 10, bottom: 60, left: 60 };
    const x = d3.scaleBand().domain(bars.map((b) => b.label)).range([0, width - m.left - m.right]).padding(0.15);
    const y = d3.scaleLinear().domain([0, d3.max(bars, (b) => b.v) || 1]).nice().range([height - m.top - m.bottom, 0]);
    const svg = d3.select(box).append("svg").attr("width", width).attr("height", height);
    const g = svg.append("g").attr("transform", `translate(${m.left},${m.top})`);
    g.append("g").attr("transform", `translate(0,${height - m.top - m.bottom})`).call(d3.axisBottom(x))
      .selectAll("text").attr("transform", "rotate(-40)").style("text-anchor", "end");
    g.append("g").call(d3.axisLeft(y).ticks(4).tickFormat(d3.format("~s")));
    g.selectAll("rect.bar").data(bars).join("rect")
      .attr("class", (b) => (b.live ? "bar live" : "bar"))
      .attr("x", (b) => x(b.label)).attr("width", x.bandwidth())
      .attr("y", (b) => y(b.v)).attr("height", (b) => y(0) - y(b.v))
      .append("title").text((b) => `${b.label}: ${group(b.v)} allocations` + (b.bytes !== undefined ? `, ${bytes(b.bytes)}` : ""));
    box.append(el("div", { class: "note" }, "Allocations by how long they lived (malloc to free)."));
  }

  function drawChurn(im) {
    const box = document.getElementById("churn");
    box.textContent = "";
    const dur = (im.duration_ns || 0) / 1e9;
    const ac = im.values.alloc_count;
    const ab = im.values.alloc_bytes;
    const rows = topStacks(im, "alloc_count", 15);
    box.append(
      el("p", {}, `${group(im.summary.allocs)} allocations` + (dur > 0 ? ` in ${seconds(im.duration_ns)}: ${group(Math.round(im.summary.allocs / dur))} per second` : "") + `; the busiest stacks:`),
    );
    const cols = [
      ["allocations", (i) => group(ac[i]), "num"],
      ["bytes", (i) => bytes(ab[i]), "num"],
    ];
    if (dur > 0) cols.push(["per second", (i) => group(Math.round(ac[i] / dur)), "num"]);
    box.append(table(im, rows, cols));
  }

  selectImage(best);
})();
