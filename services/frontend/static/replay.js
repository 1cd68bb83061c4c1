/* replay.js: the player of the pages `pagedserve simulate --html` writes. Both runs' frames (one
   block-pool snapshot per step, the JSON of /v1/kv/events) are in #replay-data; each side draws
   its frame of the current step with kvmap.js. window.replay is there for tests. */
(function () {
  "use strict";

  const data = JSON.parse(document.getElementById("replay-data").textContent);
  const palette = new KvPalette();
  data.requests.forEach((r) => palette.hue(r.request_id));  // r0, r1, ... in order: the same colours both sides
  const lengths = data.requests.map((r) => `${r.prompt}:${r.answer}`).join(", ");
  const numBlocks = data.num_slots / data.block_size;
  document.getElementById("lede").textContent =
    `${data.requests.length} requests (prompt:answer tokens ${lengths}) arrive together; at every step each `
    + `running request produces one token. The pool holds ${data.num_slots} token slots: ${numBlocks} blocks of `
    + `${data.block_size}, one row per ${data.max_model_len} slots. Solid slots hold tokens; pale ones are `
    + "allocated but empty. Hover a block to see who holds it.";

  const tip = document.getElementById("tip");
  const sides = Object.entries(data.runs).map(([policy, run]) => {
    const root = document.getElementById(`side-${policy}`);  // both sides from one template
    root.append(document.getElementById("side-template").content.cloneNode(true));
    root.querySelector("h2").textContent = root.dataset.title;
    const map = new KvMap({
      device: root.querySelector("canvas"), palette, showSlots: true, maxCell: 80, maxHeight: 420,
      columns: Math.max(1, Math.round(data.max_model_len / data.block_size)),
      onHover: (info) => hover(info, map),
    });
    root.querySelector(".explain").textContent = policy === "paged"
      ? `Each request takes ${data.block_size}-slot blocks one at a time as it grows, anywhere in the pool; when `
        + "none is left, the newest request is preempted and its blocks freed (it is recomputed later)."
      : `Each request reserves ${data.max_model_len} slots in one unbroken run for its longest possible answer `
        + "when it is admitted; a request waits until such a run is free.";
    root.querySelector(".pool-caption").textContent = `${numBlocks} blocks \u00d7 ${data.block_size} slots`;
    return { policy, run, root, map };
  });

  function hover(info, map) {
    if (!info) {
      tip.hidden = true;
      map.setFocus(null);
      return;
    }
    const owners = info.cell.owners.map((o) => `${o.requestId} \u00b7 logical block ${o.logical}`);
    tip.textContent = [KvTable.describe("device", info.cell, data.block_size), ...owners].join("\n");
    tip.style.whiteSpace = "pre-line";
    tip.hidden = false;
    tip.style.left = `${Math.min(info.clientX + 14, window.innerWidth - tip.offsetWidth - 8)}px`;
    tip.style.top = `${Math.min(info.clientY + 14, window.innerHeight - tip.offsetHeight - 8)}px`;
    map.setFocus(info.cell.requestId);
  }

  const lastStep = Math.max(...sides.map((s) => s.run.frames.length - 1));
  const scrub = document.getElementById("scrub");
  scrub.max = String(lastStep);
  let step = 0;
  let timer = null;

  const pct = (x) => `${Math.round(100 * x)}%`;

  function showSide(side) {
    const frames = side.run.frames;
    const frame = frames[Math.min(step, frames.length - 1)];
    const snap = frame.snapshot;
    const s = snap.stats;
    side.map.update(snap);
    const set = (k, v) => { side.root.querySelector(`[data-k="${k}"]`).textContent = v; };
    set("queues", `${s.num_running} \u00b7 ${s.num_waiting} \u00b7 ${frame.finished.length}`);
    set("util", s.num_slots_allocated ? pct(s.num_slots_used / s.num_slots_allocated) : "\u2013");
    set("mean", s.sum_slots_allocated ? pct(s.sum_slots_used / s.sum_slots_allocated) : "\u2013");
    set("preempt", String(s.num_preemptions));
    side.root.querySelector(".done-note").hidden = step < frames.length - 1;
    side.root.querySelector(".done-note").textContent = `all done in ${frames.length - 1} steps`;
    const legend = side.root.querySelector(".legend-requests");
    legend.replaceChildren();
    const holding = new Set(snap.sequences.map((q) => q.request_id));
    for (const r of data.requests) {
      const item = document.createElement("span");
      const sw = document.createElement("span");
      sw.className = "swatch";
      sw.style.setProperty("--c", palette.color(r.request_id, 0));
      const status = frame.finished.includes(r.request_id) ? "done" : holding.has(r.request_id) ? "running" : "waiting";
      item.append(sw, `${r.request_id} ${status}`);
      item.style.opacity = status === "running" ? "1" : "0.55";
      legend.appendChild(item);
    }
  }

  function show(i) {
    step = Math.max(0, Math.min(lastStep, i));
    sides.forEach(showSide);
    scrub.value = String(step);
    document.getElementById("step-label").textContent = `step ${step} / ${lastStep}`;
    if (step >= lastStep) pause();
  }

  function play() {
    if (step >= lastStep) show(0);
    pause();
    timer = setInterval(() => show(step + 1), Number(document.getElementById("speed").value));
    document.getElementById("play").textContent = "Pause";
  }

  function pause() {
    clearInterval(timer);
    timer = null;
    document.getElementById("play").textContent = "Play";
  }

  document.getElementById("play").addEventListener("click", () => (timer ? pause() : play()));
  document.getElementById("back").addEventListener("click", () => { pause(); show(step - 1); });
  document.getElementById("forward").addEventListener("click", () => { pause(); show(step + 1); });
  document.getElementById("restart").addEventListener("click", () => { pause(); show(0); });
  document.getElementById("speed").addEventListener("change", () => timer && play());
  scrub.addEventListener("input", () => { pause(); show(Number(scrub.value)); });
  document.addEventListener("keydown", (e) => {
    if (e.target.closest("input, select, textarea")) return;
    if (e.key === "ArrowRight") { pause(); show(step + 1); }
    if (e.key === "ArrowLeft") { pause(); show(step - 1); }
    if (e.key === " ") { e.preventDefault(); timer ? pause() : play(); }
  });
  window.addEventListener("resize", () => show(step));

  const summaries = sides.map((s) => `${s.policy}: ${s.run.summary.steps} steps, `
    + `${pct(s.run.summary.mean_utilization)} mean slot utilization, at most ${s.run.summary.max_running} `
    + `requests at once, ${s.run.summary.preemptions} preemptions`);
  document.getElementById("notes").textContent = `${summaries.join("; ")}.`;
  window.replay = { data, sides, show, play, pause, get step() { return step; } };
  show(0);
})();
