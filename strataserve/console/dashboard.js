// Dashboard: polls /console/api/stats once a second (only the samples it has not seen) and draws uPlot charts
// of the last 10 minutes. The server keeps the history, so a fresh page starts with it.
"use strict";
(() => {
  const S = window.Strata;
  const $ = S.$;
  const samples = [];
  let last = 0;
  let history = 600;
  let timer = null;
  const charts = {};
  const COLORS = ["#2f6fde", "#e8793a", "#1f9d55", "#a04bd6", "#d64545", "#1aa3b8", "#8a8f1c", "#6b7385"];

  // A series key is "model/class"; model names can hold "/" (HF names, folder paths), so the model of a key is
  // read from the series' own `model` field, never by splitting the key.
  const modelOf = new Map();
  const filterKey = () => $("series-filter").value;
  const filterModel = () => modelOf.get(filterKey());
  const seriesKeys = (s) => {
    const f = filterKey();
    return f ? (s.series[f] ? [f] : []) : Object.keys(s.series);
  };
  const engineNames = (s) => {
    const f = filterKey();
    const names = Object.keys(s.engines);
    return f ? names.filter((n) => n === filterModel()) : names;
  };
  const HEIGHT = 170;
  const clock = (u, splits) => splits.map((t) => new Date(t * 1000).toLocaleTimeString("en-GB"));
  const ms = (v) => (v == null ? null : v * 1000);
  const pct = (v) => (v == null ? null : v * 100);

  // Each chart: a title, a y unit, and lines(sample) -> [[label, value], ...] for one sample.
  const DEFS = {
    "ch-tps": ["Output tokens/s", "tok/s", (s) => {
      if (filterKey()) return seriesKeys(s).map((k) => [k, s.series[k].tps]);
      return [["total", s.tps], ...engineNames(s).map((n) => [n, s.engines[n].tps])];
    }],
    "ch-reqs": ["Requests running / waiting", "requests", (s) => engineNames(s).flatMap((n) => [
      [n + " running", s.engines[n].running], [n + " waiting", s.engines[n].waiting]])],
    "ch-ttft": ["Time to first token P50 / P95", "ms", (s) => seriesKeys(s).flatMap((k) => [
      [k + " P50", ms(s.series[k].ttft_p50)], [k + " P95", ms(s.series[k].ttft_p95)]])],
    "ch-itl": ["Inter-token latency P50 / P95", "ms", (s) => seriesKeys(s).flatMap((k) => [
      [k + " P50", ms(s.series[k].itl_p50)], [k + " P95", ms(s.series[k].itl_p95)]])],
    "ch-kv": ["KV-cache usage / prefix-cache hits", "%", (s) => engineNames(s).flatMap((n) => [
      [n + " KV used", pct(s.engines[n].kv_usage)], [n + " prefix hits", pct(s.engines[n].prefix_hit_rate)]])],
    "ch-preempt": ["Preemptions", "per s", (s) => engineNames(s).map((n) => [n, s.engines[n].preemptions])],
    "ch-cost": ["Cost per 1k output tokens P50 / P95", "$", (s) => seriesKeys(s).flatMap((k) => [
      [k + " P50", s.series[k].cost_p50], [k + " P95", s.series[k].cost_p95]])],
    "ch-e2e": ["End-to-end latency P50 / P95", "s", (s) => seriesKeys(s).flatMap((k) => [
      [k + " P50", s.series[k].e2e_p50], [k + " P95", s.series[k].e2e_p95]])],
  };

  function build(id) {
    const [title, unit, lines] = DEFS[id];
    // Labels come from the newest sample: a model or class that appears later adds its lines then.
    const labels = samples.length ? lines(samples[samples.length - 1]).map((l) => l[0]) : [];
    const data = [samples.map((s) => s.t)];
    const index = new Map(labels.map((l, i) => [l, i]));
    for (let i = 0; i < labels.length; i++) data.push(new Array(samples.length).fill(null));
    samples.forEach((s, j) => {
      for (const [label, v] of lines(s)) if (index.has(label)) data[index.get(label) + 1][j] = v;
    });
    const el = $(id);
    const sig = labels.join("\n");
    const width = Math.max(200, el.clientWidth - 8);
    let c = charts[id];
    if (!c || c.sig !== sig) {
      if (c) c.plot.destroy();
      const opts = {
        title, width, height: HEIGHT, legend: { live: false },
        scales: { x: { time: true }, y: { range: (u, lo, hi) => [Math.min(0, lo ?? 0), hi > 0 ? hi * 1.1 : 1] } },
        axes: [{ values: clock, size: 28 }, { label: unit, size: 50 }],
        series: [{}, ...labels.map((l, i) => ({ label: l, stroke: COLORS[i % COLORS.length], width: 1.5,
          points: { show: false },
          dash: l.endsWith(" P95") || l.endsWith(" waiting") || l.endsWith("prefix hits") ? [5, 4] : undefined }))],
      };
      c = charts[id] = { plot: new uPlot(opts, data, el), sig };
      c.plot.root.dataset.chart = id;
    } else {
      if (c.plot.width !== width) c.plot.setSize({ width, height: HEIGHT });
      c.plot.setData(data);
    }
  }

  const fmt = (v, digits) => (v == null ? "–" : Number(v).toLocaleString("en-US", { maximumFractionDigits: digits }));

  // With a filter: tokens and tokens/s of that model and class (the router's count, at the end of each request);
  // running and waiting of that model's engine, all classes (an engine does not know classes). The labels say so.
  function counters() {
    const s = samples[samples.length - 1];
    if (!s) return;
    for (const [k, row] of Object.entries(s.series)) modelOf.set(k, row.model);
    let ok = 0, errors = 0, aborted = 0;
    for (const k of seriesKeys(s)) {
      ok += s.series[k].ok;
      errors += s.series[k].errors;
      aborted += s.series[k].aborted || 0;
    }
    const f = filterKey();
    const row = f ? s.series[f] : null;
    const engine = f ? s.engines[filterModel()] : null;
    $("c-tokens").textContent = fmt(f ? (row ? row.tokens_total : null) : s.tokens_total, 0);
    $("c-tps").textContent = fmt(f ? (row ? row.tps : null) : s.tps, 1);
    $("c-running").textContent = fmt(f ? (engine ? engine.running : null) : s.running, 0);
    $("c-waiting").textContent = fmt(f ? (engine ? engine.waiting : null) : s.waiting, 0);
    $("c-ok").textContent = fmt(ok, 0);
    $("c-errors").textContent = fmt(errors, 0);
    $("c-aborted").textContent = fmt(aborted, 0);
    $("l-tokens").textContent = f ? `output tokens · ${f} (finished requests)` : "output tokens";
    $("l-tps").textContent = f ? `tokens/s · ${f}` : "tokens/s";
    $("l-running").textContent = f ? `running · ${filterModel()}, all classes` : "running";
    $("l-waiting").textContent = f ? `waiting · ${filterModel()}, all classes` : "waiting";
    const sel = $("series-filter");
    const keys = Object.keys(s.series).sort();
    const have = [...sel.options].slice(1).map((o) => o.value);
    if (keys.join() !== have.join()) {
      const v = sel.value;
      sel.replaceChildren(new Option("all", ""), ...keys.map((k) => new Option(k, k)));
      sel.value = keys.includes(v) ? v : "";
    }
  }

  function redraw() {
    counters();
    if (S.current !== "dashboard") return;
    for (const id of Object.keys(DEFS)) build(id);
  }

  async function poll() {
    try {
      const doc = await S.json("/console/api/stats?since=" + last);
      history = doc.history;
      for (const s of doc.samples) samples.push(s);
      if (samples.length > history) samples.splice(0, samples.length - history);
      if (samples.length) last = samples[samples.length - 1].t;
      S.setConn(true, "live");
      redraw();
    } catch (e) {
      if (e instanceof S.AuthError) { stop(); return; }
      S.setConn(false, "offline");
    }
    timer = setTimeout(poll, 1000);
  }
  function stop() { clearTimeout(timer); timer = null; }

  $("series-filter").addEventListener("change", redraw);
  window.addEventListener("resize", redraw);
  S.onReady.push(() => { if (!timer) poll(); });
  S.pages.dashboard = { show: redraw };
})();
