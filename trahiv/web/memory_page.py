"""The memory calculator as a web page: what `trahiv memory` prints, with inputs a person can change.

    GET /memory        an HTML page (inline CSS and JavaScript, nothing loaded from elsewhere): a form and a table of
                       GPU and CPU memory by component, updated whenever an input changes; its query string (the same
                       parameters as the API's) fills the form, and the page keeps it in step, so a link reproduces it
    GET /api/memory    the estimate as JSON, exactly `trahiv.memory.estimate(...).to_dict()` (bytes); query:
                       model, batch_size, seq_len, precision, optimizer_bits, offload, gradient_checkpointing,
                       parameter_sharing, lora_rank. Bad input answers 422 with FastAPI's {"detail": [{"loc", "msg"}]}

`create_router()` returns both routes as an APIRouter, for any FastAPI app (a dashboard) to include; `create_app()` is
the app `trahiv memory --serve` runs. The models are the presets plus any the server was started with (a config the
operator named); a request never names a file.
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from trahiv.memory import (
    COMPONENT_LABELS,
    COMPONENTS,
    OPTIMIZER_BITS,
    PRECISIONS,
    PRESETS,
    MemoryEstimate,
    MemoryOptions,
    ModelShape,
    estimate,
    shape_from_preset,
)

__all__ = ["DEFAULT_MODEL", "MemoryQuery", "create_app", "create_router", "render_page"]

DEFAULT_MODEL = "gpt2-xl"
_MAX_BATCH, _MAX_SEQ_LEN, _MAX_RANK = 2**20, 2**24, 2**16


class MemoryQuery(BaseModel):
    """The calculator's inputs, as query parameters (unknown ones are refused: a typo must not pass unnoticed)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(DEFAULT_MODEL, min_length=1, max_length=200, description="a preset, or a model the server has")
    batch_size: int = Field(1, ge=1, le=_MAX_BATCH, description="sequences per forward pass")
    seq_len: int = Field(512, ge=1, le=_MAX_SEQ_LEN, description="tokens per sequence")
    precision: str = Field("fp32", description=f"{', '.join(PRECISIONS)} (fp16/bf16: mixed precision)")
    optimizer_bits: int = Field(32, description=f"Adam/LAMB state precision: {' or '.join(map(str, OPTIMIZER_BITS))}")
    offload: bool = Field(False, description="optimizer states and fp32 master weights in CPU memory")
    gradient_checkpointing: bool = Field(False, description="recompute activations in the backward pass")
    parameter_sharing: bool = Field(False, description="all layers share weights (ALBERT-style)")
    lora_rank: int | None = Field(None, ge=1, le=_MAX_RANK, description="train only LoRA adapters of this rank")

    @field_validator("precision")
    @classmethod
    def _known_precision(cls, value: str) -> str:
        if value not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}")
        return value

    @field_validator("optimizer_bits")
    @classmethod
    def _known_bits(cls, value: int) -> int:
        if value not in OPTIMIZER_BITS:
            raise ValueError(f"optimizer_bits must be {' or '.join(map(str, OPTIMIZER_BITS))}")
        return value

    def options(self) -> MemoryOptions:
        return MemoryOptions(
            batch_size=self.batch_size,
            seq_len=self.seq_len,
            precision=self.precision,
            optimizer_bits=self.optimizer_bits,
            offload_optimizer=self.offload,
            gradient_checkpointing=self.gradient_checkpointing,
            parameter_sharing=self.parameter_sharing,
            lora_rank=self.lora_rank,
        )


class _Calculator:
    """The models a router knows and the estimate for a query; bad input becomes a 422 like FastAPI's own."""

    def __init__(self, extra_models: Mapping[str, ModelShape]):
        self.models: dict[str, ModelShape] = {**PRESETS, **extra_models}

    def shape(self, name: str) -> ModelShape:
        """A known model; presets by forgiving names (case, dashes). ValueError naming close presets otherwise."""
        return self.models[name] if name in self.models else shape_from_preset(name)

    def estimate(self, query: MemoryQuery) -> MemoryEstimate:
        try:
            shape = self.shape(query.model)
        except ValueError as e:
            raise _unprocessable("model", query.model, str(e)) from None
        try:
            options = query.options()
        except ValueError as e:  # MemoryOptions' own checks (the query's bounds should have caught it)
            raise _unprocessable("options", None, str(e)) from None
        return estimate(shape, options)


def _unprocessable(field: str, value: Any, message: str) -> HTTPException:
    return HTTPException(422, detail=[{"type": "value_error", "loc": ["query", field], "msg": message, "input": value}])


