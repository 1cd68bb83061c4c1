/* kvtable.js: DOM helpers the pages share around kvmap.js: a sequence's block table as chips
   (logical -> physical block, x the count when shared, dashed when partly filled) and the
   one-line description of a hovered cell. Loaded after kvmap.js. A table entry of -1 is a block
   freed out of the model's sliding window: shown as a "freed" chip, owning no cell. */
(function (root) {
  "use strict";

  /** DOM helpers shared by the pages: a sequence's block table as chips, a cell's description. */
  const KvTable = {
    chips(seq, map) {
      const wrap = document.createElement("div");
      wrap.className = "kv-table";
      const bs = map.lastSnapshot ? map.lastSnapshot.block_size : 16;
      seq.block_table.forEach((block, logical) => {
        const chip = document.createElement("span");
        if (block < 0) {  // out of the sliding window: its block went back to the pool
          chip.className = "kv-chip freed";
          chip.title = `logical block ${logical}: freed, out of the attention window`;
          chip.textContent = `${logical}\u2192freed`;
          wrap.appendChild(chip);
          return;
        }
        const cell = map.cellOf(seq.on_cpu ? "cpu" : "device", block);
        const filled = Math.min(bs, Math.max(0, seq.num_tokens - logical * bs));
        const shared = cell.refCount > 1;
        chip.className = "kv-chip" + (shared ? " shared" : "") + (filled < bs ? " partial" : "");
        chip.title = `logical block ${logical} -> ${seq.on_cpu ? "CPU" : "device"} block ${block}: `
          + `${filled}/${bs} slots` + (shared ? `, shared by ${cell.refCount}` : "");
        chip.textContent = `${logical}\u2192${block}` + (shared ? ` \u00d7${cell.refCount}` : "");
        chip.style.setProperty("--chip", map.palette.color(seq.request_id, seq.choice));
        wrap.appendChild(chip);
      });
      return wrap;
    },
    describe(pool, cell, bs) {
      const where = pool === "cpu" ? "CPU block" : "block";
      if (cell.group) {
        const numFree = cell.lastBlock - cell.block + 1 - cell.numUsed - cell.numCached;
        return `${where}s ${cell.block}\u2013${cell.lastBlock}: ${cell.numUsed} in use, ${cell.numCached} cached, `
          + `${numFree} free`;
      }
      if (cell.state === "cached") {
        return `${where} ${cell.block}: cached, free: a finished prompt's tokens, reusable by a request with the `
          + "same prefix, evicted when a block is needed";
      }
      if (cell.state === "free") return `${where} ${cell.block}: free`;
      const shared = cell.refCount > 1 ? `, shared by ${cell.refCount} block tables` : "";
      return `${where} ${cell.block}: ${cell.fill}/${bs} slots hold tokens${shared}`;
    },
  };

  root.KvTable = KvTable;
})(typeof window !== "undefined" ? window : globalThis);
