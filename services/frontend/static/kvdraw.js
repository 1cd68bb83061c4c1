/* kvdraw.js: how kvmap.js paints a pool on a canvas: the free grid (drawn once per layout), one
   cell (filled as far as its slots hold tokens, hatched when cached, its reference count when
   shared), the highlight rings of block moves, and the cells that stand for groups of blocks in
   a pool too large to draw one cell per block. Loaded before kvmap.js. */
(function (root) {
  "use strict";

  const FREE = "#e6e9ee";
  const CACHED = "#c9d6de";
  const CACHED_HATCH = "#9fb3c0";
  const FLASH_MS = 1800;
  const FLASH_COLORS = { copy: "#f5a700", evict: "#e5484d", swap_out: "#3e63dd", swap_in: "#18a058" };

  /** One cell per group of ``group`` blocks: the first block in use in it, else the first cached. */
  function representatives(cells, group) {
    if (group === 1) return cells;
    const best = new Map();
    for (const cell of cells) {
      const g = Math.floor(cell.block / group);
      const known = best.get(g);
      if (!known || (known.state !== "used" && cell.state === "used")) best.set(g, cell);
    }
    return [...best.values()];
  }

  /** A hovered group of blocks: what is in it, and its owners. */
  function groupCell(cells, first, last) {
    const inside = cells.filter((c) => c.block >= first && c.block <= last);
    const used = inside.filter((c) => c.state === "used");
    const rep = used[0] || inside[0];
    return { block: first, lastBlock: last, group: true, state: rep ? rep.state : "free",
             numUsed: used.length, numCached: inside.length - used.length, refCount: rep ? rep.refCount : 0,
             owners: used.flatMap((c) => c.owners.map((o) => ({ ...o, block: c.block }))),
             requestId: rep ? rep.requestId : null, fill: 0 };
  }

  function freeGrid(L) {
    const bg = document.createElement("canvas");
    bg.width = Math.round(L.width * L.dpr);
    bg.height = Math.round(L.height * L.dpr);
    const ctx = bg.getContext("2d");
    ctx.setTransform(L.dpr, 0, 0, L.dpr, 0, 0);
    ctx.fillStyle = FREE;
    for (let g = 0; g < L.numCells; g++) {
      ctx.fillRect((g % L.cols) * (L.cell + L.gap), Math.floor(g / L.cols) * (L.cell + L.gap), L.cell, L.cell);
    }
    return bg;
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

  /** One cell; ``bs`` 0 draws it full (a group of blocks). */
  function drawCell(ctx, x, y, s, cell, bs, showSlots) {
    if (cell.state === "cached") {
      ctx.fillStyle = CACHED;
      ctx.fillRect(x, y, s, s);
      if (s >= 7) hatch(ctx, x, y, s);
      return;
    }
    ctx.fillStyle = cell.pale;
    ctx.fillRect(x, y, s, s);
    ctx.fillStyle = cell.color;
    ctx.fillRect(x, y, !bs || cell.fill >= bs ? s : Math.round((s * cell.fill) / bs), s);
    if (showSlots && bs && s / bs >= 3) {
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

  root.KvDraw = {
    FREE, CACHED, FLASH_MS, FLASH_COLORS, representatives, groupCell, freeGrid, flashTargets, drawCell,
  };
})(typeof window !== "undefined" ? window : globalThis);