def create_router(
    extra_models: Mapping[str, ModelShape] | None = None, defaults: MemoryQuery | None = None
) -> APIRouter:
    """GET /memory (the page) and GET /api/memory (JSON). extra_models: models besides the presets, by name;
    defaults: the form's values when the page is opened without a query string."""
    calculator = _Calculator(extra_models or {})
    start = defaults or MemoryQuery()
    calculator.shape(start.model)  # an unknown model fails here (ValueError), not at the first request
    router = APIRouter()

    @router.get("/api/memory", name="memory_api", summary="memory needed to train a model, by component (bytes)")
    def memory_api(query: Annotated[MemoryQuery, Query()]) -> dict[str, Any]:
        return calculator.estimate(query).to_dict()

    @router.get("/memory", name="memory_page", response_class=HTMLResponse, summary="the memory calculator page")
    def memory_page(request: Request) -> HTMLResponse:
        query = _page_query(start, request)
        result = calculator.estimate(query)
        api_path = request.url_for("memory_api").path
        return HTMLResponse(render_page(query, result, list(calculator.models), api_path))

    return router


def _page_query(defaults: MemoryQuery, request: Request) -> MemoryQuery:
    """The page's inputs: the defaults, overridden by the query string (validated like the API's: 422 if bad)."""
    try:
        return MemoryQuery.model_validate({**defaults.model_dump(), **request.query_params})
    except ValidationError as e:
        errors = [{"type": err["type"], "loc": ["query", *err["loc"]], "msg": err["msg"]} for err in e.errors()]
        raise HTTPException(422, detail=errors) from None


def create_app(extra_models: Mapping[str, ModelShape] | None = None, defaults: MemoryQuery | None = None) -> FastAPI:
    """The memory calculator on its own: the router's two routes, and / redirecting to the page."""
    app = FastAPI(title="trahiv memory calculator", summary="GPU and CPU memory needed to train a transformer")
    app.include_router(create_router(extra_models, defaults))

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("/memory")

    return app


# --- the page -----------------------------------------------------------------------------------------------------


def render_page(query: MemoryQuery, result: MemoryEstimate, models: list[str], api_path: str) -> str:
    """The HTML page: the form filled from `query`, the table rendered (by the page's script) from `result`."""
    replacements = {
        "__API__": html.escape(api_path),
        "__MODEL_OPTIONS__": _options(models, query.model),
        "__BATCH_SIZE__": str(query.batch_size),
        "__SEQ_LEN__": str(query.seq_len),
        "__PRECISION_OPTIONS__": _options(list(PRECISIONS), query.precision),
        "__BITS_OPTIONS__": _options([str(bits) for bits in OPTIMIZER_BITS], str(query.optimizer_bits)),
        "__OFFLOAD__": _checked(query.offload),
        "__CHECKPOINTING__": _checked(query.gradient_checkpointing),
        "__SHARING__": _checked(query.parameter_sharing),
        "__LORA_RANK__": "" if query.lora_rank is None else str(query.lora_rank),
        "__LABELS__": _script_json({name: COMPONENT_LABELS[name] for name in COMPONENTS}),
        "__INITIAL__": _script_json(result.to_dict()),
    }
    page = _PAGE
    for key, value in replacements.items():
        page = page.replace(key, value)
    return page


def _options(values: list[str], selected: str) -> str:
    return "".join(
        f'<option value="{html.escape(v)}"{" selected" if v == selected else ""}>{html.escape(v)}</option>'
        for v in values
    )


def _checked(value: bool) -> str:
    return " checked" if value else ""


def _script_json(value: Any) -> str:
    """JSON safe inside a <script> element (no "</script>", no "<!--")."""
    return json.dumps(value).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>trahiv memory calculator</title>
