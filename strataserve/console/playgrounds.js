// Playgrounds over the public routes: chat (OpenAI streaming), tensors (KServe v2, form from the model's
// metadata) and speech (/v1/audio/speech, shown only when /v1/models lists a speech model).
"use strict";
(() => {
  const S = window.Strata;
  const $ = S.$;

  // ---------------------------------------------------------------- chat
  const history = [];
  let controller = null;

  function bubble(role, text) {
    const d = document.createElement("div");
    d.className = "msg " + role;
    d.textContent = text;
    $("chat-log").append(d);
    $("chat-log").scrollTop = $("chat-log").scrollHeight;
    return d;
  }

  function busy(on) {
    $("chat-send").disabled = on;
    $("chat-stop").disabled = !on;
  }

  // Yields the parsed JSON of each SSE `data:` event until [DONE].
  async function* sseEvents(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") return;
          yield JSON.parse(data);
        }
      }
    }
  }

  async function send() {
    const text = $("chat-input").value.trim();
    const model = $("chat-model").value;
    if (!text || !model || controller) return;
    $("chat-error").textContent = "";
    $("chat-input").value = "";
    history.push({ role: "user", content: text });
    bubble("user", text);
    const out = bubble("assistant", "");
    const system = $("chat-system").value.trim();
    const body = {
      model, stream: true, stream_options: { include_usage: true },
      messages: system ? [{ role: "system", content: system }, ...history] : [...history],
      temperature: Number($("chat-temperature").value), top_p: Number($("chat-top-p").value),
      max_tokens: Number($("chat-max-tokens").value),
    };
    if ($("chat-ignore-eos").checked) body.ignore_eos = true;
    controller = new AbortController();
    busy(true);
    const t0 = performance.now();
    let first = null, lastT = null, chunks = 0, usage = null, reply = "";
    const stats = () => {
      const n = usage ? usage.completion_tokens : chunks;
      const ttft = first == null ? "–" : (first - t0).toFixed(0) + " ms";
      const tps = first != null && lastT > first && n > 1 ? ((n - 1) / ((lastT - first) / 1000)).toFixed(1) : "–";
      $("chat-stats").textContent = `TTFT ${ttft} · ${n} tokens · ${tps} tokens/s`;
    };
    try {
      const r = await S.fetch("/v1/chat/completions", {
        method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (!r.ok) throw new Error(S.errorText(await r.json().catch(() => null), r.status));
      for await (const ev of sseEvents(r)) {
        if (ev.error) throw new Error(S.errorText(ev, 500));
        if (ev.usage) usage = ev.usage;
        const delta = ev.choices && ev.choices[0] && ev.choices[0].delta;
        if (delta && delta.content) {
          const now = performance.now();
          if (first == null) first = now;
          lastT = now;
          chunks += 1;
          reply += delta.content;
          out.textContent = reply;
          $("chat-log").scrollTop = $("chat-log").scrollHeight;
          stats();
        }
      }
    } catch (e) {
      // Stop aborts the fetch: the browser closes the connection and the server aborts the request.
      if (e.name === "AbortError") out.classList.add("stopped");
      else if (!(e instanceof S.AuthError)) $("chat-error").textContent = e.message;
    } finally {
      stats();
      history.push({ role: "assistant", content: reply });
      controller = null;
      busy(false);
    }
  }

  $("chat-send").addEventListener("click", send);
  $("chat-input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); send(); }
  });
  $("chat-stop").addEventListener("click", () => controller && controller.abort());
  $("chat-clear").addEventListener("click", () => {
    history.length = 0;
    $("chat-log").replaceChildren();
    $("chat-stats").textContent = "";
  });

  S.pages.chat = {
    async show() {
      try {
        const models = await S.models();
        S.option($("chat-model"), models.filter((m) => m.payload === "text").map((m) => m.id), true);
      } catch (e) {
        if (!(e instanceof S.AuthError)) $("chat-error").textContent = e.message;
      }
    },
  };

  // ---------------------------------------------------------------- tensors
  const BYTES = "BYTES";
  const defaultShape = (shape) => shape.map((d) => (d < 0 ? 1 : d));
  const sample = (dt, n) => JSON.stringify(dt === BYTES ? Array(n).fill("hello") : dt === "BOOL" ? Array(n).fill(false)
    : Array.from({ length: n }, (_, i) => i + 1));

  function tensorForm(meta) {
    const form = $("tensor-form");
    form.replaceChildren();
    $("tensor-meta").textContent = `platform ${meta.platform || "?"} · versions ${(meta.versions || []).join(", ") || "–"}`
      + ` · outputs ${(meta.outputs || []).map((o) => `${o.name} ${o.datatype} [${o.shape}]`).join(", ")}`;
    for (const inp of meta.inputs || []) {
      const shape = defaultShape(inp.shape);
      const n = shape.reduce((a, b) => a * b, 1);
      const box = document.createElement("div");
      box.className = "tensor-input";
      box.dataset.name = inp.name;
      box.dataset.datatype = inp.datatype;
      box.innerHTML = `<h2><b></b> <span class="hint"></span></h2>
        <label>Shape <input class="shape"></label>
        <label>Data (JSON, flat or nested) <textarea class="data" rows="3"></textarea></label>`;
      box.querySelector("b").textContent = inp.name;
      box.querySelector(".hint").textContent = `${inp.datatype}, shape [${inp.shape.join(", ")}]`;
      box.querySelector(".shape").value = JSON.stringify(shape);
      box.querySelector(".data").value = sample(inp.datatype, n);
      form.append(box);
    }
    const go = document.createElement("button");
    go.type = "submit";
    go.id = "tensor-infer";
    go.textContent = "Infer";
    form.append(go);
  }

  $("tensor-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const name = $("tensor-model").value;
    $("tensor-error").textContent = "";
    $("tensor-output").textContent = "";
    try {
      const inputs = [...$("tensor-form").querySelectorAll(".tensor-input")].map((box) => ({
        name: box.dataset.name, datatype: box.dataset.datatype,
        shape: JSON.parse(box.querySelector(".shape").value),
        data: [JSON.parse(box.querySelector(".data").value)].flat(Infinity),
      }));
      const r = await S.post(`/v2/models/${encodeURIComponent(name)}/infer`, { inputs });
      $("tensor-output").textContent = (r.outputs || []).map((o) =>
        `${o.name} ${o.datatype} [${o.shape.join(", ")}]\n${JSON.stringify(o.data)}`).join("\n\n");
    } catch (e) {
      if (!(e instanceof S.AuthError)) $("tensor-error").textContent = e.message;
    }
  });

  async function loadMeta() {
    const name = $("tensor-model").value;
    $("tensor-form").replaceChildren();
    $("tensor-output").textContent = "";
    $("tensor-error").textContent = "";
    if (!name) return;
    try {
      tensorForm(await S.json(`/v2/models/${encodeURIComponent(name)}`));
    } catch (e) {
      if (!(e instanceof S.AuthError)) $("tensor-error").textContent = e.message;
    }
  }
  $("tensor-model").addEventListener("change", loadMeta);

  S.pages.tensors = {
    async show() {
      try {
        const models = await S.models();
        const names = models.filter((m) => m.payload === "tensors" && m.ready).map((m) => m.id);
        const before = $("tensor-model").value;
        S.option($("tensor-model"), names, true);
        if (!names.length) $("tensor-error").textContent = "No tensor model is loaded (see Models).";
        else if ($("tensor-model").value !== before || !$("tensor-form").children.length) await loadMeta();
      } catch (e) {
        if (!(e instanceof S.AuthError)) $("tensor-error").textContent = e.message;
      }
    },
  };

  // ---------------------------------------------------------------- speech
  $("speech-go").addEventListener("click", async () => {
    $("speech-error").textContent = "";
    try {
      const r = await S.fetch("/v1/audio/speech", {
        method: "POST", headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ model: $("speech-model").value, input: $("speech-input").value,
          voice: $("speech-voice").value, response_format: "wav" }),
      });
      if (!r.ok) throw new Error(S.errorText(await r.json().catch(() => null), r.status));
      const audio = $("speech-audio");
      if (audio.src) URL.revokeObjectURL(audio.src);
      audio.src = URL.createObjectURL(await r.blob());
      await audio.play();
    } catch (e) {
      if (!(e instanceof S.AuthError)) $("speech-error").textContent = e.message;
    }
  });

  S.pages.speech = {
    async show() {
      const models = await S.models().catch(() => []);
      S.option($("speech-model"), models.filter((m) => m.payload === "speech").map((m) => m.id), true);
    },
  };
})();
