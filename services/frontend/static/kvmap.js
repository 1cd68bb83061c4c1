/* kvmap.js: draws the KV block pool of one snapshot on canvases, one cell per block.

   A snapshot is the JSON of GET /v1/kv/events (its schema is KvSnapshot in /openapi.json): for
   each pool the blocks some table holds with their reference counts (every other block is free),
   the device blocks in the prefix cache, every sequence with its block table, and the block moves
   since the previous snapshot.

   A cell is coloured by the request (and choice) that owns it, filled left to right as far as its
   slots hold tokens (the pale rest is allocated but empty); a block held by several tables shows
   its reference count; a cached-but-free block is hatched; a free one is grey. Copy-on-write
   copies, evictions and swaps flash for a moment. A pool too large to draw one readable cell per
   block is drawn with one cell per group of consecutive blocks (the caption says how many), in the
   colour of the first block in use in it. Drawing costs the blocks in use, not the pool's size
   (the free grid is drawn once per layout). The same file is inlined into the pages that
   `pagedserve simulate --html` writes, so the live page and the replay draw alike.

   Exposed for pages and tests: KvPalette, KvMap (map.lastSnapshot; map.cells and map.cpuCells: the
   cells of blocks in use or cached, by block id; map.cellRect, map.layout; map.onUpdate callbacks),
   KvTable (block-table chips for a sequence, a cell's description). */
