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
    delete $("chat-error").dataset.load;
    $("chat-input").value = "";
    // The turn joins the history only once it has a reply: a failed turn is not sent again with the next message.
    const turn = { role: "user", content: text };
    const asked = bubble("user", text);
    const out = bubble("assistant", "");
    const system = $("chat-system").value.trim();
    const body = {
      model, stream: true, stream_options: { include_usage: true },
      messages: [...(system ? [{ role: "system", content: system }] : []), ...history, turn],
    };
    // An empty number field is left out (the server's default), not sent as Number("") = 0.
    for (const [key, id] of [["temperature", "chat-temperature"], ["top_p", "chat-top-p"],
      ["max_tokens", "chat-max-tokens"]]) {
      const v = S.num(id);
      if (v !== undefined) body[key] = v;
    }
    if ($("chat-ignore-eos").checked) body.ignore_eos = true;
    controller = new AbortController();
    busy(true);
    const t0 = performance.now();
    let first = null, lastT = null, chunks = 0, usage = null, reply = "", failed = false;
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
      // Stop aborts the fetch: the browser closes the connection and the server aborts the request. What was
      // received before Stop stays in the conversation; a failed turn (or a stop before any token) does not.
      if (e.name === "AbortError") out.classList.add("stopped");
      else {
        failed = true;
        if (!(e instanceof S.AuthError)) $("chat-error").textContent = e.message;
      }
    } finally {
      stats();
      if (failed || !reply) {
        asked.classList.add("failed");
        out.classList.add("failed");
        asked.title = out.title = "not sent again: this turn is left out of the conversation";
      } else history.push(turn, { role: "assistant", content: reply });
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
        S.loaded("chat-error");
      } catch (e) {
        S.loadError("chat-error", e);
      }
    },
  };

  // ---------------------------------------------------------------- tensors
  const BYTES = "BYTES";
  const WIDE = new Set(["INT64", "UINT64"]); // integers past 2^53: JS numbers would round them
  const defaultShape = (shape) => shape.map((d) => (d < 0 ? 1 : d));

  // The data field of one input, as JSON text. JSON.parse checks it; INT64/UINT64 values are then taken from the
  // text as typed (never through JS numbers, which round above 2^53).
  function dataJSON(text, datatype) {
    const flat = [JSON.parse(text)].flat(Infinity);
    if (!WIDE.has(datatype)) return JSON.stringify(flat);
    const tokens = text.replace(/[\[\]\s]/g, "").split(",").filter((t) => t !== "");
    if (tokens.length !== flat.length || !tokens.every((t) => /^-?\d+$/.test(t)))
      throw new Error(`${datatype} data must be integers`);
    return "[" + tokens.join(",") + "]";
  }

  // A response body parsed with its large integers exact: BigInt where the browser gives the reviver the number's
  // source text (Chrome 114+, Firefox 135+); `lossy` is set when it cannot and a value is past 2^53.
  function parseExact(text) {
    let lossy = false;
    const doc = JSON.parse(text, (k, v, ctx) => {
      if (typeof v !== "number" || Number.isSafeInteger(v) || !Number.isInteger(v)) return v;
      if (ctx && typeof ctx.source === "string" && /^-?\d+$/.test(ctx.source)) return BigInt(ctx.source);
      lossy = true;
      return v;
    });
    return { doc, lossy };
  }
  const exact = (v) => (Array.isArray(v) ? "[" + v.map(exact).join(",") + "]"
    : typeof v === "bigint" ? v.toString() : JSON.stringify(v));
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

  // No tensor model loaded: no form, a disabled Infer and a line saying why.
  function noModel() {
    $("tensor-form").replaceChildren();
    $("tensor-output").textContent = "";
    $("tensor-meta").textContent = "No tensor model is loaded (load one on the Models page).";
    const go = document.createElement("button");
    go.type = "submit";
    go.id = "tensor-infer";
    go.textContent = "Infer";
    go.disabled = true;
    $("tensor-form").append(go);
  }

  $("tensor-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const name = $("tensor-model").value;
    if (!name) return;
    $("tensor-error").textContent = "";
    $("tensor-output").textContent = "";
    try {
      // The body is written as text so that each input's data goes out exactly as dataJSON made it.
      const inputs = [...$("tensor-form").querySelectorAll(".tensor-input")].map((box) => {
        const head = JSON.stringify({ name: box.dataset.name, datatype: box.dataset.datatype,
          shape: JSON.parse(box.querySelector(".shape").value) });
        return head.slice(0, -1) + ',"data":' + dataJSON(box.querySelector(".data").value, box.dataset.datatype) + "}";
      });
      const r = await S.fetch(`/v2/models/${encodeURIComponent(name)}/infer`, {
        method: "POST", headers: { "Content-Type": "application/json" }, body: `{"inputs":[${inputs.join(",")}]}` });
      const text = await r.text();
      let parsed = null;
      try { parsed = parseExact(text); } catch (_) { /* not JSON: reported below */ }
      if (!r.ok || !parsed) throw new Error(S.errorText(parsed && parsed.doc, r.status));
      const outs = parsed.doc.outputs || [];
      $("tensor-output").textContent = outs.map((o) =>
        `${o.name} ${o.datatype} [${o.shape.join(", ")}]\n${exact(o.data)}`).join("\n\n")
        + (parsed.lossy ? "\n\n(this browser rounds integers above 2^53 in the response: use a newer one for exact "
          + "INT64/UINT64 values)" : "");
    } catch (e) {
      if (!(e instanceof S.AuthError)) $("tensor-error").textContent = e.message;
    }
  });

  async function loadMeta() {
    const name = $("tensor-model").value;
    $("tensor-form").replaceChildren();
    $("tensor-output").textContent = "";
    $("tensor-error").textContent = "";
    if (!name) { noModel(); return; }
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
        S.loaded("tensor-error");
        if (!names.length) noModel();
        else if ($("tensor-model").value !== before || !$("tensor-form").querySelector(".tensor-input")) await loadMeta();
      } catch (e) {
        S.loadError("tensor-error", e);
      }
    },
  };

  // ---------------------------------------------------------------- speech
  // /v1/models lists each speech model's voices and languages: the Voice and Language selects offer them.
  let speechModels = [];
  function speechOptions() {
    const m = speechModels.find((x) => x.id === $("speech-model").value) || {};
    const voices = m.voices || [];
    S.option($("speech-voice"), voices, true); // the first voice unless the one chosen is still offered
    $("speech-voice").disabled = !voices.length;
    const lang = $("speech-language");
    const old = lang.value;
    lang.replaceChildren(new Option("(model default)", ""), ...(m.languages || []).map((l) => new Option(l, l)));
    if ((m.languages || []).includes(old)) lang.value = old;
  }
  $("speech-model").addEventListener("change", speechOptions);

  $("speech-go").addEventListener("click", async () => {
    $("speech-error").textContent = "";
    delete $("speech-error").dataset.load;
    // voice, language and instructions are sent only when set: a model may have no preset voices, and
    // VoiceDesign models need instructions where others refuse them.
    const body = { model: $("speech-model").value, input: $("speech-input").value, response_format: "wav" };
    if ($("speech-voice").value) body.voice = $("speech-voice").value;
    if ($("speech-language").value) body.language = $("speech-language").value;
    const instructions = $("speech-instructions").value.trim();
    if (instructions) body.instructions = instructions;
    try {
      const r = await S.fetch("/v1/audio/speech", {
        method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
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
      try {
        speechModels = (await S.models()).filter((m) => m.payload === "speech");
        S.loaded("speech-error");
      } catch (e) {
        S.loadError("speech-error", e);
        return;
      }
      S.option($("speech-model"), speechModels.map((m) => m.id), true);
      speechOptions();
    },
  };
})();
