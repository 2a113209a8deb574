// The elastic_ops views' one script: reload the page's content every few seconds, and send the
// controls (forms with data-path) to the plugin's HTTP API as JSON after the user confirms.
// Served by the plugin itself (no CDN); the page's CSP allows no other script.
"use strict";
(function () {
  const body = document.body;
  const api = body.dataset.api;
  const every = Number(body.dataset.refresh || 5) * 1000;
  const error = document.getElementById("eo-error");
  let busy = false;

  function show(message) {
    error.textContent = message || "";
    error.hidden = !message;
  }

  async function refresh() {
    const main = document.getElementById("eo-main");
    // not while the user types into a control or a request is on its way
    if (busy || (document.activeElement && main.contains(document.activeElement) &&
                 document.activeElement.tagName !== "BUTTON" && document.activeElement.tagName !== "A")) {
      return;
    }
    try {
      const r = await fetch(location.href, {credentials: "same-origin", headers: {Accept: "text/html"}});
      if (!r.ok || r.redirected) { return; }
      const doc = new DOMParser().parseFromString(await r.text(), "text/html");
      const fresh = doc.getElementById("eo-main");
      if (!fresh) { return; }
      const open = new Set([...main.querySelectorAll("details[open]")].map((d) => d.className));
      main.replaceChildren(...[...fresh.childNodes].map((n) => document.importNode(n, true)));
      main.querySelectorAll("details").forEach((d) => { if (open.has(d.className)) { d.open = true; } });
      body.dataset.updated = String(Date.now());
    } catch (e) { /* offline a moment: the next round tries again */ }
  }

  function payload(form) {
    const v = (name) => form.elements[name].value;
    switch (form.dataset.action) {
      case "priority": return {priority: Number(v("priority"))};
      case "bounds": return {min_workers: Number(v("min_workers")), max_workers: Number(v("max_workers"))};
      case "preemptible": return {preemptible: v("preemptible") === "true"};
      case "host": return {state: v("state")};
      default: return {};
    }
  }

  function why(status, data) {
    const detail = data && data.detail;
    if (Array.isArray(detail)) {
      return detail.map((d) => (d.loc || []).slice(1).join(".") + ": " + d.msg).join("; ");
    }
    return (detail ? String(detail) : "") || ("the pool API answered " + status);
  }

  document.addEventListener("submit", async (ev) => {
    const form = ev.target;
    if (!form.matches("form.control")) { return; }
    ev.preventDefault();
    const data = payload(form);
    if (!window.confirm(form.dataset.confirm + "\n" + JSON.stringify(data))) { return; }
    busy = true;
    try {
      const r = await fetch(api + form.dataset.path, {
        method: "POST", credentials: "same-origin",
        headers: {"Content-Type": "application/json", Accept: "application/json"},
        body: JSON.stringify(data),
      });
      let answer = null;
      try { answer = await r.json(); } catch (e) { answer = null; }
      show(r.ok ? "" : "Refused: " + why(r.status, answer));
    } catch (e) {
      show("The pool API could not be reached: " + e);
    } finally {
      busy = false;
      (document.activeElement || body).blur();
      refresh();
    }
  });

  setInterval(refresh, every);
})();