(function (root) {
  "use strict";

  const { FREE, CACHED, FLASH_MS, FLASH_COLORS, representatives, groupCell, freeGrid, flashTargets, drawCell } =
    root.KvDraw;
  const HUES = [217, 4, 142, 276, 32, 188, 330, 84, 250, 14, 168, 300];
  const CHOICE_LIGHTNESS = [46, 64, 32, 74, 39, 56, 26];  // a request's choices: one hue, these lightnesses

  /** Stable colours: each request gets the next hue the first time it is seen; its choices share
      that hue and differ in lightness. */
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
      return `hsl(${this.hue(requestId)} 70% ${CHOICE_LIGHTNESS[c % CHOICE_LIGHTNESS.length]}%)`;
    }
    pale(requestId, choice) {
      const c = Math.max(0, choice | 0);
      return `hsl(${this.hue(requestId)} 60% ${CHOICE_LIGHTNESS[c % CHOICE_LIGHTNESS.length] > 66 ? 94 : 88}%)`;
    }
  }

  /** The cells of one pool's blocks in use or cached: state, count, owners (every table holding
      the block), slots filled, colour. Blocks not listed are free. */
  function buildPool(pool, sequences, onCpu, blockSize, palette) {
    const byBlock = new Map();
    pool.used_block_ids.forEach((block, i) => {
      byBlock.set(block, { block, state: "used", refCount: pool.ref_counts[i], owners: [], fill: 0, cached: false,
                           requestId: null, choice: null, color: null, pale: null });
    });
    for (const block of pool.cached_block_ids || []) {
      const cell = byBlock.get(block);
      if (cell) cell.cached = true;
      else byBlock.set(block, { block, state: "cached", refCount: 0, owners: [], fill: 0, cached: true,
                                requestId: null, choice: null, color: CACHED, pale: null });
    }
    for (const seq of sequences) {
      if (seq.on_cpu !== onCpu) continue;
      seq.block_table.forEach((block, logical) => {
        const cell = byBlock.get(block);
        if (!cell) return;  // -1: freed out of the sliding window (no cell has that id)
        cell.owners.push({ seqId: seq.seq_id, requestId: seq.request_id, choice: seq.choice, logical });
        cell.fill = Math.max(cell.fill, Math.min(blockSize, Math.max(0, seq.num_tokens - logical * blockSize)));
      });
    }
    for (const cell of byBlock.values()) {
      if (!cell.owners.length) continue;
      const first = cell.owners.reduce((a, b) => (b.seqId < a.seqId ? b : a));  // the oldest holder
      cell.requestId = first.requestId;
      cell.choice = first.choice;
      cell.color = palette.color(first.requestId, first.choice);
      cell.pale = palette.pale(first.requestId, first.choice);
    }
    const cells = [...byBlock.values()].sort((a, b) => a.block - b.block);
    return { numBlocks: pool.num_blocks, cells, byBlock };
  }

  class KvMap {
    /** opts: device (canvas), cpu (canvas or null), palette, maxHeight / cpuMaxHeight (CSS px the
        maps aim for), minCell / maxCell (CSS px), columns (a fixed number of cells per row, else as
        many as fit), showSlots (draw slot dividers when cells are wide enough), onHover(info or
        null): info = {pool, cell, clientX, clientY}. */
    constructor(opts) {
      this.device = opts.device;
      this.cpu = opts.cpu || null;
      this.palette = opts.palette || new KvPalette();
      this.maxHeight = opts.maxHeight || 420;
      this.cpuMaxHeight = opts.cpuMaxHeight || 72;
      this.minCell = opts.minCell || 4;
      this.maxCell = opts.maxCell || 30;
      this.columns = opts.columns || 0;
      this.showSlots = !!opts.showSlots;
      this.onHover = opts.onHover || null;
      this.onUpdate = [];  // callbacks(map) after every snapshot is drawn
      this.lastSnapshot = null;
      const empty = buildPool({ num_blocks: 0, used_block_ids: [], ref_counts: [] }, [], false, 16, this.palette);
      this.pools = { device: empty, cpu: empty };
      this.focus = null;  // a request id: its cells stand out, the others fade
      this.flashes = [];  // {pool, block, kind, t0}
      this.recentEvents = [];  // the last 200 events seen, for pages and tests
      this.renderCount = 0;
      this.frozenAt = null;  // while frozen, highlights keep the brightness they had
      this._layouts = new Map();
      this._animating = false;
      for (const [pool, canvas] of [["device", this.device], ["cpu", this.cpu]]) {
        if (!canvas) continue;
        canvas.addEventListener("mousemove", (e) => this._hover(pool, canvas, e));
        canvas.addEventListener("mouseleave", () => this.onHover && this.onHover(null));
      }
    }

    get cells() { return this.pools.device.cells; }
    get cpuCells() { return this.pools.cpu.cells; }

    update(snapshot) {
      const bs = snapshot.block_size;
      this.lastSnapshot = snapshot;
      this.pools = {
        device: buildPool(snapshot.blocks, snapshot.sequences, false, bs, this.palette),
        cpu: buildPool(snapshot.cpu_blocks, snapshot.sequences, true, bs, this.palette),
      };
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

    /** Freeze (or thaw) the highlights' fading, for a page that pauses its map. */
    freeze(on) {
      if (on && this.frozenAt === null) this.frozenAt = performance.now();
      if (!on && this.frozenAt !== null) {
        const pausedMs = performance.now() - this.frozenAt;
        for (const f of this.flashes) f.t0 += pausedMs;
        this.frozenAt = null;
        this.render();
      }
    }

    setFocus(requestId) {
      if (this.focus === requestId) return;
      this.focus = requestId;
      if (this.lastSnapshot) this.render();
    }

    /** The cell of ``block`` in ``pool`` ("device" or "cpu"), a free one if no table holds it. */
    cellOf(pool, block) {
      return this.pools[pool].byBlock.get(block)
        || { block, state: "free", refCount: 0, owners: [], fill: 0, cached: false, requestId: null, color: FREE };
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

    /** The layout of a pool's map: cell size, columns, rows, blocks per cell (``group``). */
    layout(pool) {
      return this._layouts.get(pool) || null;
    }

    /** Where block ``block`` of ``pool`` is drawn: CSS pixels from its canvas' top left corner. */
    cellRect(pool, block) {
      const L = this._layouts.get(pool);
      if (!L) return null;
      const g = Math.floor(block / L.group);
      return { x: (g % L.cols) * (L.cell + L.gap), y: Math.floor(g / L.cols) * (L.cell + L.gap), size: L.cell };
    }

    render() {
      const now = this.frozenAt !== null ? this.frozenAt : performance.now();
      this.flashes = this.flashes.filter((f) => now - f.t0 < FLASH_MS);
      this._draw("device", this.device, this.maxHeight, now);
      if (this.cpu) this._draw("cpu", this.cpu, this.cpuMaxHeight, now);
      this.renderCount += 1;
      if (this.flashes.length && !this._animating && this.frozenAt === null) {
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
      // The largest cell (maxCell down to minCell) whose grid fits in maxHeight; at minCell, group
      // consecutive blocks into one cell until it fits.
      let cell = this.maxCell;
      let gap;
      let cols;
      let rows;
      let group = 1;
      for (;;) {
        gap = cell >= 10 ? 3 : 1;
        cols = this.columns || Math.max(1, Math.floor((width + gap) / (cell + gap)));
        if (this.columns && cell > this.minCell && cols * (cell + gap) - gap > width) {
          cell -= 1;
          continue;
        }
        rows = Math.max(1, Math.ceil(num / cols));
        if (rows * (cell + gap) - gap <= maxHeight) break;
        if (cell <= this.minCell) {
          const maxRows = Math.max(1, Math.floor((maxHeight + gap) / (cell + gap)));
          group = Math.ceil(num / (cols * maxRows));
          rows = Math.max(1, Math.ceil(Math.ceil(num / group) / cols));
          break;
        }
        cell -= 1;
      }
      const numCells = Math.ceil(num / group);
      const L = { key, cell, gap, cols, rows, group, numCells, dpr: root.devicePixelRatio || 1,
                  width: cols * (cell + gap) - gap, height: rows * (cell + gap) - gap };
      canvas.width = Math.round(L.width * L.dpr);
      canvas.height = Math.round(L.height * L.dpr);
      canvas.style.width = `${L.width}px`;
      canvas.style.height = `${L.height}px`;
      L.background = freeGrid(L);
      this._layouts.set(pool, L);
      return L;
    }

    _draw(pool, canvas, maxHeight, now) {
      const { numBlocks, cells } = this.pools[pool];
      const L = this._layout(pool, canvas, numBlocks, maxHeight);
      const ctx = canvas.getContext("2d");
      // A request in focus stands out where it has blocks: the other cells of that pool fade.
      const focus = cells.some((c) => c.owners.some((o) => o.requestId === this.focus)) ? this.focus : null;
      ctx.setTransform(1, 0, 0, 1, 0, 0);
      ctx.clearRect(0, 0, canvas.width, canvas.height);
      ctx.globalAlpha = focus !== null ? 0.45 : 1;
      ctx.drawImage(L.background, 0, 0);
      ctx.setTransform(L.dpr, 0, 0, L.dpr, 0, 0);
      const bs = this.lastSnapshot ? this.lastSnapshot.block_size : 16;
      for (const cell of representatives(cells, L.group)) {
        const { x, y } = this.cellRect(pool, cell.block);
        const dim = focus !== null && !cell.owners.some((o) => o.requestId === focus);
        ctx.globalAlpha = dim ? 0.22 : 1;
        drawCell(ctx, x, y, L.cell, cell, L.group > 1 ? 0 : bs, this.showSlots);
        if (!dim && focus !== null && cell.owners.length) {
          ctx.strokeStyle = "#111827";
          ctx.lineWidth = 1.5;
          ctx.strokeRect(x + 0.75, y + 0.75, L.cell - 1.5, L.cell - 1.5);
        }
      }
      ctx.globalAlpha = 1;
      for (const f of this.flashes) {
        if (f.pool !== pool || f.block >= numBlocks) continue;
        const { x, y } = this.cellRect(pool, f.block);
        const w = Math.max(2, Math.min(4, L.cell * 0.18));
        ctx.globalAlpha = Math.max(0, 1 - (now - f.t0) / FLASH_MS);
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
      const g = row * L.cols + col;
      if (col < 0 || col >= L.cols || row < 0 || g >= L.numCells) {
        this.onHover(null);
        return;
      }
      const first = g * L.group;
      const last = Math.min(this.pools[pool].numBlocks, first + L.group) - 1;
      const cell = L.group === 1 ? this.cellOf(pool, first) : groupCell(this.pools[pool].cells, first, last);
      this.onHover({ pool, cell, clientX: event.clientX, clientY: event.clientY });
    }
  }

  root.KvPalette = KvPalette;
  root.KvMap = KvMap;
  root.KV_COLORS = { free: FREE, cached: CACHED, flash: FLASH_COLORS };
})(typeof window !== "undefined" ? window : globalThis);
