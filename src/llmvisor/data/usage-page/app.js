// The llmvisor usage page: reads the service's own usage API with the tenant key kept in session storage.
// Everything is written with textContent (never as HTML), so ids and names from the ledger cannot inject markup.
"use strict";

const KEY_NAME = "llmvisor-key";
const TOP_REQUESTS = 20;
const CSV_LIMIT = 10000;

function $(id) { return document.getElementById(id); }

function seconds(ns) { return (ns / 1e9).toFixed(6) + " s"; }

function gibSeconds(value) { return value === null || value === undefined ? "not metered" : value.toFixed(6) + " GiB·s"; }

function barCell(row, value, largest) {
  const bar = document.createElement("span");
  bar.className = "bar";
  bar.style.width = (12 * value / largest).toFixed(2) + "rem";
  cell(row, "").appendChild(bar);
}

async function api(path) {
  const key = sessionStorage.getItem(KEY_NAME);
  const response = await fetch(path, { headers: { Authorization: "Bearer " + key }, cache: "no-store" });
  if (!response.ok) {
    let detail = response.statusText;
    try { detail = (await response.json()).detail || detail; } catch (_e) { /* not JSON */ }
    const error = new Error(response.status === 401 ? "This key was refused (" + detail + ")." : path + ": " + response.status + " " + detail);
    error.status = response.status;
    throw error;
  }
  return response.json();
}

function cell(row, text, className) {
  const td = document.createElement("td");
  td.textContent = text;
  if (className) td.className = className;
  row.appendChild(td);
  return td;
}

function fill(tableId, items, columns) {
  const body = $(tableId).querySelector("tbody");
  body.replaceChildren();
  for (const item of items) {
    const row = document.createElement("tr");
    for (const column of columns) {
      const value = column(item, row);
      if (value !== undefined) cell(row, value);
    }
    body.appendChild(row);
  }
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = false;
}

function costText(item) {
  // The API's cost per currency (ISO 4217 code to an exact decimal string), shown as written, never as a float.
  if (item.cost === undefined || item.cost === null) return null;
  return Object.keys(item.cost).sort().map((currency) => item.cost[currency] + " " + currency).join(", ");
}

