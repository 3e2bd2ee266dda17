"""The ``/ui`` page in a real headless browser (Debian's chromium + chromedriver, driven by selenium).

One server per pipeline kind: the demo diffusion model with its ``warm`` and ``stripes`` adapters,
and the tiny Qwen2 model with two adapters. The page must load the adapters from ``/v1/models``,
start its steps and guidance at what the server runs for a request that sets none (``/ui/info``
``defaults``: the demo model's own 12 steps and guidance 3), send what its controls say (the images it
shows equal the ones the API returns for the same request), fill an XY grid, show the server's
refusals, and answer in the chat box with the chosen adapter (the same text as the API).

``VLLM_OMNI_UI_SCREENSHOT=<png path>`` also writes a screenshot of the filled grid at 64x64 with the
model's default steps and guidance (how ``docs/assets/ui.png`` is made).
"""

from __future__ import annotations

import base64
import json
import os
import shutil

import pytest

from tests.entrypoints.server_utils import HTTP, REPO_ROOT, free_port, serve_command, server_env, start_server

pytestmark = [pytest.mark.engine, pytest.mark.slow]
DEMO = REPO_ROOT / "examples" / "demo_model"
CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
SCREENSHOT = os.environ.get("VLLM_OMNI_UI_SCREENSHOT")
#: generous caps on waits for progress (the page's own state), never a fixed pause
WAIT_S = 900


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not (CHROMIUM and DRIVER):
        pytest.skip("chromium / chromedriver not installed (tools/setup.sh installs them as root)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in (
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1500,1100",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",
    ):  # fmt: skip
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def image_server(tmp_path_factory):
    port = free_port()
    adapters = DEMO / "adapters"
    lora_dir = tmp_path_factory.mktemp("ui_lora_dirs")
    shutil.copytree(adapters / "warm", lora_dir / "warm_dir")  # not registered: the page lists it by path
    cmd = serve_command(
        str(DEMO), port, "--served-model-name", "demo", "--max-loras", "2",
        "--lora-modules", f"warm={adapters / 'warm'}", f"stripes={adapters / 'stripes'}", "--lora-dirs", str(lora_dir),
    )  # fmt: skip
    srv = start_server(
        cmd, port, tmp_path_factory.mktemp("ui_img") / "server.log", server_env(), timeout=WAIT_S
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def llm_server(tiny_llm_assets, tmp_path_factory):
    port = free_port()
    cmd = serve_command(
        str(tiny_llm_assets.model_dir), port, "--served-model-name", "tiny",
        "--enable-lora", "--max-lora-rank", "16", "--max-model-len", "256", "--dtype", "float32",
        "--lora-modules", f"a={tiny_llm_assets.adapter_a}", f"b={tiny_llm_assets.adapter_b}",
    )  # fmt: skip
    srv = start_server(
        cmd, port, tmp_path_factory.mktemp("ui_llm") / "server.log", server_env(), timeout=WAIT_S
    )
    yield srv
    srv.stop()


def wait(driver, what: str, condition):
    """Wait for ``condition(driver)`` (the page's progress), failing with what the page showed."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, WAIT_S, poll_frequency=0.5).until(condition)
    except TimeoutException:
        status = driver.execute_script("return document.getElementById('status').textContent")
        raise AssertionError(f"timed out waiting for {what}; page status: {status!r}") from None


def open_page(driver, server) -> None:
    driver.get(server.url("/ui"))
    wait(
        driver,
        "the page to read the server",
        lambda d: d.execute_script("return document.body.dataset.ready"),
    )


def set_value(driver, selector: str, value) -> None:
    """Set a control's value as a user would (``input`` / ``change`` events fire)."""
    driver.execute_script(
        "const el = document.querySelector(arguments[0]); el.value = arguments[1];"
        "el.dispatchEvent(new Event('input')); el.dispatchEvent(new Event('change'));",
        selector,
        str(value),
    )


def server_defaults(server) -> dict:
    """What the server runs for a request that sets no steps or guidance (``/ui/info``)."""
    return HTTP.get(server.url("/ui/info"), timeout=300).json()["defaults"]


SERVER = "server"  # api_image: the guidance the page's field starts at, the server's default


def api_image(server, size: int, steps: int | None, seed: int, lora: list, guidance=SERVER) -> str:
    """The API's image for a request like the page's; ``steps`` / ``guidance`` ``None``: left out."""
    body = {
        "model": "demo", "prompt": "a blue circle", "size": f"{size}x{size}", "response_format": "b64_json",
        "seed": seed,
    }  # fmt: skip
    if steps is not None:
        body["num_inference_steps"] = steps
    if guidance == SERVER:
        guidance = server_defaults(server)["guidance_scale"]
    if guidance is not None:
        body["guidance_scale"] = guidance
    if lora:
        body["lora"] = lora
    reply = HTTP.post(server.url("/v1/images/generations"), json=body, timeout=600)
    assert reply.status_code == 200, reply.text[:300]
    return reply.json()["data"][0]["b64_json"]


def shown_png(img) -> str:
    src = img.get_attribute("src")
    assert src.startswith("data:image/png;base64,")
    return src.split(",", 1)[1]


def settings(driver, size: int, steps: int | None) -> None:
    """Size, steps (``None``: as the page starts) and seed 0; guidance as the page starts."""
    for field, v in (("width", size), ("height", size), ("steps", steps), ("seed", 0)):
        if v is not None:
            set_value(driver, f"#{field}", v)


def test_page_loads_the_adapters_and_a_generation_shows_its_image(browser, image_server):
    from selenium.webdriver.common.by import By

    open_page(browser, image_server)
    rows = browser.find_elements(By.CSS_SELECTOR, "#adapters .adapter")
    assert [r.get_attribute("data-adapter") for r in rows] == ["warm", "stripes", "warm_dir"]
    assert "demo" in browser.find_element(By.ID, "model-info").text
    assert not browser.find_element(By.ID, "chat-mode").is_displayed()
    settings(browser, 32, 3)
    browser.find_element(By.CSS_SELECTOR, "[data-adapter=warm] .use").click()
    set_value(browser, "[data-adapter=warm] .scale", 0.5)
    assert browser.find_element(By.CSS_SELECTOR, "[data-adapter=warm] .scale-value").text == "0.5"
    browser.find_element(By.ID, "generate").click()
    img = wait(browser, "the generated image", lambda d: d.find_elements(By.CSS_SELECTOR, "#result img"))[0]
    wait(browser, "the image to decode", lambda d: d.execute_script("return arguments[0].naturalWidth", img))
    assert browser.execute_script("return arguments[0].naturalWidth", img) == 32
    assert shown_png(img) == api_image(image_server, 32, 3, 0, [{"name": "warm", "scale": 0.5}])
    assert shown_png(img) != api_image(image_server, 32, 3, 0, [])


def test_the_page_follows_the_server_limits_and_defaults(browser, image_server):
    """Sliders start at the server's scale; no more adapters can be ticked than a request may use, and the
    server's refusal of too many names the flag that allows more."""
    from selenium.webdriver.common.by import By

    open_page(browser, image_server)
    info = HTTP.get(image_server.url("/ui/info"), timeout=300).json()
    assert info["max_adapters"] == 2 and info["default_scale"] == 1.0
    assert browser.find_element(By.CSS_SELECTOR, "[data-adapter=warm] .scale-value").text == "1"
    # a server that applies one adapter per request, with --lora-scale 0.5 (the page's own state)
    browser.execute_script("state.info.max_adapters = 1; state.info.default_scale = 0.5; renderAdapters();")
    assert browser.find_element(By.CSS_SELECTOR, "[data-adapter=stripes] .scale-value").text == "0.5"
    browser.find_element(By.CSS_SELECTOR, "[data-adapter=warm] .use").click()
    stripes = browser.find_element(By.CSS_SELECTOR, "[data-adapter=stripes] .use")
    assert not stripes.is_enabled() and "--max-loras" in stripes.get_attribute("title")
    three = [{"name": n, "scale": 1} for n in ("warm", "stripes", "warm")]
    reply = HTTP.post(
        image_server.url("/v1/images/generations"), json={"prompt": "x", "lora": three}, timeout=300
    )
    assert reply.status_code == 400 and "--max-loras N" in reply.json()["error"]["message"]


def test_steps_and_guidance_start_at_what_the_server_runs_by_default(browser, image_server):
    """The page's steps and guidance are the server's defaults (the demo model's own ``_call_defaults``,
    not the page's former 8 / 0): the page's image with its fields untouched, a request that sets neither,
    and one that spells them out are the same image; an emptied field is left out of the request."""
    from selenium.webdriver.common.by import By

    open_page(browser, image_server)
    defaults = server_defaults(image_server)
    steps, guidance = defaults["num_inference_steps"], defaults["guidance_scale"]
    declared = json.loads((DEMO / "model_index.json").read_text())["_call_defaults"]
    assert {"num_inference_steps": steps, "guidance_scale": guidance} == declared
    assert (steps, guidance) != (8, 0)  # the page's former hard-coded values
    assert defaults["from"]["num_inference_steps"] == "model_index.json _call_defaults"
    fields = {name: browser.find_element(By.ID, name) for name in ("steps", "guidance")}
    assert int(fields["steps"].get_attribute("value")) == steps
    assert float(fields["guidance"].get_attribute("value")) == guidance
    assert "model_index.json _call_defaults" in fields["steps"].get_attribute("title")
    settings(browser, 32, None)
    status = browser.find_element(By.ID, "status")
    browser.find_element(By.ID, "generate").click()
    wait(browser, "the image at the default settings", lambda d: status.text.startswith("done"))
    shown = shown_png(browser.find_element(By.CSS_SELECTOR, "#result img"))
    unset = api_image(image_server, 32, None, 0, [], guidance=None)
    assert shown == unset == api_image(image_server, 32, steps, 0, [], guidance=guidance)
    assert unset != api_image(image_server, 32, 8, 0, [], guidance=0)  # the old defaults draw another image
    for name in fields:
        set_value(browser, f"#{name}", "")
    browser.find_element(By.ID, "generate").click()
    wait(browser, "the image with emptied fields", lambda d: status.text.startswith("done"))
    assert shown_png(browser.find_element(By.CSS_SELECTOR, "#result img")) == unset


def test_an_adapter_in_lora_dirs_is_listed_and_loaded_on_first_use(browser, image_server):
    from selenium.webdriver.common.by import By

    open_page(browser, image_server)
    path = browser.find_element(By.CSS_SELECTOR, "[data-adapter=warm_dir]").get_attribute("data-path")
    assert (
        path.endswith("warm_dir")
        and "warm_dir" not in HTTP.get(image_server.url("/v1/models"), timeout=300).text
    )
    settings(browser, 32, 3)
    browser.find_element(By.CSS_SELECTOR, "[data-adapter=warm_dir] .use").click()
    set_value(browser, "[data-adapter=warm_dir] .scale", 0.5)
    browser.find_element(By.ID, "generate").click()
    status = browser.find_element(By.ID, "status")
    wait(browser, "the image of the folder's adapter", lambda d: status.text.startswith("done"))
    img = browser.find_element(By.CSS_SELECTOR, "#result img")
    assert shown_png(img) == api_image(image_server, 32, 3, 0, [{"name": "warm", "scale": 0.5}])  # same files


def test_a_schedule_reaches_the_server_and_bad_ones_are_explained(browser, image_server):
    from selenium.webdriver.common.by import By

    open_page(browser, image_server)
    settings(browser, 32, 3)
    browser.find_element(By.CSS_SELECTOR, "[data-adapter=stripes] .use").click()
    status = browser.find_element(By.ID, "status")
    set_value(browser, "[data-adapter=stripes] .schedule", "[1, 2")
    browser.find_element(By.ID, "generate").click()
    wait(browser, "the JSON error", lambda d: "not valid JSON" in status.text)
    set_value(browser, "[data-adapter=stripes] .schedule", "[1, 0.5]")  # 2 values for 3 steps
    browser.find_element(By.ID, "generate").click()
    wait(browser, "the server's refusal", lambda d: status.text.startswith("400"))
    assert "lora[0].scale" in status.text and "stripes" in status.text
    set_value(browser, "[data-adapter=stripes] .schedule", "1@0.5>0")
    browser.find_element(By.ID, "generate").click()
    wait(browser, "the scheduled image", lambda d: status.text.startswith("done"))
    img = browser.find_element(By.CSS_SELECTOR, "#result img")
    ranges = [{"start": 0, "end": 0.5, "scale": 1}, {"start": 0.5, "end": 1, "scale": 0}]
    assert shown_png(img) == api_image(image_server, 32, 3, 0, [{"name": "stripes", "scale": ranges}])


def test_the_xy_grid_fills_cell_by_cell(browser, image_server):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    size, steps = (64, None) if SCREENSHOT else (32, 3)
    open_page(browser, image_server)
    settings(browser, size, steps)
    Select(browser.find_element(By.ID, "grid-x-kind")).select_by_value("scale:warm")
    Select(browser.find_element(By.ID, "grid-y-kind")).select_by_value("scale:stripes")
    set_value(browser, "#grid-x-values", "0, 0.5, 1")
    set_value(browser, "#grid-y-values", "0, 0.5, 1" if SCREENSHOT else "0, 1")
    # The page records every change of the number of finished cells (a MutationObserver runs on each DOM
    # change): polling from here would miss intermediate counts when a loaded machine starves the poll.
    browser.execute_script(
        "window.doneCounts = [];"
        "new MutationObserver(() => {"
        "  const n = document.querySelectorAll('#grid td.done').length;"
        "  if (window.doneCounts[window.doneCounts.length - 1] !== n) window.doneCounts.push(n);"
        "}).observe(document.body, {subtree: true, childList: true, attributes: true});"
    )
    browser.find_element(By.ID, "grid-run").click()
    n = 9 if SCREENSHOT else 6

    def progress(d):
        done = d.find_elements(By.CSS_SELECTOR, "#grid td.done")
        failed = d.find_elements(By.CSS_SELECTOR, "#grid td.failed")
        assert not failed, failed[0].text
        return len(done) == n

    wait(browser, f"{n} grid cells", progress)
    counts = [c for c in browser.execute_script("return window.doneCounts") if c]
    # images appeared as they finished, not all at once (two responses may land in one browser task, so
    # not necessarily one by one)
    assert len(counts) >= 3 and counts == sorted(set(counts)) and counts[-1] == n, counts
    cells = browser.find_elements(By.CSS_SELECTOR, "#grid td.done img")
    assert [c.get_attribute("alt") for c in cells[:2]] == ["0 / 0", "0.5 / 0"]
    last = [{"name": "warm", "scale": 1}, {"name": "stripes", "scale": 1}]
    assert shown_png(cells[-1]) == api_image(image_server, size, steps, 0, last)
    if SCREENSHOT:
        browser.execute_script("document.getElementById('grid').scrollIntoView()")
        browser.save_screenshot(SCREENSHOT)
        assert base64.b64decode(browser.get_screenshot_as_base64())[:4] == b"\x89PNG"


def test_the_chat_box_answers_with_the_chosen_adapter(browser, llm_server):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    open_page(browser, llm_server)
    assert not browser.find_element(By.ID, "image-mode").is_displayed()
    assert HTTP.get(llm_server.url("/ui/info"), timeout=300).json()["defaults"] is None  # no diffusion stage
    select = Select(browser.find_element(By.ID, "chat-adapter"))
    assert [o.get_attribute("value") for o in select.options] == ["", "a", "b"]
    select.select_by_value("a")
    set_value(browser, "#chat-max-tokens", 8)
    box = browser.find_element(By.ID, "chat-input")
    box.send_keys("hello there")
    browser.find_element(By.ID, "chat-send").click()
    reply = wait(
        browser, "the answer", lambda d: d.find_elements(By.CSS_SELECTOR, "#chat-log .msg.assistant")
    )
    body = {
        "model": "a", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8, "temperature": 0,
    }  # fmt: skip
    api = HTTP.post(llm_server.url("/v1/chat/completions"), json=body, timeout=300).json()
    assert reply[0].text.removeprefix("model: ") == api["choices"][0]["message"]["content"]
    assert reply[0].get_attribute("data-by") == "adapter a"  # the page says who answered
    base = HTTP.post(
        llm_server.url("/v1/chat/completions"), json={**body, "model": "tiny"}, timeout=300
    ).json()
    assert base["choices"][0]["message"]["content"] != api["choices"][0]["message"]["content"]
