/* app.js: the playground page. A chat that streams from /v1/chat/completions, and beside it the
   live map of the KV block pool drawn by kvmap.js from /v1/kv/events. Both are read with fetch and
   a stream reader (not EventSource) so that an API key can travel as "Authorization: Bearer".
   The map's stream is closed while the tab is hidden: the server stops building snapshots when
   nobody watches. window.kvMap and window.playground are there for tests and the curious. */
(function () {
  "use strict";

  const $ = (id) => document.getElementById(id);
  const KEY_STORE = "pagedserve.apiKey";
  const palette = new KvPalette();
  const state = {
    model: null,
    key: sessionStorage.getItem(KEY_STORE) || "",
    history: [],  // the conversation so far (choice 0 of each answer)
    busy: null,  // the AbortController of the answer streaming now
    poolAbort: null,
    focus: null,  // request id the map highlights (hovered message, sequence or cell)
    mapPaused: false,
    heldSnapshot: null,  // the newest snapshot that came while the map was paused
    requests: [],  // every answer of this page: {id, n, texts, finishReasons, done, error}
  };
  // The device map gets the height the rest of the pool's panel leaves in the window.
  const mapHeight = () => Math.max(180, Math.min(640, window.innerHeight - 640));
  const map = new KvMap({ device: $("device-map"), cpu: $("cpu-map"), palette, maxHeight: mapHeight(),
                          cpuMaxHeight: 48, onHover: onCellHover });
  window.kvMap = map;
  window.playground = { state, palette, send: (text) => send(text), pauseMap: (on) => pauseMap(on) };

  // ------------------------------------------------------------------ helpers

  function headers(json) {
    const h = {};
    if (json) h["Content-Type"] = "application/json";
    if (state.key) h.Authorization = `Bearer ${state.key}`;
    return h;
  }

  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

  function shortId(id) {
    if (!id || id.length <= 16) return id || "?";
    const dash = id.indexOf("-");
    return `${dash > 0 ? id.slice(0, dash) : ""}\u2026${id.slice(-6)}`;
  }

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  /** The data of each server-sent event of a fetch response, as it arrives. */
  async function* sseData(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, ""));
        if (data.length) yield data.join("\n");
      }
    }
  }

  function setConn(kind, text) {
    const c = $("conn");
    c.className = `pill status st-${kind}`;
    c.textContent = text;
  }

  function needKey(message) {
    $("key-box").classList.add("needed");
    $("api-key").placeholder = message || "this server needs an API key";
  }

  // ------------------------------------------------------------------ model and key

  async function loadModel() {
    try {
      const r = await fetch("/v1/models", { headers: headers(false) });
      if (r.status === 401) {
        needKey();
        $("model-name").textContent = "API key needed";
        return;
      }
      const card = (await r.json()).data[0];
      state.model = card.id;
      $("key-box").classList.remove("needed");
      $("model-name").textContent = `${card.id} \u00b7 ${card.max_model_len} tokens`;
    } catch (e) {
      $("model-name").textContent = "server unreachable";
    }
  }

  $("api-key").value = state.key;
  let keyTimer = null;
  let onKeyChange = null;  // resolves the wait of a map stream that was refused for its key
  const nextKey = () => new Promise((resolve) => { onKeyChange = resolve; });
  $("api-key").addEventListener("input", () => {
    clearTimeout(keyTimer);
    keyTimer = setTimeout(() => {
      state.key = $("api-key").value.trim();
      sessionStorage.setItem(KEY_STORE, state.key);
      loadModel();
      if (state.poolAbort) state.poolAbort.abort();  // reconnect with the new key
      if (onKeyChange) onKeyChange();
    }, 400);
  });

  // ------------------------------------------------------------------ the pool's stream

  async function watchPool() {
    for (;;) {
      while (document.hidden) {
        setConn("idle", "paused (tab hidden)");
        await new Promise((resolve) => document.addEventListener("visibilitychange", resolve, { once: true }));
      }
      const ctl = new AbortController();
      state.poolAbort = ctl;
      try {
        const r = await fetch("/v1/kv/events", { headers: headers(false), signal: ctl.signal, cache: "no-store" });
        if (r.status === 401) {
          setConn("error", "map: API key needed");
          needKey();
          await nextKey();
          continue;
        } else if (r.status === 404) {
          setConn("error", "map off (--no-playground)");
          return;
        } else if (r.ok) {
          setConn("live", "map live");
          $("map-hint").hidden = true;
          for await (const data of sseData(r)) {
            const snapshot = JSON.parse(data);
            if (state.mapPaused) {
              state.heldSnapshot = snapshot;
              continue;
            }
            map.update(snapshot);
            updatePanels();
          }
        }
      } catch (e) {
        /* aborted (tab hidden, new key) or the server went away: try again below */
      }
      if (!ctl.signal.aborted) setConn("wait", "map reconnecting\u2026");
      await sleep(ctl.signal.aborted ? 50 : 1500);
    }
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

  document.addEventListener("visibilitychange", () => {
    if (document.hidden && state.poolAbort) state.poolAbort.abort();
  });

  // ------------------------------------------------------------------ the counters and sequences

  function pct(x) {
    return `${(100 * x).toFixed(x < 0.1 ? 1 : 0)}%`;
  }

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
      const blocks = new Set(seqs.flatMap((q) => q.block_table.map((b) => `${q.on_cpu}:${b}`))).size;
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
    for (const row of $("requests").querySelectorAll(".req")) row.classList.toggle("focused", row.dataset.request === rid);
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

  // ------------------------------------------------------------------ chat

  function answerView(n) {
    $("empty-hint")?.remove();
    const msg = el("div", "msg assistant");
    const columns = n === 1 ? 1 : n === 2 || n === 4 ? 2 : 3;
    const choices = el("div", `choices n${columns}${n > 1 ? " multi" : ""}`);
    const parts = [];
    for (let i = 0; i < n; i++) {
      const choice = el("div", "choice");
      const head = el("div", "choice-head");
      const sw = el("span", "swatch");
      head.appendChild(sw);
      head.appendChild(el("span", "", n > 1 ? `choice ${i}` : "answer"));
      const bubble = el("div", "bubble");
      const text = el("span", "text");
      bubble.appendChild(text);
      bubble.appendChild(el("span", "cursor"));
      choice.appendChild(head);
      choice.appendChild(bubble);
      choices.appendChild(choice);
      parts.push({ choice, sw, text, head, bubble });
    }
    const meta = el("div", "meta", "waiting for the first token\u2026");
    msg.appendChild(choices);
    msg.appendChild(meta);
    $("messages").appendChild(msg);
    const record = { id: null, n, texts: Array(n).fill(""), finishReasons: Array(n).fill(null), done: false, error: null };
    state.requests.push(record);
    msg.addEventListener("mouseenter", () => record.id && setFocus(record.id));
    msg.addEventListener("mouseleave", () => setFocus(null));
    const scroll = () => { $("messages").scrollTop = $("messages").scrollHeight; };
    return {
      record,
      setRequest(id) {
        if (record.id) return;
        record.id = id;
        msg.dataset.request = id;
        parts.forEach((p, i) => {
          const c = palette.color(id, i);
          p.sw.style.setProperty("--c", c);
          p.choice.style.setProperty("--c", c);
        });
      },
      append(i, delta) {
        if (!parts[i]) return;
        if (!record.texts.some(Boolean)) meta.textContent = "streaming\u2026";
        record.texts[i] += delta;
        parts[i].text.textContent = record.texts[i];
        parts[i].bubble.scrollTop = parts[i].bubble.scrollHeight;
        scroll();
      },
      finish(i, reason) {
        record.finishReasons[i] = reason;
        parts[i]?.choice.classList.add("finished");
      },
      error(message) {
        record.error = message;
        msg.classList.add("failed");
        if (record.texts.every((t) => !t)) choices.remove();
        msg.appendChild(el("div", "error", message));
      },
      close(summary) {
        record.done = true;
        msg.classList.add("done");
        meta.textContent = summary;
        scroll();
      },
    };
  }

  function readOptions() {
    const num = (id, lo, hi, fallback) => {
      const v = Number($(id).value);
      return Number.isFinite(v) ? Math.min(hi, Math.max(lo, v)) : fallback;
    };
    const stops = $("stop-strings").value.split("\n").map((s) => s.trim()).filter(Boolean).slice(0, 4);
    const body = {
      temperature: num("temperature", 0, 2, 0.8),
      max_tokens: Math.round(num("max-tokens", 1, 1e6, 200)),
      n: Math.round(num("n", 1, 16, 1)),
      stream: true,
      stream_options: { include_usage: true },
    };
    if (stops.length) body.stop = stops;
    if ($("ignore-eos").checked) body.ignore_eos = true;
    return body;
  }

  async function send(textArg) {
    const text = (textArg !== undefined ? textArg : $("prompt").value).trim();
    if (!text || state.busy) return null;
    if (!state.model) await loadModel();
    $("prompt").value = "";
    $("messages").appendChild(el("div", "msg user", text));
    const options = readOptions();
    const system = $("system").value.trim();
    const messages = [...(system ? [{ role: "system", content: system }] : []), ...state.history,
      { role: "user", content: text }];
    const view = answerView(options.n);
    const ctl = new AbortController();
    state.busy = ctl;
    $("send").disabled = true;
    $("stop").disabled = false;
    const started = performance.now();
    let usage = null;
    let firstAt = null;
    try {
      const r = await fetch("/v1/chat/completions", {
        method: "POST", headers: headers(true), signal: ctl.signal,
        body: JSON.stringify({ model: state.model, messages, ...options }),
      });
      if (!r.ok) {
        const payload = await r.json().catch(() => null);
        if (r.status === 401) needKey();
        view.error(payload && payload.error ? payload.error.message : `HTTP ${r.status}`);
      } else {
        for await (const data of sseData(r)) {
          if (data === "[DONE]") break;
          const chunk = JSON.parse(data);
          if (chunk.error) {
            view.error(chunk.error.message);
            continue;
          }
          view.setRequest(chunk.id);
          for (const c of chunk.choices || []) {
            if (c.delta && c.delta.content) {
              firstAt = firstAt || performance.now();
              view.append(c.index, c.delta.content);
            }
            if (c.finish_reason) view.finish(c.index, c.finish_reason);
          }
          if (chunk.usage) usage = chunk.usage;
        }
        if (!view.record.error) state.history.push({ role: "user", content: text }, { role: "assistant", content: view.record.texts[0] });
      }
    } catch (e) {
      if (!ctl.signal.aborted) view.error(String(e));
    } finally {
      const seconds = (performance.now() - started) / 1000;
      const parts = view.record.id ? [shortId(view.record.id)] : [];
      if (usage) {
        parts.push(`${usage.prompt_tokens} prompt + ${usage.completion_tokens} generated tokens`);
        const cached = usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens;
        if (cached) parts.push(`${cached} from the prefix cache`);
        if (usage.num_preemptions) parts.push(`preempted ${usage.num_preemptions}\u00d7`);
        if (firstAt) parts.push(`${(usage.completion_tokens / Math.max(1e-3, seconds)).toFixed(1)} tokens/s`);
      }
      parts.push(`${seconds.toFixed(1)} s`);
      if (ctl.signal.aborted) parts.push("stopped");
      else if (view.record.finishReasons[0]) parts.push(`finish: ${[...new Set(view.record.finishReasons)].join(", ")}`);
      view.close(parts.join(" \u00b7 "));
      state.busy = null;
      $("send").disabled = false;
      $("stop").disabled = true;
    }
    return view.record;
  }

  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", () => state.busy && state.busy.abort());
  $("new-chat").addEventListener("click", () => {
    if (state.busy) state.busy.abort();
    state.history = [];
    $("messages").replaceChildren();
  });
  window.addEventListener("resize", () => {
    map.maxHeight = mapHeight();
    if (map.lastSnapshot) map.render();
  });

  loadModel();
  watchPool();
})();
