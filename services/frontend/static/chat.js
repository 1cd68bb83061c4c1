/* chat.js: the chat of the playground page. Streams each answer from /v1/chat/completions (all
   its choices side by side, each in its colour on the map), keeps the conversation, and records
   every answer in ``state.requests`` for the pool panel and for tests. */
(function (root) {
  "use strict";

  const { $, el, headers, shortId, sseData } = root.PG;

  /** Wire the chat to the page: ``state`` (model, key, history, busy, requests), the shared
      ``palette``, ``setFocus`` (hovering an answer highlights its blocks), ``loadModel`` and
      ``needKey``; returns ``send(text)``. */
  function chat(state, palette, { setFocus, loadModel, needKey }) {
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
      const record = { id: null, n, texts: Array(n).fill(""), finishReasons: Array(n).fill(null), done: false,
                       error: null };
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
          method: "POST", headers: headers(state.key, true), signal: ctl.signal,
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
          if (!view.record.error) {
            state.history.push({ role: "user", content: text }, { role: "assistant", content: view.record.texts[0] });
          }
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
        else if (view.record.finishReasons[0]) {
          parts.push(`finish: ${[...new Set(view.record.finishReasons)].join(", ")}`);
        }
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
    return send;
  }

  root.PG.chat = chat;
})(window);
