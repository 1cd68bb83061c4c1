/* app.js: the playground page. A chat (chat.js) that streams from /v1/chat/completions, and beside
   it the live map of the KV block pool (kvmap.js, with its panel in pool.js) fed by /v1/kv/events.
   Both are read with fetch and a stream reader (not EventSource) so that an API key can travel as
   "Authorization: Bearer". The map's stream is closed while the tab is hidden: the server stops
   building snapshots when nobody watches. window.kvMap and window.playground are there for tests
   and the curious. */
(function () {
  "use strict";

  const { $, headers, sleep, sseData } = window.PG;
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
                          cpuMaxHeight: 48, onHover: (info) => panel.onCellHover(info) });
  const panel = window.PG.poolPanel(map, palette, state);
  const send = window.PG.chat(state, palette, { setFocus: panel.setFocus, loadModel, needKey });
  window.kvMap = map;
  window.playground = { state, palette, send, pauseMap: panel.pauseMap };

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
      const r = await fetch("/v1/models", { headers: headers(state.key, false) });
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
        const r = await fetch("/v1/kv/events", { headers: headers(state.key, false), signal: ctl.signal,
                                                 cache: "no-store" });
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
            panel.updatePanels();
          }
        }
      } catch (e) {
        /* aborted (tab hidden, new key) or the server went away: try again below */
      }
      if (!ctl.signal.aborted) setConn("wait", "map reconnecting\u2026");
      await sleep(ctl.signal.aborted ? 50 : 1500);
    }
  }

  document.addEventListener("visibilitychange", () => {
    if (document.hidden && state.poolAbort) state.poolAbort.abort();
  });
  window.addEventListener("resize", () => {
    map.maxHeight = mapHeight();
    if (map.lastSnapshot) map.render();
  });

  loadModel();
  watchPool();
})();
