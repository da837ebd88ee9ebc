// What the HTML pages share (issue 19): the one-trace report (page.html,
// app.js) and the diff (diff.html, diff.js) both call memtracePage(), which
// reads the data report::write_html or write_diff_html put in #memtrace-data
// and gives the helpers that draw it: numbers in words, frames (a table
// shared by the page's stacks: name, file, line, module, inlined), tables of
// stacks, the flame graph's tree and chart (d3-flame-graph) with its search
// box and zoom reset. Names from the traced programs are set as text (d3
// .text, textContent), never parsed as HTML.
function memtracePage() {
  "use strict";
  const data = JSON.parse(document.getElementById("memtrace-data").textContent);
  const str = (i) => (i >= 0 ? data.strings[i] : "");

  // ---- formatting
  const group = d3.format(",d");
  function bytes(v) {
    const units = ["bytes", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    let x = v;
    while (Math.abs(x) >= 1024 && i < units.length - 1) {
      x /= 1024;
      i++;
    }
    return i === 0 ? `${group(v)} bytes` : `${x.toFixed(Math.abs(x) < 10 ? 2 : 1)} ${units[i]}`;
  }
  function amount(v, unit) {
    return unit === "bytes" ? bytes(v) : `${group(v)} ${unit}`;
  }
  function seconds(ns) {
    const s = ns / 1e9;
    return s < 10 ? `${s.toFixed(3)} s` : `${s.toFixed(1)} s`;
  }
  function frameName(f) {
    return str(data.frames[f][0]);
  }
  function frameLocation(f) {
    const fr = data.frames[f];
    const file = str(fr[1]);
    const mod = str(fr[3]);
    let s = file ? `${file}:${fr[2]}` : "";
    if (mod) s += `${s ? " " : ""}in ${mod.slice(mod.lastIndexOf("/") + 1)}`;
    if (fr[4]) s += " (inlined)";
    return s;
  }
  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
    return e;
  }

  // ---- tables of stacks (im.stacks: frame lists, outermost first)
  // The stack cell: the innermost frame and where it is, the whole stack below.
  function stackCell(im, i) {
    const frames = im.stacks[i];
    const td = el("td");
    if (!frames.length) {
      td.append("(no stack)");
      return td;
    }
    const inner = frames[frames.length - 1];
    td.append(el("div", { class: "fn" }, frameName(inner)), el("div", { class: "loc" }, frameLocation(inner)));
    // Its caller too: the innermost frame is often an allocator's wrapper (operator new).
    if (frames.length > 1)
      td.append(el("div", { class: "loc" }, "called from ", el("span", { class: "fn" }, frameName(frames[frames.length - 2]))));
    if (frames.length > 1) {
      const det = el("details", {}, el("summary", {}, `${frames.length} frames`));
      const ol = el("ol");
      for (let j = frames.length - 1; j >= 0; j--)
        ol.append(el("li", {}, el("span", { class: "fn" }, frameName(frames[j])), " ", el("span", { class: "loc" }, frameLocation(frames[j]))));
      det.append(ol);
      td.append(det);
    }
    return td;
  }

  // columns: [header, (i) => value, class]
  function table(im, rows, columns) {
    const t = el("table");
    const head = el("tr");
    for (const [h, , cls] of columns) head.append(el("th", cls ? { class: cls } : {}, h));
    head.append(el("th", {}, "allocation stack (innermost first)"));
    t.append(head);
    for (const i of rows) {
      const tr = el("tr");
      for (const [, f, cls] of columns) tr.append(el("td", cls ? { class: cls } : {}, f(i)));
      tr.append(stackCell(im, i));
      t.append(tr);
    }
    return t;
  }

  // ---- flame graph
  // The tree of stacks (frame lists, outermost first): a frame is as wide as
  // the values of the stacks through it; each column of `sums` (name ->
  // values by stack) is added up per frame the same way, as a field of it.
  function buildTree(name, stacks, values, sums = {}) {
    const keys = Object.keys(sums);
    const root = { name, value: 0, children: [] };
    for (const k of keys) root[k] = 0;
    const index = new Map(); // node -> Map(name -> child)
    index.set(root, new Map());
    for (let i = 0; i < stacks.length; i++) {
      const v = values[i];
      if (!v) continue;
      root.value += v;
      for (const k of keys) root[k] += sums[k][i];
      let node = root;
      for (const f of stacks[i]) {
        const fname = frameName(f);
        const kids = index.get(node);
        let child = kids.get(fname);
        if (!child) {
          child = { name: fname, value: 0, children: [], f };
          for (const k of keys) child[k] = 0;
          if (data.frames[f][4]) child.l = "inlined";
          kids.set(fname, child);
          index.set(child, new Map());
          node.children.push(child);
        }
        child.value += v;
        for (const k of keys) child[k] += sums[k][i];
        node = child;
      }
    }
    return root;
  }

  // The flame graph in #flame (d3-flame-graph), its line of details in
  // #details, the search box #search and #reset-zoom: label(d) names a
  // frame, unit() is what the widths count now (for the search's sums),
  // configure(chart) sets more of a new chart. draw(tree, owner) draws tree:
  // a new chart when owner (what the tree is of) or the width changed, else
  // the same chart updated (its zoom and search kept).
  function flameGraph(label, unit, configure = () => {}) {
    const box = document.getElementById("flame");
    const details = document.getElementById("details");
    const search = document.getElementById("search");
    const state = { chart: null, owner: null, width: 0 };
    const applySearch = () => {
      if (!state.chart) return;
      if (search.value) state.chart.search(search.value);
      else {
        state.chart.clear();
        details.textContent = "";
      }
    };
    search.addEventListener("input", applySearch);
    document.getElementById("reset-zoom").addEventListener("click", () => state.chart && state.chart.resetZoom());
    function draw(tree, owner) {
      const width = Math.max(400, box.clientWidth || document.body.clientWidth - 40);
      if (state.chart && state.owner === owner && state.width === width) state.chart.update(tree);
      else {
        box.textContent = "";
        const chart = flamegraph
          .default()
          .width(width)
          .cellHeight(18)
          .minFrameSize(1)
          .transitionDuration(300)
          .sort(true)
          .setDetailsElement(details)
          .setSearchMatch((d, term) => !!term && d.data.name.toLowerCase().includes(term.toLowerCase()))
          .setSearchHandler((results, sum, totalValue) => {
            details.textContent = results.length
              ? `search: ${amount(sum, unit())} of ${amount(totalValue, unit())} (${((100 * sum) / (totalValue || 1)).toFixed(1)}%) in ${results.length} frames`
              : "search: no frame matches";
          });
        chart.label(label);
        configure(chart);
        Object.assign(state, { chart, owner, width });
        d3.select(box).datum(tree).call(chart);
      }
      if (search.value) applySearch();
    }
    return { draw };
  }

  return { data, str, group, bytes, amount, seconds, frameName, frameLocation, el, stackCell, table, buildTree, flameGraph };
}
