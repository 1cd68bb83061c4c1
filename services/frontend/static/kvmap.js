/* kvmap.js: draws the KV block pool of one snapshot on canvases, one cell per block.

   A snapshot is the JSON of GET /v1/kv/events (its schema is KvSnapshot in /openapi.json):
   per device block a reference count and a prefix-cache flag, per CPU (swap) block a count, every
   sequence with its block table, and the block moves since the previous snapshot.

   A cell is coloured by the request (and choice) that owns it, filled left to right as far as its
   slots hold tokens (the pale rest is allocated but empty); a block held by several tables shows
   its reference count; a cached-but-free block is hatched; a free one is grey. Copy-on-write
   copies, evictions and swaps flash for a moment. The same file is inlined into the pages that
   `pagedserve simulate --html` writes, so the live page and the replay draw alike.

   Exposed for pages and tests: KvPalette, KvMap (map.lastSnapshot, map.cells, map.cpuCells,
   map.renderCount, map.onUpdate callbacks), KvTable (block-table chips for a sequence). */
(function (root) {
  "use strict";

  const HUES = [217, 4, 142, 276, 32, 188, 330, 84, 250, 14, 168, 300];
  const CHOICE_LIGHTNESS = [46, 30, 62, 38, 70, 24, 54];
  const FREE = "#e6e9ee";
  const CACHED = "#c9d6de";
  const CACHED_HATCH = "#9fb3c0";
  const FLASH_MS = 1800;
  const FLASH_COLORS = { copy: "#f5a700", evict: "#e5484d", swap_out: "#3e63dd", swap_in: "#18a058" };

  /** Stable colours: each request gets the next hue the first time it is seen; choices vary lightness. */
  class KvPalette {
    constructor() {
      this.hues = new Map();
    }
    hue(requestId) {
      if (!this.hues.has(requestId)) this.hues.set(requestId, HUES[this.hues.size % HUES.length]);
      return this.hues.get(requestId);
    }
    color(requestId, choice) {
      const c = Math.max(0, choice | 0);
      return `hsl(${(this.hue(requestId) + 14 * c) % 360} 72% ${CHOICE_LIGHTNESS[c % CHOICE_LIGHTNESS.length]}%)`;
    }
    pale(requestId, choice) {
      const c = Math.max(0, choice | 0);
      return `hsl(${(this.hue(requestId) + 14 * c) % 360} 60% 88%)`;
    }
  }

  /** Cells of one pool: state, count, owners (every table holding the block), slots filled. */
  function buildCells(refCounts, cachedFlags, sequences, onCpu, blockSize, palette) {
    const cells = refCounts.map((count, block) => ({
      block,
      state: count > 0 ? "used" : cachedFlags && cachedFlags[block] ? "cached" : "free",
      refCount: count,
      owners: [],
      fill: 0,
      requestId: null,
      choice: null,
      color: count > 0 ? null : cachedFlags && cachedFlags[block] ? CACHED : FREE,
    }));
    for (const seq of sequences) {
      if (seq.on_cpu !== onCpu) continue;
      seq.block_table.forEach((block, logical) => {
        const cell = cells[block];
        if (!cell) return;
        cell.owners.push({ seqId: seq.seq_id, requestId: seq.request_id, choice: seq.choice, logical });
        const filled = Math.min(blockSize, Math.max(0, seq.num_tokens - logical * blockSize));
        cell.fill = Math.max(cell.fill, filled);
      });
    }
    for (const cell of cells) {
      if (!cell.owners.length) continue;
      const first = cell.owners.reduce((a, b) => (b.seqId < a.seqId ? b : a));  // the oldest holder
      cell.requestId = first.requestId;
      cell.choice = first.choice;
      cell.color = palette.color(first.requestId, first.choice);
      cell.pale = palette.pale(first.requestId, first.choice);
    }
    return cells;
  }

  class KvMap {
    /** opts: device (canvas), cpu (canvas or null), palette, maxHeight (CSS px the device map aims
        for), minCell / maxCell (CSS px), columns (a fixed number of cells per row, else as many as
        fit), showSlots (draw slot dividers when cells are wide enough),
        onHover(info or null): info = {pool, cell, clientX, clientY}. */
    constructor(opts) {
      this.device = opts.device;
      this.cpu = opts.cpu || null;
      this.palette = opts.palette || new KvPalette();
      this.maxHeight = opts.maxHeight || 420;
      this.cpuMaxHeight = opts.cpuMaxHeight || 72;
      this.minCell = opts.minCell || 3;
      this.maxCell = opts.maxCell || 30;
      this.showSlots = !!opts.showSlots;
      this.columns = opts.columns || 0;
      this.onHover = opts.onHover || null;
      this.onUpdate = [];  // callbacks(map) after every snapshot is drawn
      this.lastSnapshot = null;
      this.cells = [];
      this.cpuCells = [];
      this.focus = null;  // a request id: its cells stand out, the others fade
      this.flashes = [];  // {pool, block, kind, t0}
      this.recentEvents = [];  // the last 200 events seen, for pages and tests
      this.renderCount = 0;
      this._layouts = new Map();
      this._animating = false;
      for (const [pool, canvas] of [["device", this.device], ["cpu", this.cpu]]) {
        if (!canvas) continue;
        canvas.addEventListener("mousemove", (e) => this._hover(pool, canvas, e));
        canvas.addEventListener("mouseleave", () => this.onHover && this.onHover(null));
      }
    }

    update(snapshot) {
      const bs = snapshot.block_size;
      this.lastSnapshot = snapshot;
      this.cells = buildCells(snapshot.blocks.ref_counts, snapshot.blocks.cached, snapshot.sequences, false, bs,
                              this.palette);
      this.cpuCells = buildCells(snapshot.cpu_blocks.ref_counts, null, snapshot.sequences, true, bs, this.palette);
      const now = performance.now();
      for (const ev of snapshot.events) {
        this.recentEvents.push({ ...ev, snapshotId: snapshot.snapshot_id });
        for (const [pool, block] of flashTargets(ev)) this.flashes.push({ pool, block, kind: ev.kind, t0: now });
      }
      if (this.recentEvents.length > 200) this.recentEvents.splice(0, this.recentEvents.length - 200);
      if (this.flashes.length > 2000) this.flashes.splice(0, this.flashes.length - 2000);
      this.render();
      for (const fn of this.onUpdate) fn(this);
    }

    setFocus(requestId) {
      if (this.focus === requestId) return;
      this.focus = requestId;
      this.render();
    }

    /** The sequences of the last snapshot grouped by request, in order of first appearance. */
    requests() {
      const byRequest = new Map();
      for (const seq of (this.lastSnapshot && this.lastSnapshot.sequences) || []) {
        if (!byRequest.has(seq.request_id)) byRequest.set(seq.request_id, []);
        byRequest.get(seq.request_id).push(seq);
      }
      return byRequest;
    }

    render() {
      const now = performance.now();
      this.flashes = this.flashes.filter((f) => now - f.t0 < FLASH_MS);
      this._draw("device", this.device, this.cells, this.maxHeight, now);
      if (this.cpu) this._draw("cpu", this.cpu, this.cpuCells, this.cpuMaxHeight, now);
      this.renderCount += 1;
      if (this.flashes.length && !this._animating) {
        this._animating = true;
        requestAnimationFrame(() => {
          this._animating = false;
          this.render();
        });
      }
    }

    _layout(pool, canvas, num, maxHeight) {
      const width = Math.max(60, Math.floor(canvas.parentElement ? canvas.parentElement.clientWidth : 300));
      const key = `${width}:${num}:${maxHeight}`;
      const known = this._layouts.get(pool);
      if (known && known.key === key) return known;
      // the largest cell (from maxCell down to minCell) whose grid fits in maxHeight
      let cell = this.maxCell;
      let gap;
      let cols;
      let rows;
      for (;;) {
        gap = cell >= 10 ? 3 : 1;
        cols = this.columns || Math.max(1, Math.floor((width + gap) / (cell + gap)));
        if (this.columns && cell > this.minCell && cols * (cell + gap) - gap > width) {
          cell -= 1;
          continue;
        }
        rows = Math.max(1, Math.ceil(num / cols));
        if (cell <= this.minCell || rows * (cell + gap) - gap <= maxHeight) break;
        cell -= 1;
      }
      const layout = { key, cell, gap, cols, rows, width: cols * (cell + gap) - gap, height: rows * (cell + gap) - gap };
      const dpr = root.devicePixelRatio || 1;
      canvas.width = Math.round(layout.width * dpr);
      canvas.height = Math.round(layout.height * dpr);
      canvas.style.width = `${layout.width}px`;
      canvas.style.height = `${layout.height}px`;
      layout.dpr = dpr;
      this._layouts.set(pool, layout);
      return layout;
    }

    _draw(pool, canvas, cells, maxHeight, now) {
      const L = this._layout(pool, canvas, cells.length, maxHeight);
      const ctx = canvas.getContext("2d");
      ctx.setTransform(L.dpr, 0, 0, L.dpr, 0, 0);
      ctx.clearRect(0, 0, L.width, L.height);
      const bs = this.lastSnapshot ? this.lastSnapshot.block_size : 16;
      for (const cell of cells) {
        const x = (cell.block % L.cols) * (L.cell + L.gap);
        const y = Math.floor(cell.block / L.cols) * (L.cell + L.gap);
        const dim = this.focus !== null && !cell.owners.some((o) => o.requestId === this.focus);
        ctx.globalAlpha = dim ? 0.22 : 1;
        drawCell(ctx, x, y, L.cell, cell, bs, this.showSlots);
        if (!dim && this.focus !== null && cell.owners.length) {
          ctx.strokeStyle = "#111827";
          ctx.lineWidth = 1.5;
          ctx.strokeRect(x + 0.75, y + 0.75, L.cell - 1.5, L.cell - 1.5);
        }
      }
      ctx.globalAlpha = 1;
      for (const f of this.flashes) {
        if (f.pool !== pool || f.block >= cells.length) continue;
        const x = (f.block % L.cols) * (L.cell + L.gap);
        const y = Math.floor(f.block / L.cols) * (L.cell + L.gap);
        const t = (now - f.t0) / FLASH_MS;
        const w = Math.max(2, Math.min(4, L.cell * 0.18));
        ctx.globalAlpha = Math.max(0, 1 - t);
        ctx.strokeStyle = FLASH_COLORS[f.kind] || "#000";
        ctx.lineWidth = w;
        const grow = Math.min(L.gap, 2) + w / 2 - 1;
        ctx.strokeRect(x - grow, y - grow, L.cell + 2 * grow, L.cell + 2 * grow);
      }
      ctx.globalAlpha = 1;
    }

    _hover(pool, canvas, event) {
      const L = this._layouts.get(pool);
      if (!L || !this.onHover) return;
      const rect = canvas.getBoundingClientRect();
      const col = Math.floor((event.clientX - rect.left) / (L.cell + L.gap));
      const row = Math.floor((event.clientY - rect.top) / (L.cell + L.gap));
      const cells = pool === "device" ? this.cells : this.cpuCells;
      const cell = col >= 0 && col < L.cols ? cells[row * L.cols + col] : undefined;
      this.onHover(cell ? { pool, cell, clientX: event.clientX, clientY: event.clientY } : null);
    }
  }

  function flashTargets(ev) {
    switch (ev.kind) {
      case "copy": return [["device", ev.dst]];
      case "evict": return [["device", ev.src]];
      case "swap_out": return [["device", ev.src], ["cpu", ev.dst]];
      case "swap_in": return [["cpu", ev.src], ["device", ev.dst]];
      default: return [];
    }
  }

  function drawCell(ctx, x, y, s, cell, bs, showSlots) {
    if (cell.state === "free" && !cell.owners.length) {
      ctx.fillStyle = FREE;
      ctx.fillRect(x, y, s, s);
      return;
    }
    if (cell.state === "cached" && !cell.owners.length) {
      ctx.fillStyle = CACHED;
      ctx.fillRect(x, y, s, s);
      if (s >= 7) hatch(ctx, x, y, s);
      return;
    }
    ctx.fillStyle = cell.pale || FREE;
    ctx.fillRect(x, y, s, s);
    ctx.fillStyle = cell.color;
    const filled = cell.fill >= bs ? s : Math.round((s * cell.fill) / bs);
    ctx.fillRect(x, y, filled, s);
    if (showSlots && s / bs >= 3) {
      ctx.fillStyle = "rgba(255,255,255,0.55)";
      for (let i = 1; i < bs; i++) ctx.fillRect(x + Math.round((s * i) / bs), y, 1, s);
    }
    if (cell.refCount > 1) drawCount(ctx, x, y, s, cell.refCount);
  }

  function hatch(ctx, x, y, s) {
    ctx.save();
    ctx.beginPath();
    ctx.rect(x, y, s, s);
    ctx.clip();
    ctx.strokeStyle = CACHED_HATCH;
    ctx.lineWidth = 1;
    const step = Math.max(3, Math.floor(s / 3));
    ctx.beginPath();
    for (let d = -s; d < s; d += step) {
      ctx.moveTo(x + d, y + s);
      ctx.lineTo(x + d + s, y);
    }
    ctx.stroke();
    ctx.restore();
  }

  function drawCount(ctx, x, y, s, count) {
    if (s >= 12) {
      const size = Math.max(8, Math.floor(s * 0.62));
      ctx.font = `700 ${size}px system-ui, -apple-system, "Segoe UI", sans-serif`;
      ctx.textAlign = "center";
      ctx.textBaseline = "middle";
      ctx.lineWidth = Math.max(2, size / 5);
      ctx.strokeStyle = "rgba(17,24,39,0.75)";
      const label = count > 99 ? "99+" : String(count);
      ctx.strokeText(label, x + s / 2, y + s / 2 + 0.5);
      ctx.fillStyle = "#fff";
      ctx.fillText(label, x + s / 2, y + s / 2 + 0.5);
    } else {
      const d = Math.max(2, Math.floor(s / 2.5));
      ctx.fillStyle = "#fff";
      ctx.fillRect(x + s - d, y, d, d);
    }
  }

  /** DOM helpers shared by the pages: a sequence's block table as chips, a block's description. */
  const KvTable = {
    chips(seq, map) {
      const wrap = document.createElement("div");
      wrap.className = "kv-table";
      const bs = map.lastSnapshot ? map.lastSnapshot.block_size : 16;
      const cells = seq.on_cpu ? map.cpuCells : map.cells;
      seq.block_table.forEach((block, logical) => {
        const chip = document.createElement("span");
        const cell = cells[block];
        const filled = Math.min(bs, Math.max(0, seq.num_tokens - logical * bs));
        chip.className = "kv-chip" + (cell && cell.refCount > 1 ? " shared" : "") + (filled < bs ? " partial" : "");
        chip.title = `logical block ${logical} -> ${seq.on_cpu ? "CPU" : "device"} block ${block}: `
          + `${filled}/${bs} slots` + (cell && cell.refCount > 1 ? `, shared by ${cell.refCount}` : "");
        chip.textContent = `${logical}\u2192${block}` + (cell && cell.refCount > 1 ? ` \u00d7${cell.refCount}` : "");
        chip.style.setProperty("--chip", map.palette.color(seq.request_id, seq.choice));
        wrap.appendChild(chip);
      });
      return wrap;
    },
    describe(pool, cell, bs) {
      const where = pool === "cpu" ? "CPU block" : "block";
      if (!cell.owners.length) {
        return cell.state === "cached"
          ? `${where} ${cell.block}: cached, free: a finished prompt's tokens, reusable by a request with the `
            + "same prefix, evicted when a block is needed"
          : `${where} ${cell.block}: free`;
      }
      const shared = cell.refCount > 1 ? `, shared by ${cell.refCount} block tables` : "";
      return `${where} ${cell.block}: ${cell.fill}/${bs} slots hold tokens${shared}`;
    },
  };

  root.KvPalette = KvPalette;
  root.KvMap = KvMap;
  root.KvTable = KvTable;
  root.KV_COLORS = { free: FREE, cached: CACHED, flash: FLASH_COLORS };
})(typeof window !== "undefined" ? window : globalThis);
