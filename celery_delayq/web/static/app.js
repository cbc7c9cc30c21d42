// celery-delayq dashboard: the little script the pages use; every page works without it.
// - live refresh: the element with data-live="<seconds>" is read again from the same URL and
//   swapped in place, unless the user is busy with it (a checkbox ticked, a field focused);
// - "select all" checkboxes (data-select-all) tick every ids (or ids.json) checkbox of their form;
// - a button with data-confirm asks first.
(function () {
  "use strict";
  const live = document.querySelector("[data-live]");
  const seconds = live ? Number(live.dataset.live) : 0;
  function busy() {
    return live.querySelector("input[type=checkbox]:checked") ||
      (document.activeElement && live.contains(document.activeElement) &&
       document.activeElement.matches("input, select, textarea"));
  }
  async function refresh() {
    if (document.hidden || busy()) return;
    try {
      const response = await fetch(location.href, { headers: { "X-Delayq-Live": "1" }, credentials: "same-origin" });
      if (!response.ok) return;
      const page = new DOMParser().parseFromString(await response.text(), "text/html");
      const fresh = page.querySelector("[data-live]");
      if (fresh && !busy()) {
        live.innerHTML = fresh.innerHTML;
        live.dataset.refreshed = String(Date.now());
      }
    } catch (e) { /* the server is away: try again next time */ }
  }
  if (live && seconds > 0) setInterval(refresh, seconds * 1000);
  document.addEventListener("change", function (event) {
    const box = event.target;
    if (box.matches && box.matches("input[data-select-all]")) {
      const form = box.form || document;
      form.querySelectorAll("input[name=ids], input[name=\"ids.json\"]").forEach(function (c) { c.checked = box.checked; });
    }
  });
  document.addEventListener("submit", function (event) {
    const button = event.submitter;
    const text = (button && button.dataset.confirm) || event.target.dataset.confirm;
    if (text && !window.confirm(text)) event.preventDefault();
  });
})();
