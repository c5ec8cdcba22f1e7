"""The memory calculator's web page (trahiv.web.memory_page): the JSON API against trahiv.memory.estimate, bad input,
the HTML form, the router inside another app, and `trahiv memory --serve` as a real process on 127.0.0.1."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from trahiv.memory import COMPONENTS, PRESETS, MemoryOptions, estimate, resolve_model
from trahiv.web.memory_page import MemoryQuery, create_app, create_router

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
FIELDS = ("model", "batch_size", "seq_len", "precision", "optimizer_bits", "offload", "gradient_checkpointing",
          "parameter_sharing", "lora_rank")  # fmt: skip


@pytest.fixture(scope="module")
def client() -> TestClient:
    return TestClient(create_app())


# --- the API ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "preset", "options"),
    [
        ({}, "gpt2-xl", MemoryOptions()),
        (
            {"model": "gpt2-xl", "batch_size": "4", "seq_len": "1024", "precision": "fp16", "optimizer_bits": "8",
             "offload": "true"},
            "gpt2-xl",
            MemoryOptions(batch_size=4, seq_len=1024, precision="fp16", optimizer_bits=8, offload_optimizer=True),
        ),
        (
            {"model": "dalle", "seq_len": "1280", "gradient_checkpointing": "1", "parameter_sharing": "yes",
             "lora_rank": "16", "precision": "bf16"},
            "dalle",
            MemoryOptions(seq_len=1280, gradient_checkpointing=True, parameter_sharing=True, lora_rank=16,
                          precision="bf16"),
        ),
        ({"model": "GPT-J 6B", "offload": "false"}, "gpt-j-6b", MemoryOptions()),  # names are forgiving, like the CLI's
    ],
    ids=["defaults", "fp16-8bit-offload", "dalle-checkpointing-sharing-lora", "forgiving-name"],
)  # fmt: skip
def test_api_answers_what_estimate_computes(client, params, preset, options):
    response = client.get("/api/memory", params=params)
    assert response.status_code == 200, response.text
    assert response.json() == estimate(PRESETS[preset], options).to_dict()


@pytest.mark.parametrize(
    ("params", "field", "message"),
    [
        ({"batch_size": "0"}, "batch_size", "greater than or equal to 1"),
        ({"seq_len": "long"}, "seq_len", "valid integer"),
        ({"precision": "int8"}, "precision", "precision must be one of fp32, fp16, bf16"),
        ({"optimizer_bits": "16"}, "optimizer_bits", "optimizer_bits must be 32 or 8"),
        ({"offload": "maybe"}, "offload", "valid boolean"),
        ({"lora_rank": "0"}, "lora_rank", "greater than or equal to 1"),
        ({"model": "gpt-4"}, "model", "unknown model 'gpt-4'"),
        ({"model": "../../etc/passwd"}, "model", "unknown model"),  # a request never names a file
        ({"batchsize": "3"}, "batchsize", "Extra inputs are not permitted"),  # a typo is not ignored
    ],
)
def test_bad_input_is_a_422_with_the_reason(client, params, field, message):
    response = client.get("/api/memory", params=params)
    assert response.status_code == 422
    errors = response.json()["detail"]
    assert any(e["loc"] == ["query", field] and message in e["msg"] for e in errors), errors


def test_unknown_model_suggests_close_presets(client):
    detail = client.get("/api/memory", params={"model": "gpt3-17b"}).json()["detail"]
    assert "Did you mean gpt3-175b" in detail[0]["msg"]


# --- the page -----------------------------------------------------------------------------------------------------


def embedded_json(page: str, element_id: str) -> dict:
    match = re.search(rf'<script id="{element_id}" type="application/json">(.*?)</script>', page, re.S)
    assert match, f"no #{element_id} data in the page"
    return json.loads(match.group(1))


def test_page_has_the_form_and_the_estimate(client):
    response = client.get("/memory")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    page = response.text
    for name in FIELDS:
        assert f'name="{name}"' in page, name
    for preset in PRESETS:
        assert f'<option value="{preset}"' in page, preset
    assert 'data-api="/api/memory"' in page
    assert embedded_json(page, "initial") == estimate(PRESETS["gpt2-xl"], MemoryOptions()).to_dict()
    assert list(embedded_json(page, "labels")) == list(COMPONENTS)


def test_page_is_self_contained(client):
    page = client.get("/memory").text
    assert "<style>" in page and "<script>" in page
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=", page), "the page must load nothing else"
    assert "http://" not in page and "https://" not in page


def test_page_query_string_fills_the_form(client):
    query = "model=t5-3b&batch_size=4&precision=fp16&optimizer_bits=8&offload=true&lora_rank=8"
    page = client.get(f"/memory?{query}").text
    assert '<option value="t5-3b" selected>' in page and '<option value="fp16" selected>' in page
    assert '<option value="8" selected>' in page
    assert 'name="batch_size" min="1" step="1" value="4"' in page
    assert 'name="lora_rank" min="1" step="1" value="8"' in page
    assert 'name="offload" checked' in page and 'name="gradient_checkpointing" checked' not in page
    options = MemoryOptions(batch_size=4, precision="fp16", optimizer_bits=8, offload_optimizer=True, lora_rank=8)
    assert embedded_json(page, "initial") == estimate(PRESETS["t5-3b"], options).to_dict()
    assert client.get("/memory?batch_size=-1").status_code == 422


def test_router_works_inside_another_app_and_with_extra_models(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128).save_pretrained(tmp_path)
    shape = resolve_model(tmp_path)
    app = FastAPI()  # a dashboard, say
    defaults = MemoryQuery(model=shape.name, batch_size=2)
    app.include_router(create_router({shape.name: shape}, defaults), prefix="/tools")
    client = TestClient(app)
    page = client.get("/tools/memory").text
    assert 'data-api="/tools/api/memory"' in page
    assert embedded_json(page, "initial") == estimate(shape, MemoryOptions(batch_size=2)).to_dict()
    response = client.get("/tools/api/memory", params={"model": shape.name, "seq_len": "64"})
    assert response.json() == estimate(shape, MemoryOptions(seq_len=64)).to_dict()


def test_unknown_default_model_fails_at_start():
    with pytest.raises(ValueError, match="unknown model 'gpt-5'"):
        create_router(defaults=MemoryQuery(model="gpt-5"))


def test_query_checks_match_the_calculators():
    with pytest.raises(ValueError, match="precision must be one of"):
        MemoryQuery(precision="fp8")
    assert MemoryQuery(optimizer_bits=8, lora_rank=4).options() == MemoryOptions(optimizer_bits=8, lora_rank=4)


# --- `trahiv memory --serve` --------------------------------------------------------------------------------------


def _trahiv_memory(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "trahiv.cli.main", "memory", *args]
    return subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=60)


def test_model_is_required_without_serve():
    done = _trahiv_memory("--batch-size", "2")
    assert done.returncode == 2 and "required: model (unless --serve)" in done.stderr


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fetch(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def wait_until_serving(process: subprocess.Popen, url: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the server exited with {process.returncode}"
        try:
            status, body = fetch(url, timeout=2.0)
            if status == 200:
                return body
        except OSError:  # not listening yet
            pass
        time.sleep(0.2)
    raise AssertionError(f"nothing answered at {url} within {timeout:.0f} s")


def screenshot(url: str, tmp_path: Path) -> Path | None:
    """A headless Chromium screenshot of the page, if Debian's chromium is installed."""
    chromium = shutil.which("chromium")
    if chromium is None:
        return None
    png = tmp_path / "memory.png"
    profile = tmp_path / "chromium-profile"
    command = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
               f"--screenshot={png}", "--window-size=1200,900", url]  # fmt: skip
    subprocess.run(command, capture_output=True, timeout=60)
    return png


def test_serve_runs_the_page_over_http(tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "trahiv.cli.main", "memory", "--serve", "--port", str(port), "--batch-size", "2"]
    log = open(tmp_path / "server.log", "w")
    process = subprocess.Popen(command, cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT)
    try:
        page = wait_until_serving(process, f"{base}/memory")
        for name in FIELDS:
            assert f'name="{name}"' in page
        assert 'name="batch_size" min="1" step="1" value="2"' in page  # the command's options start the page
        status, body = fetch(f"{base}/api/memory?model=bert-large&precision=fp16&optimizer_bits=8")
        assert status == 200
        expected = estimate(PRESETS["bert-large"], MemoryOptions(precision="fp16", optimizer_bits=8))
        assert json.loads(body) == expected.to_dict()
        status, body = fetch(f"{base}/api/memory?seq_len=0")
        assert status == 422 and "seq_len" in body
        png = screenshot(f"{base}/memory", tmp_path)
        if png is not None:
            assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "chromium took no screenshot"
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            raise AssertionError("the server did not stop within 10 s of SIGTERM") from None
    output = (tmp_path / "server.log").read_text()
    assert code == 0, output
    assert f"Memory calculator: {base}/memory" in output