function csvField(value) {
  const text = value === null || value === undefined ? "" : String(value);
  return /[",\n\r]/.test(text) ? '"' + text.replace(/"/g, '""') + '"' : text;
}

async function downloadCsv() {
  try {
    const data = await api("/v1/usage/requests?limit=" + CSV_LIMIT);
    const header = ["run_id", "request_id", "tenant", "attributed_ns", "attributed_s", "num_steps", "num_new_tokens", "first_step_at", "last_step_at"];
    const lines = [header.join(",")];
    for (const r of data.requests) lines.push(header.map((name) => csvField(r[name])).join(","));
    const blob = new Blob([lines.join("\r\n") + "\r\n"], { type: "text/csv" });
    const link = document.createElement("a");
    link.href = URL.createObjectURL(blob);
    link.download = "llmvisor-usage.csv";
    document.body.appendChild(link);
    link.click();
    link.remove();
  } catch (error) {
    showError(error.message);
  }
}

async function load() {
  $("error").hidden = true;
  let tenants, classes, requests, adjustments, hourly, byAdapter;
  try {
    [tenants, classes, requests, adjustments, hourly, byAdapter] = await Promise.all([
      api("/v1/usage/tenants"), api("/v1/usage/classes?bucket=hour"),
      api("/v1/usage/requests?limit=" + TOP_REQUESTS), api("/v1/adjustments"), api("/v1/usage/tenants?bucket=hour"),
      api("/v1/usage/tenants?group_by=adapter"),
    ]);
  } catch (error) {
    if (error.status === 401) { sessionStorage.removeItem(KEY_NAME); $("login").hidden = false; $("logout").hidden = true; }
    $("usage").hidden = true;
    showError(error.message);
    return;
  }
  const mine = tenants.tenants[0] || { tenant: classes.tenant || "", attributed_ns: 0, adjustments_ns: 0, adjusted_ns: 0 };
  $("tenant").textContent = tenants.tenants.map((t) => t.tenant).join(", ") || classes.tenant || "(no usage yet)";
  const total = (name) => tenants.tenants.reduce((sum, t) => sum + (t[name] || 0), 0);
  for (const name of ["attributed", "adjustments", "adjusted"]) {
    const ns = total(name + "_ns");
    $("total-" + name + "-s").textContent = seconds(ns);
    $("total-" + name + "-ns").textContent = ns + " ns";
  }
  const metered = tenants.tenants.filter((t) => t.kv_block_ns !== null && t.kv_block_ns !== undefined);
  $("total-kv-gib-s").textContent = gibSeconds(metered.length ? metered.reduce((sum, t) => sum + t.kv_gib_s, 0) : null);
  $("total-kv-block-ns").textContent = metered.length ? metered.reduce((sum, t) => sum + BigInt(t.kv_block_ns), 0n) + " block-ns" : "";
  const memory = hourly.tenants.flatMap((t) => t.buckets || []).filter((b) => b.kv_block_ns !== null && b.kv_block_ns !== undefined);
  const largestMemory = Math.max(1e-12, ...memory.map((b) => b.kv_gib_s));
  fill("memory", memory, [
    (b) => b.start.replace("T", " ").slice(0, 16),
    (b) => gibSeconds(b.kv_gib_s),
    (b, row) => { barCell(row, b.kv_gib_s, largestMemory); return undefined; },
    (b) => String(b.kv_block_ns),
  ]);
  $("memory-none").hidden = memory.length > 0;
  $("memory").hidden = memory.length === 0;
  // per LoRA adapter, shown where some usage ran one ('' is the base model)
  const adapters = byAdapter.tenants.flatMap((t) => t.adapters || []);
  const anyAdapter = adapters.some((a) => a.lora_adapter !== "");
  const largestAdapter = Math.max(1, ...adapters.map((a) => a.attributed_ns));
  fill("adapters", anyAdapter ? adapters : [], [
    (a) => a.lora_adapter || "(base model)",
    (a) => seconds(a.attributed_ns),
    (a, row) => { barCell(row, a.attributed_ns, largestAdapter); return undefined; },
    (a) => String(a.num_new_tokens),
    (a) => a.attributed_ns + " ns",
  ]);
  $("adapters-title").hidden = !anyAdapter;
  $("adapters").hidden = !anyAdapter;

  const cost = costText(mine);
  $("cost-row").hidden = cost === null;
  if (cost !== null) $("total-cost").textContent = cost;

  const largest = Math.max(1, ...classes.buckets.map((b) => b.attributed_ns));
  fill("classes", classes.buckets, [
    (b) => b.engine_class || "(no fingerprint)",
    (b) => b.start.replace("T", " ").slice(0, 16),
    (b) => seconds(b.attributed_ns),
    (b, row) => { barCell(row, b.attributed_ns, largest); return undefined; },
    (b) => String(b.num_new_tokens),
  ]);
  const versions = $("versions");
  versions.replaceChildren();
  for (const v of classes.model_versions) {
    const item = document.createElement("li");
    item.textContent = (v.engine_class || "(no fingerprint)") + ": " + (v.model_version === null ? "the service's default model" : "version " + v.model_version);
    versions.appendChild(item);
  }
  fill("requests", requests.requests, [
    (r) => r.request_id, (r) => r.run_id, (r) => seconds(r.attributed_ns), (r) => String(r.num_steps),
    (r) => String(r.num_new_tokens), (r) => r.last_step_at.replace("T", " ").slice(0, 19),
  ]);
  fill("adjustments", adjustments.adjustments, [
    (a) => a.engine_class, (a) => a.period_start.slice(0, 19) + " – " + a.period_end.slice(0, 19),
    (a) => a.from_versions, (a) => "version " + a.to_version, (a) => (a.delta_ns / 1e9).toFixed(6),
  ]);
  $("login").hidden = true;
  $("logout").hidden = false;
  $("usage").hidden = false;
}

document.addEventListener("DOMContentLoaded", () => {
  $("login").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY_NAME, $("key").value.trim());
    $("key").value = "";
    load();
  });
  $("logout").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_NAME);
    location.reload();
  });
  $("csv").addEventListener("click", downloadCsv);
  if (sessionStorage.getItem(KEY_NAME)) load();
});
