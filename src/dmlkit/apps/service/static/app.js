"use strict";
// The dmlkit search page: query by image (drop or pick), show the top-k gallery; verify two images.

const $ = (id) => document.getElementById(id);

async function api(path, options) {
  const response = await fetch(path, options);
  let body = null;
  try { body = await response.json(); } catch (e) { body = null; }
  if (!response.ok) {
    let detail = body && body.detail ? body.detail : response.statusText;
    if (Array.isArray(detail)) detail = detail.map((d) => d.msg).join("; ");
    throw new Error(`${response.status}: ${detail}`);
  }
  return body;
}

function showPreview(img, file) {
  img.src = URL.createObjectURL(file);
  img.hidden = false;
}

function card(result) {
  const div = document.createElement("div");
  div.className = "card";
  const img = document.createElement("img");
  img.src = result.thumbnail;
  img.alt = result.id;
  img.loading = "lazy";
  const label = result.label === null || result.label === undefined ? "" : ` · label ${result.label}`;
  const text = document.createElement("div");
  const rank = document.createElement("b");
  rank.textContent = `#${result.rank}`;
  // labels are free text (class names): as text, never as markup
  text.append(rank, ` score ${result.score.toFixed(3)}${label}`);
  const id = document.createElement("div");
  id.className = "id";
  id.textContent = result.id;
  div.append(img, text, id);
  return div;
}

async function search(file) {
  const message = $("query-message");
  const grid = $("results");
  showPreview($("query-preview"), file);
  message.className = "";
  message.textContent = "searching…";
  grid.replaceChildren();
  const form = new FormData();
  form.append("file", file);
  if ($("k").value) form.append("k", $("k").value);  // none: the service's default (10, or its max_k)
  try {
    const body = await api("/api/query/image", { method: "POST", body: form });
    grid.replaceChildren(...body.results.map(card));
    message.textContent = `${body.results.length} nearest items in ${body.took_ms.toFixed(1)} ms`;
  } catch (err) {
    $("query-preview").hidden = true;
    message.className = "error";
    message.textContent = err.message;
  }
}

async function verify() {
  const out = $("verify-result");
  const a = $("verify-file-1").files[0];
  const b = $("verify-file-2").files[0];
  out.className = "";
  if (!a || !b) { out.textContent = "pick two images"; return; }
  const form = new FormData();
  form.append("image1", a);
  form.append("image2", b);
  out.textContent = "verifying…";
  try {
    const r = await api("/api/verify", { method: "POST", body: form });
    out.className = r.same ? "same" : "different";
    out.textContent = `${r.same ? "same" : "different"}: score ${r.score.toFixed(4)} ` +
      `${r.same ? "≥" : "<"} threshold ${r.threshold.toFixed(4)} (${r.distance})`;
  } catch (err) {
    out.className = "error";
    out.textContent = err.message;
  }
}

function setup() {
  const drop = $("drop");
  const input = $("query-file");
  input.addEventListener("change", () => { if (input.files[0]) search(input.files[0]); });
  drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (e) => {
    e.preventDefault();
    drop.classList.remove("over");
    if (e.dataTransfer.files[0]) search(e.dataTransfer.files[0]);
  });
  for (const n of [1, 2]) {
    $(`verify-file-${n}`).addEventListener("change", (e) => {
      if (e.target.files[0]) showPreview($(`verify-preview-${n}`), e.target.files[0]);
    });
  }
  $("verify-button").addEventListener("click", verify);
  api("/api/health").then((h) => {
    $("status").textContent = `${h.items} items · ${h.dim}-d ${h.kind} (${h.distance})` +
      (h.model ? ` · model: ${h.model}` : " · no model: image search disabled") +
      (h.verification ? " · verification on" : "");
  }).catch((err) => { $("status").textContent = err.message; });
  // the service's limit on k: the input's maximum, and its default where 8 is over it
  api("/api/info").then((info) => {
    const k = $("k");
    k.max = info.max_k;
    if (Number(k.value) > info.max_k) k.value = info.max_k;
  }).catch((err) => { $("status").textContent = err.message; });
}

setup();