<style>
  :root { color-scheme: light; --accent: #2457a6; --muted: #5b6270; --line: #d9dde5; }
  body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0; background: #f5f6f8;
         color: #1d2330; }
  main { max-width: 980px; margin: 0 auto; padding: 24px; }
  h1 { font-size: 22px; margin: 0 0 4px; }
  p.lead { color: var(--muted); margin: 0 0 20px; }
  .layout { display: grid; grid-template-columns: 300px 1fr; gap: 20px; align-items: start; }
  form, section { background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 16px; }
  label { display: block; margin: 0 0 12px; font-weight: 600; font-size: 13px; }
  label.check { display: flex; gap: 8px; align-items: center; font-weight: 500; }
  input[type=number], select { display: block; width: 100%; box-sizing: border-box; margin-top: 4px; padding: 6px;
                               font: inherit; border: 1px solid var(--line); border-radius: 5px; }
  small { display: block; color: var(--muted); font-weight: 400; }
  table { width: 100%; border-collapse: collapse; font-variant-numeric: tabular-nums; }
  th, td { padding: 8px 10px; border-bottom: 1px solid var(--line); text-align: right; }
  th:first-child, td:first-child { text-align: left; }
  tr.total td { font-weight: 700; border-top: 2px solid #1d2330; border-bottom: 0; }
  .bar { height: 6px; background: var(--accent); border-radius: 3px; margin-top: 3px; opacity: 0.75; }
  .bar.cpu { background: #c47f17; }
  #summary { margin: 0 0 12px; }
  #error { color: #a61b1b; background: #fdecec; border-radius: 5px; padding: 8px 10px; margin: 0 0 12px; }
  #error[hidden] { display: none; }
  @media (max-width: 720px) { .layout { grid-template-columns: 1fr; } }
</style>
</head>
<body>
<main>
<h1>Memory calculator</h1>
<p class="lead">GPU and CPU memory needed to train a transformer, by component: the same as
<code>trahiv memory</code>. Change any input; the table follows.</p>
<div class="layout">
<form id="memory-form" data-api="__API__" autocomplete="off">
  <label>Model <select name="model">__MODEL_OPTIONS__</select></label>
  <label>Batch size <small>sequences per forward pass</small>
    <input type="number" name="batch_size" min="1" step="1" value="__BATCH_SIZE__" required></label>
  <label>Sequence length <small>tokens per sequence</small>
    <input type="number" name="seq_len" min="1" step="1" value="__SEQ_LEN__" required></label>
  <label>Precision <select name="precision">__PRECISION_OPTIONS__</select></label>
  <label>Optimizer bits <small>32: Adam/LAMB; 8: bitsandbytes 8-bit states</small>
    <select name="optimizer_bits">__BITS_OPTIONS__</select></label>
  <label class="check"><input type="checkbox" name="offload"__OFFLOAD__> Offload optimizer to CPU</label>
  <label class="check"><input type="checkbox" name="gradient_checkpointing"__CHECKPOINTING__> Gradient checkpointing
  </label>
  <label class="check"><input type="checkbox" name="parameter_sharing"__SHARING__> Parameter sharing (all layers)
  </label>
  <label>LoRA rank <small>empty: train all weights</small>
    <input type="number" name="lora_rank" min="1" step="1" value="__LORA_RANK__" placeholder="full fine-tuning">
  </label>
</form>
<section>
  <p id="error" role="alert" hidden></p>
  <p id="summary"></p>
  <table id="memory-table">
    <thead><tr><th>component</th><th>GPU (GiB)</th><th>CPU (GiB)</th></tr></thead>
    <tbody></tbody>
  </table>
</section>
</div>
</main>
<script id="labels" type="application/json">__LABELS__</script>
<script id="initial" type="application/json">__INITIAL__</script>
<script>
"use strict";
const form = document.getElementById("memory-form");
const labels = JSON.parse(document.getElementById("labels").textContent);
const errorBox = document.getElementById("error");
const gib = (bytes) => (bytes / 2 ** 30).toFixed(2);

function cell(text, className) {
  const td = document.createElement("td");
  td.textContent = text;
  if (className) td.className = className;
  return td;
}

function amount(bytes, scale, kind) {
  const td = cell(gib(bytes));
  const bar = document.createElement("div");
  bar.className = "bar " + kind;
  bar.style.width = (scale > 0 ? (100 * bytes) / scale : 0).toFixed(1) + "%";
  td.appendChild(bar);
  return td;
}

function render(result) {
  const rows = [];
  const scale = Math.max(result.gpu.total, result.cpu.total);
  for (const [name, label] of Object.entries(labels)) {
    const tr = document.createElement("tr");
    tr.dataset.component = name;
    tr.append(cell(label), amount(result.gpu[name], scale, "gpu"), amount(result.cpu[name], scale, "cpu"));
    rows.push(tr);
  }
  const total = document.createElement("tr");
  total.className = "total";
  total.dataset.component = "total";
  total.append(cell("total"), cell(gib(result.gpu.total)), cell(gib(result.cpu.total)));
  rows.push(total);
  document.querySelector("#memory-table tbody").replaceChildren(...rows);
  const count = (n) => n.toLocaleString("en-US");
  document.getElementById("summary").textContent = result.model.name + ": " + count(result.params) +
    " parameters (" + count(result.trainable_params) + " trainable); " + gib(result.total) + " GiB in all";
  errorBox.hidden = true;
}

function describeError(detail) {
  if (!Array.isArray(detail)) return String(detail);
  return detail.map((d) => (d.loc ? d.loc[d.loc.length - 1] + ": " : "") + d.msg).join("; ");
}

function showError(message) {
  errorBox.textContent = message;
  errorBox.hidden = false;
}

function parameters() {
  const params = new URLSearchParams();
  for (const element of form.elements) {
    if (!element.name) continue;
    if (element.type === "checkbox") params.set(element.name, element.checked ? "true" : "false");
    else if (element.value !== "") params.set(element.name, element.value);
  }
  return params;
}

let inFlight = null;
async function update() {
  const params = parameters();
  if (inFlight) inFlight.abort();
  const controller = (inFlight = new AbortController());
  try {
    const response = await fetch(form.dataset.api + "?" + params, { signal: controller.signal });
    const body = await response.json();
    if (!response.ok) return showError(describeError(body.detail));
    render(body);
    history.replaceState(null, "", "?" + params);
  } catch (error) {
    if (error.name !== "AbortError") showError("The calculator did not answer: " + error);
  }
}

form.addEventListener("input", update);
form.addEventListener("change", update);
form.addEventListener("submit", (event) => { event.preventDefault(); update(); });
render(JSON.parse(document.getElementById("initial").textContent));
</script>
</body>
</html>
"""
