/* pool.js: the pool panel of the playground page around the map (kvmap.js): the counters, the
   sequences holding blocks and the block table of the one in focus, the tooltip of a hovered
   cell, and pausing. The focus (a request id) is shared with the chat: hovering an answer, a
   sequence or a cell highlights that request's blocks. */
(function (root) {
  "use strict";

  const { $, el, shortId, pct } = root.PG;

  /** Wire the panel to ``map`` (a KvMap whose onHover is the returned ``onCellHover``) and the
      page's ``state`` (focus, requests, mapPaused, heldSnapshot); returns what the page calls. */
  function poolPanel(map, palette, state) {
    function updatePanels() {
      const snap = map.lastSnapshot;
      const s = snap.stats;
      const total = s.num_blocks_total;
      const cached = s.num_cached_blocks;
      const used = s.num_blocks_used;
      const free = Math.max(0, total - used - cached);
      $("c-used").textContent = used;
      $("c-cached").textContent = cached;
      $("c-free").textContent = free;
      $("c-util").textContent = s.num_slots_allocated ? pct(s.num_slots_used / s.num_slots_allocated) : "\u2013";
      $("c-util").parentElement.title = "slots holding tokens / slots in allocated blocks, now"
        + (s.sum_slots_allocated ? ` (mean over all steps: ${pct(s.sum_slots_used / s.sum_slots_allocated)})` : "");
      $("c-queues").textContent = `${s.num_running} \u00b7 ${s.num_waiting} \u00b7 ${s.num_swapped}`;
      $("c-preempt").textContent = s.num_preemptions;
      $("c-preempt").parentElement.title = `${s.num_swap_outs} by swap, ${s.num_recomputes} by recompute`;
      $("usage").querySelector(".u-used").style.width = pct(total ? used / total : 0);
      $("usage").querySelector(".u-cached").style.width = pct(total ? cached / total : 0);
      const numCpu = snap.cpu_blocks.num_blocks;
      const grouped = (pool) => {
        const layout = map.layout(pool);
        return layout && layout.group > 1 ? ` \u00b7 one cell per ${layout.group} blocks` : "";
      };
      $("device-caption").textContent = `${total} blocks \u00d7 ${snap.block_size} token slots${grouped("device")}`;
      $("cpu-caption").textContent = numCpu
        ? `${numCpu} blocks${grouped("cpu")} \u00b7 used by --preemption-mode swap`
        : "none (serve with --swap-space)";
      $("pool-caption").textContent = `snapshot ${snap.snapshot_id}`;
      renderSequences();
      renderDetail();
    }

    /** One row per request holding blocks. Rows are kept (keyed by request id) and refilled, so
        that the row under the pointer stays the same element while snapshots arrive. */
    function renderSequences() {
      const box = $("requests");
      const byRequest = map.requests();
      const rows = new Map([...box.querySelectorAll(".req")].map((row) => [row.dataset.request, row]));
      if (!byRequest.size) {
        box.replaceChildren(el("p", "hint", "No sequence holds blocks right now."));
        return;
      }
      const bs = map.lastSnapshot.block_size;
      const ordered = [];
      for (const [rid, seqs] of byRequest) {
        const row = rows.get(rid) || el("div", "req");
        row.dataset.request = rid;
        row.classList.toggle("focused", state.focus === rid);
        const swatches = el("span", "swatches");
        for (const seq of seqs) {
          const sw = el("span", "swatch");
          sw.style.setProperty("--c", palette.color(rid, seq.choice));
          swatches.appendChild(sw);
        }
        const parts = [swatches, el("span", "rid", shortId(rid))];
        if (state.requests.some((r) => r.id === rid)) parts.push(el("span", "tag", "this page"));
        if (seqs.some((q) => q.on_cpu)) parts.push(el("span", "tag cpu", "swapped to CPU"));
        const blocks = new Set(seqs.flatMap((q) => q.block_table.filter((b) => b >= 0).map((b) => `${q.on_cpu}:${b}`))).size;
        const tokens = Math.max(...seqs.map((q) => q.num_tokens));
        parts.push(el("span", "req-info", `${seqs.length} seq${seqs.length > 1 ? "s" : ""} \u00b7 ${blocks} `
          + `block${blocks === 1 ? "" : "s"} \u00b7 ${tokens} tokens`));
        row.replaceChildren(...parts);
        row.title = `${rid}: ${Math.ceil(tokens / bs)} blocks per sequence`;
        ordered.push(row);
      }
      const current = [...box.children];
      if (current.length !== ordered.length || current.some((node, i) => node !== ordered[i])) {
        box.replaceChildren(...ordered);
      }
    }

    function renderDetail() {
      const box = $("detail");
      box.replaceChildren();
      const seqs = state.focus ? map.requests().get(state.focus) : null;
      if (!seqs) {
        box.appendChild(el("p", "hint", "Block tables appear here: logical block \u2192 physical block, \u00d7 the "
          + "reference count when tables share it."));
        return;
      }
      box.appendChild(el("div", "detail-title", state.focus));
      for (const seq of seqs) {
        const line = el("div", "detail-seq");
        const label = el("span", "detail-label", `choice ${seq.choice} \u00b7 seq ${seq.seq_id}`
          + ` \u00b7 ${seq.num_tokens} tokens${seq.on_cpu ? " \u00b7 on CPU" : ""}`);
        line.appendChild(label);
        line.appendChild(KvTable.chips(seq, map));
        box.appendChild(line);
      }
    }

    function setFocus(rid) {
      if (state.focus === rid) return;
      state.focus = rid;
      map.setFocus(rid);
      for (const row of $("requests").querySelectorAll(".req")) {
        row.classList.toggle("focused", row.dataset.request === rid);
      }
      if (map.lastSnapshot) renderDetail();
    }

    $("requests").addEventListener("mousemove", (e) => {
      const hit = e.target.closest(".req") ? e.target : document.elementFromPoint(e.clientX, e.clientY);
      const row = hit && hit.closest(".req");
      setFocus(row ? row.dataset.request : null);
    });
    $("requests").addEventListener("mouseleave", () => setFocus(null));

    function onCellHover(info) {
      const tip = $("tip");
      if (!info) {
        tip.hidden = true;
        setFocus(null);
        return;
      }
      const { cell, pool } = info;
      tip.replaceChildren(el("div", "tip-title", KvTable.describe(pool, cell, map.lastSnapshot.block_size)));
      for (const o of cell.owners.slice(0, 8)) {
        tip.appendChild(el("div", "tip-owner", `${shortId(o.requestId)} \u00b7 choice ${o.choice} \u00b7 seq ${o.seqId}`
          + ` \u00b7 logical block ${o.logical}`));
      }
      if (cell.owners.length > 8) tip.appendChild(el("div", "tip-owner", `\u2026 and ${cell.owners.length - 8} more`));
      tip.hidden = false;
      const x = Math.min(info.clientX + 14, window.innerWidth - tip.offsetWidth - 8);
      const y = Math.min(info.clientY + 14, window.innerHeight - tip.offsetHeight - 8);
      tip.style.left = `${x}px`;
      tip.style.top = `${y}px`;
      setFocus(cell.requestId);
    }

    function pauseMap(on) {
      state.mapPaused = on;
      map.freeze(on);
      $("pause-map").textContent = on ? "Resume" : "Pause map";
      $("pause-map").classList.toggle("active", on);
      if (!on && state.heldSnapshot) {
        map.update(state.heldSnapshot);
        state.heldSnapshot = null;
        updatePanels();
      }
    }
    $("pause-map").addEventListener("click", () => pauseMap(!state.mapPaused));
    return { updatePanels, setFocus, onCellHover, pauseMap };
  }

  root.PG.poolPanel = poolPanel;
})(window);
