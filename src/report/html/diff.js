// The diff page (`memtrace-bpf diff A B -o d.html`, issue 19): reads the
// data report::write_diff_html put in #memtrace-data and draws, per program
// (matched as the text diff matches them: by command name), a differential
// flame graph of B − A (d3-flame-graph's differential colours: red grew,
// blue shrank) switchable between bytes in use, bytes allocated and
// allocation counts, and the tables of the stacks that grew and shrank.
(function () {
  "use strict";
  const { data, group, bytes, amount, frameLocation, el, table, buildTree, flameGraph } = memtracePage();

  const KINDS = [
    { key: "live_bytes", label: "bytes in use", unit: "bytes" },
    { key: "alloc_bytes", label: "bytes allocated", unit: "bytes" },
    { key: "alloc_count", label: "allocation count", unit: "allocations" },
  ];
  const kindOf = (key) => KINDS.find((k) => k.key === key);
  // A change with its sign, "+660" or "-660" (d3's format writes U+2212).
  const signed = (v) => (v > 0 ? "+" : v < 0 ? "-" : "") + group(Math.abs(v));
  const signedAmount = (v, unit) => (v > 0 ? "+" : v < 0 ? "-" : "") + amount(Math.abs(v), unit);
  const pids = (list) => (!list.length ? "none" : (list.length === 1 ? "pid " : "pids ") + list.slice(0, 8).join(", ") + (list.length > 8 ? ", ..." : ""));

  const state = { g: null, kind: "live_bytes" };
  document.getElementById("footer").textContent =
    `memtrace-bpf diff, written ${data.generated}: A = ${data.a}, B = ${data.b}; stacks matched by ` +
    (data.match === "line" ? "function, file and line" : "function") + ". Flame graphs by d3-flame-graph.";
  const notes = document.getElementById("notes");
  for (const n of data.notes) notes.append(el("li", {}, n));
  if (!data.notes.length) document.getElementById("notes-section").hidden = true;

  const groups = data.groups;
  if (!groups.length) {
    document.getElementById("summary").textContent = `No change from ${data.a} to ${data.b}.`;
    return;
  }
  const groupSelect = document.getElementById("group");
  groups.forEach((g, i) => {
    const d = g.delta.in_use_bytes;
    groupSelect.append(el("option", { value: i }, `${g.label}: ${signedAmount(d, "bytes")} in use`));
  });
  groupSelect.addEventListener("change", () => selectGroup(groups[Number(groupSelect.value)]));
  const valueSelect = document.getElementById("value");
  valueSelect.addEventListener("change", () => {
    state.kind = valueSelect.value;
    drawFlame();
  });
  // Red grew, blue shrank: d3-flame-graph's differential colours (which
  // keep orange for a frame only in B: here it is as red as growth goes, as
  // one only in A is blue).
  const differential = flamegraph.colorMapper.differentialColorMapper;
  const flame = flameGraph(
    (d) => {
      const loc = d.data.f !== undefined ? frameLocation(d.data.f) : "";
      return `${d.data.name}: ${signedAmount(d.data.delta, state.unit)} (A ${amount(d.data.a, state.unit)}, B ${amount(d.data.b, state.unit)})${loc ? " — " + loc : ""}`;
    },
    () => state.unit,
    (chart) =>
      chart.setColorMapper((d, original) =>
        !d.highlight && d.data.a === 0 && d.data.b > 0 ? "rgb(220,0,0)" : differential(d, original),
      ),
  );

  function selectGroup(g) {
    state.g = g;
    document.title = `memtrace-bpf diff: ${g.label}`;
    drawSummary(g);
    valueSelect.textContent = "";
    for (const k of KINDS) if (g.values[k.key]) valueSelect.append(el("option", { value: k.key }, k.label));
    if (!g.values[state.kind]) state.kind = "live_bytes";
    valueSelect.value = state.kind;
    drawFlame();
    drawSection(g, "grew");
    drawSection(g, "shrank");
    document.getElementById("cap-note").textContent = g.other_stacks
      ? `This page holds whole the ${group(g.kept_stacks)} stacks that changed the most of ${group(g.stacks_total)}; ` +
        `the other ${group(g.other_stacks)} are added up in one frame "(N other stacks)": every total stays exact.`
      : "";
  }

  // "A → B (B − A)"; unit "": counts with no unit.
  function fromTo(a, b, unit) {
    const f = (v) => (unit ? amount(v, unit) : group(v));
    return `${f(a)} → ${f(b)} (${unit ? signedAmount(b - a, unit) : signed(b - a)})`;
  }

  function drawSummary(g) {
    const box = document.getElementById("summary");
    box.textContent = "";
    box.append(
      el("span", {}, `A: ${data.a} (${pids(g.a.pids)})`),
      el("span", {}, `B: ${data.b} (${pids(g.b.pids)})`),
      el("span", {}, `in use: ${fromTo(g.a.in_use_bytes, g.b.in_use_bytes, "bytes")}, ${fromTo(g.a.in_use_blocks, g.b.in_use_blocks, "blocks")}`),
      el("span", {}, `allocations: ${fromTo(g.a.allocs, g.b.allocs, "")}`),
      el("span", {}, `bytes allocated: ${fromTo(g.a.bytes_allocated, g.b.bytes_allocated, "bytes")}`),
    );
  }

  // ---- the differential flame graph
  function drawFlame() {
    const g = state.g;
    const kind = kindOf(state.kind);
    const { a, b } = g.values[kind.key];
    const widths = a.map((v, i) => Math.max(v, b[i]));
    const tree = buildTree(g.label, g.stacks, widths, { a, b });
    // B − A of every frame: what d3-flame-graph's differential colours read.
    (function delta(n) {
      n.delta = n.b - n.a;
      n.children.forEach(delta);
    })(tree);
    const total = document.getElementById("total");
    total.textContent = `${kind.label}: ${fromTo(tree.a, tree.b, kind.unit)}`;
    total.dataset.value = String(tree.delta);
    total.dataset.kind = kind.key;
    state.unit = kind.unit;

    flame.draw(tree, g);
  }

  // ---- what grew, what shrank (the first --top of each, as the text diff lists them)
  function drawSection(g, which) {
    const s = g[which];
    const box = document.getElementById(which);
    box.textContent = "";
    if (!s.total) {
      box.append(el("p", {}, "Nothing."));
      return;
    }
    let text = `${group(s.total)} ${s.total === 1 ? "stack" : "stacks"}, ${signedAmount(s.delta.live_bytes, "bytes")} and ` +
      `${signed(s.delta.live_blocks)} blocks in use`;
    if (g.allocs_by_stack) text += `, ${signed(s.delta.allocs)} allocations`;
    box.append(el("p", {}, text + (s.stacks.length < s.total ? `; the largest ${s.stacks.length}:` : ":")));
    const rows = s.stacks;
    const cls = which;
    const cols = [
      ["bytes in use", (i) => signed(rows[i].delta.live_bytes), `num ${cls}`],
      ["blocks", (i) => signed(rows[i].delta.live_blocks), "num"],
      ["A → B bytes in use", (i) => `${group(rows[i].a.live_bytes)} → ${group(rows[i].b.live_bytes)}`, "num"],
      ["A → B blocks", (i) => `${group(rows[i].a.live_blocks)} → ${group(rows[i].b.live_blocks)}`, "num"],
    ];
    if (g.allocs_by_stack) cols.push(["allocations", (i) => `${signed(rows[i].delta.allocs)} (${group(rows[i].a.allocs)} → ${group(rows[i].b.allocs)})`, "num"]);
    box.append(table({ stacks: rows.map((r) => g.stacks[r.stack]) }, rows.map((_, i) => i), cols));
    if (s.stacks.length < s.total) box.append(el("div", { class: "note" }, `${group(s.total - s.stacks.length)} more (diff --top N shows more).`));
  }

  selectGroup(groups[0]);
})();
