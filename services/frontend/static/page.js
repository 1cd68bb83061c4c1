/* page.js: what the playground page's scripts share (pool.js, chat.js, app.js): small DOM
   helpers, request headers, and a reader of server-sent events from a fetch response. */
(function (root) {
  "use strict";

  const $ = (id) => document.getElementById(id);

  /** Request headers: the API key as Bearer when there is one, JSON when ``json``. */
  function headers(key, json) {
    const h = {};
    if (json) h["Content-Type"] = "application/json";
    if (key) h.Authorization = `Bearer ${key}`;
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

  function pct(x) {
    return `${(100 * x).toFixed(x < 0.1 ? 1 : 0)}%`;
  }

  root.PG = { $, el, headers, sleep, shortId, sseData, pct };
})(window);
