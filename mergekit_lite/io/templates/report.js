"use strict";
(function () {
  // Every table with class "sortable" sorts by a column when its header is clicked (data-sort, else the text).
  function sortValue(cell) {
    var raw = cell.getAttribute("data-sort");
    if (raw !== null && raw !== "" && !isNaN(Number(raw))) { return Number(raw); }
    return cell.textContent;
  }
  function compare(a, b) {
    if (typeof a === "number" && typeof b === "number") { return a - b; }
    return String(a).localeCompare(String(b), undefined, {numeric: true});
  }
  Array.prototype.forEach.call(document.querySelectorAll("table.sortable"), function (table) {
    var headers = table.querySelectorAll("thead th");
    Array.prototype.forEach.call(headers, function (th, column) {
      th.addEventListener("click", function () {
        var ascending = !th.classList.contains("asc");
        Array.prototype.forEach.call(headers, function (other) { other.classList.remove("asc", "desc"); });
        th.classList.add(ascending ? "asc" : "desc");
        var body = table.tBodies[0];
        var rows = Array.prototype.slice.call(body.rows);
        rows.sort(function (x, y) {
          var order = compare(sortValue(x.cells[column]), sortValue(y.cells[column]));
          return ascending ? order : -order;
        });
        rows.forEach(function (row) { body.appendChild(row); });
      });
    });
  });

  // The sample browser: rows from the JSON block, filtered and paged here, every cell filled with textContent.
  var configBlock = document.getElementById("sample-config");
  var dataBlock = document.getElementById("sample-data");
  if (!configBlock || !dataBlock) { return; }
  var config = JSON.parse(configBlock.textContent);
  var rows = JSON.parse(dataBlock.textContent);
  var PAGE = 50;
  var page = 0;
  var chosen = {};
  var query = "";
  var expanded = {};

  function element(tag, text, className) {
    var node = document.createElement(tag);
    if (text !== undefined && text !== null) { node.textContent = String(text); }
    if (className) { node.className = className; }
    return node;
  }
  function shown(value) { return value === null || value === undefined ? "(none)" : String(value); }
  function docName(row) {
    if (row.doc_id !== null && row.doc_id !== undefined) { return row.doc_id; }
    return row.doc_hash || row.key || "";
  }
  function tail(value, width) {
    if (value === null || value === undefined) { return "?"; }
    var flat = String(value).replace(/\s+/g, " ").trim();
    return flat.length <= width ? flat : "\u2026" + flat.slice(flat.length - width + 1);
  }

  var controls = document.getElementById("sample-controls");
  config.filters.forEach(function (name) {
    var values = [];
    rows.forEach(function (row) {
      var value = shown(row[name]);
      if (values.indexOf(value) < 0) { values.push(value); }
    });
    if (values.length < 1) { return; }
    values.sort(function (a, b) { return compare(a, b); });
    var label = element("label", name.replace(/_/g, " ") + " ");
    var select = element("select");
    select.setAttribute("data-filter", name);
    var all = element("option", "all (" + values.length + ")");
    all.value = "";
    select.appendChild(all);
    values.forEach(function (value) {
      var count = rows.filter(function (row) { return shown(row[name]) === value; }).length;
      var option = element("option", value + " (" + count + ")");
      option.value = value;
      select.appendChild(option);
    });
    select.addEventListener("change", function () { chosen[name] = select.value; page = 0; render(); });
    label.appendChild(select);
    controls.insertBefore(label, controls.firstChild ? null : null);
    controls.appendChild(label);
  });
  var search = document.getElementById("sample-search");
  controls.appendChild(search);
  search.addEventListener("input", function () { query = search.value.toLowerCase(); page = 0; render(); });

  function matches(row) {
    for (var name in chosen) {
      if (chosen[name] && shown(row[name]) !== chosen[name]) { return false; }
    }
    if (!query) { return true; }
    var haystack = [row.task, row.prompt, row.gold].concat(row.answers || []).join("\n").toLowerCase();
    return haystack.indexOf(query) >= 0;
  }

  var head = document.getElementById("sample-head");
  var columns = ["task", "doc"];
  if (rows.some(function (row) { return row.split !== undefined; })) { columns.push("split"); }
  columns.push(config.kind);
  if (rows.some(function (row) { return row.forgetting_kind; })) { columns.push("forgetting kind"); }
  config.models.forEach(function (model) { columns.push(model); });
  columns.push("gold", "prompt (end)");
  columns.forEach(function (name) { head.appendChild(element("th", name)); });

  function detail(row) {
    var cell = element("td");
    cell.colSpan = columns.length;
    var box = element("div", null, "detail");
    function block(title, value) {
      box.appendChild(element("h4", title));
      box.appendChild(element("pre", value === null || value === undefined ? "(not in the log)" : value));
    }
    block("prompt", row.prompt);
    if (row.choices) { block("choices", row.choices.map(function (c, i) { return i + ": " + c; }).join("\n")); }
    block("gold", row.gold);
    var lines = config.models.map(function (model, index) {
      var line = model + ": " + (row.scores && row.scores[index] ? "right" : "wrong") + " \u2014 " +
        shown(row.answers ? row.answers[index] : null);
      if (row.loglikelihoods && row.loglikelihoods[index]) {
        line += "  [log-likelihoods " + row.loglikelihoods[index].join(", ") + "]";
      }
      return line;
    });
    block("answers", lines.join("\n"));
    var extra = [];
    ["key", "doc_hash", "seed", "answer_rule", "outcome_post", "outcome_pick", "first_forgotten", "predicted"]
      .forEach(function (name) { if (row[name] !== undefined && row[name] !== null) { extra.push(name + ": " + row[name]); } });
    if (extra.length) { block("record", extra.join("\n")); }
    cell.appendChild(box);
    var tr = element("tr", null, "detail");
    tr.appendChild(cell);
    return tr;
  }

  function render() {
    var body = document.getElementById("sample-body");
    while (body.firstChild) { body.removeChild(body.firstChild); }
    var kept = [];
    for (var index = 0; index < rows.length; index++) { if (matches(rows[index])) { kept.push(index); } }
    var pages = Math.max(1, Math.ceil(kept.length / PAGE));
    page = Math.min(page, pages - 1);
    kept.slice(page * PAGE, (page + 1) * PAGE).forEach(function (index) {
      var row = rows[index];
      var tr = element("tr", null, "sample");
      tr.setAttribute("data-row", String(index));
      tr.appendChild(element("td", row.task));
      tr.appendChild(element("td", docName(row)));
      if (columns.indexOf("split") >= 0) { tr.appendChild(element("td", shown(row.split))); }
      var kind = element("td");
      kind.appendChild(element("span", shown(row[config.kind]), "tag " + shown(row[config.kind])));
      tr.appendChild(kind);
      if (columns.indexOf("forgetting kind") >= 0) {
        var spurious = element("td");
        if (row.forgetting_kind) { spurious.appendChild(element("span", row.forgetting_kind, "tag " + row.forgetting_kind)); }
        tr.appendChild(spurious);
      }
      config.models.forEach(function (model, position) {
        var right = row.scores && row.scores[position];
        var answer = element("td");
        answer.appendChild(element("span", right ? "\u2713 " : "\u2717 ", right ? "right" : "wrong"));
        answer.appendChild(document.createTextNode(tail(row.answers ? row.answers[position] : null, 40)));
        tr.appendChild(answer);
      });
      tr.appendChild(element("td", tail(row.gold, 40)));
      tr.appendChild(element("td", tail(row.prompt, 120), "prompt"));
      tr.addEventListener("click", function () { expanded[index] = !expanded[index]; render(); });
      body.appendChild(tr);
      if (expanded[index]) { body.appendChild(detail(row)); }
    });
    var first = kept.length ? page * PAGE + 1 : 0;
    document.getElementById("sample-count").textContent =
      first + "\u2013" + Math.min((page + 1) * PAGE, kept.length) + " of " + kept.length + " samples (" +
      rows.length + " in all), page " + (page + 1) + " of " + pages;
    document.getElementById("sample-prev").disabled = page === 0;
    document.getElementById("sample-next").disabled = page >= pages - 1;
  }
  document.getElementById("sample-prev").addEventListener("click", function () { page -= 1; render(); });
  document.getElementById("sample-next").addEventListener("click", function () { page += 1; render(); });
  render();
})();
