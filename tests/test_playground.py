"""The playground page (GET /) in a real headless browser: Debian's chromium and chromium-driver
through Selenium (``make test`` installs them where missing). Load the page, submit a prompt,
wait for the final image, check its size and that streamed previews appeared first."""

from __future__ import annotations

import shutil

import httpx
import pytest

from tests.helpers import TINY_ARGS, router_stats, wait_until

pytestmark = pytest.mark.slow

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and DRIVER):
        pytest.skip("Debian's chromium and chromium-driver are not installed (make test installs them as root)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # console errors: CSP refusals, 401s
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield driver
    driver.quit()


def _submit(browser, kind: str, size: str, steps: int) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    Select(browser.find_element(By.ID, "kind")).select_by_value(kind)
    for field, value in (("size", size), ("steps", str(steps))):
        browser.find_element(By.ID, field).clear()
        browser.find_element(By.ID, field).send_keys(value)
    browser.find_element(By.ID, "submit").click()


def test_the_page_is_static_and_fetches_nothing_from_outside(deploy):
    url = deploy(TINY_ARGS)
    page = httpx.get(f"{url}/", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "http://" not in page.text and "https://" not in page.text  # no CDN, no outside fetch
    # no other page may frame it (helper-66: clickjacking "generate"); it may reach this origin only
    assert page.headers["x-frame-options"] == "DENY" and page.headers["x-content-type-options"] == "nosniff"
    csp = page.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in csp and "connect-src 'self'" in csp and "default-src 'none'" in csp


def test_a_prompt_streams_previews_then_the_image(deploy, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    url = deploy(TINY_ARGS)
    browser.get(f"{url}/")
    prompt = browser.find_element(By.ID, "prompt")
    prompt.clear()
    prompt.send_keys("a green star on a black background")
    _submit(browser, "image", "64x48", 16)
    final = WebDriverWait(browser, 120).until(ec.presence_of_element_located((By.ID, "final")))
    WebDriverWait(browser, 30).until(lambda d: d.execute_script("return arguments[0].complete", final))
    size = browser.execute_script("return [arguments[0].naturalWidth, arguments[0].naturalHeight]", final)
    assert size == [64, 48]
    previews = browser.find_elements(By.CSS_SELECTOR, "#previews img")
    assert len(previews) >= 1
    metadata = browser.find_element(By.ID, "metadata").text
    assert '"signature": "tiny-flux 64x48 steps=16' in metadata
    assert "error" not in (browser.find_element(By.ID, "status").get_attribute("class") or "")
    # nothing the page did was refused: by its Content-Security-Policy, or a /favicon.ico request
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []
    # Leaving the page in this tab mid-stream cancels the work (helper-78: the browser kept the
    # page and its connection in its back/forward cache, and the batch ran to its end for nobody)
    before = router_stats(url)["counters"]
    _submit(browser, "image", "256x256", 100)
    WebDriverWait(browser, 120).until(lambda d: d.find_element(By.ID, "status").text.startswith("preview"))
    browser.get(f"{url}/health")
    wait_until(lambda: router_stats(url)["counters"].get("cancelled_running", 0) > before.get("cancelled_running", 0),
               timeout=120)
    browser.back()  # restored from the cache or loaded again: either way a page that works
    WebDriverWait(browser, 30).until(ec.presence_of_element_located((By.ID, "submit")))


def test_behind_auth_the_page_loads_and_its_calls_carry_the_key(deploy, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    keys = tmp_path / "keys"
    keys.write_text("k1\n")
    url = deploy({**TINY_ARGS, "auth": {"api_keys_file": str(keys)}})
    assert httpx.get(f"{url}/", timeout=30).status_code == 200  # the static page itself
    assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401
    browser.get(f"{url}/")
    browser.execute_script("sessionStorage.clear()")
    browser.get(f"{url}/")
    browser.find_element(By.ID, "submit").click()  # no key: the API's 401 is shown
    WebDriverWait(browser, 60).until(lambda d: "error" in (d.find_element(By.ID, "status").get_attribute("class")
                                                           or ""))
    assert "API key" in browser.find_element(By.ID, "status").text
    browser.find_element(By.ID, "api_key").send_keys("k1")
    browser.find_element(By.ID, "submit").click()
    WebDriverWait(browser, 120).until(ec.presence_of_element_located((By.ID, "final")))
    # the key is kept for this tab only: a persistent localStorage entry was readable by any page
    # on the same origin (the Serve proxy's host:port)
    assert browser.execute_script("return sessionStorage.getItem('ditserve_api_key')") == "k1"
    assert browser.execute_script("return localStorage.getItem('ditserve_api_key')") is None


def test_a_video_job_shows_its_progress_then_the_video_and_a_failed_job_its_error(deploy, browser):
    """The page's video path on tiny-wan: the job is polled to completion (its progress shown)
    and its MP4 plays in a <video> element of the requested size; a job that fails (the fault
    injection fails any batch of 7 steps before its first) shows the job's error, not a video."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    from deployments.faults import FAULT_ENV

    url = deploy({"model": {"name": "tiny-wan"},
                  "limits": {"default_num_frames": 9, "default_fps": 8, "max_frames": 17, "max_pixels": 96 * 96},
                  "replica": {"num_replicas": 1, "torch_threads": 2,
                              "ray_actor_options": {"num_cpus": 2,
                                                    "runtime_env": {"env_vars": {FAULT_ENV: "steps=7 "}}}}})
    browser.get(f"{url}/")
    browser.execute_script("sessionStorage.clear()")  # no API key left by another test of this module
    browser.get(f"{url}/")
    status = lambda d: d.find_element(By.ID, "status")  # noqa: E731
    _submit(browser, "video", "64x48", 6)
    final = WebDriverWait(browser, 120).until(ec.presence_of_element_located((By.ID, "final")))
    assert final.tag_name == "video"
    # the browser itself reads the MP4 (H.264): its metadata gives the size
    WebDriverWait(browser, 30).until(lambda d: d.execute_script("return arguments[0].readyState >= 1", final))
    assert browser.execute_script("return [arguments[0].videoWidth, arguments[0].videoHeight]", final) == [64, 48]
    assert browser.find_element(By.ID, "progress").get_attribute("value") == "100"
    assert status(browser).text == "done" and "error" not in (status(browser).get_attribute("class") or "")
    assert '"signature": "tiny-wan 64x48' in browser.find_element(By.ID, "metadata").text
    # the MP4 as the page got it (its blob: URL), read back as the browser received it
    mp4 = browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "fetch(arguments[0].src).then((r) => r.arrayBuffer())"
        ".then((b) => done(Array.from(new Uint8Array(b))), (e) => done(String(e)));", final)
    from pipeline.media import decode_mp4

    frames, fps = decode_mp4(bytes(mp4))
    assert frames.shape == (9, 48, 64, 3) and fps == 8

    _submit(browser, "video", "64x48", 7)  # the fault injection fails a batch of 7 steps
    WebDriverWait(browser, 120).until(lambda d: "error" in (status(d).get_attribute("class") or ""))
    assert "failed" in status(browser).text, status(browser).text  # the job's error message ("batch ... failed")
    assert not browser.find_elements(By.ID, "final")

    # a running job's latest preview frame (variant=thumbnail) is shown while it runs (helper-66:
    # the page never asked for it); 100 steps (limits.max_steps) outlast several of the page's 300 ms polls
    browser.get_log("browser")  # read (and so cleared): the entries of earlier tests' deliberate errors
    _submit(browser, "video", "64x48", 100)
    preview = WebDriverWait(browser, 120).until(ec.presence_of_element_located((By.ID, "video_preview")))
    WebDriverWait(browser, 30).until(lambda d: d.execute_script("return arguments[0].naturalWidth", preview) > 0)
    assert browser.execute_script("return [arguments[0].naturalWidth, arguments[0].naturalHeight]", preview) == [64, 48]
    WebDriverWait(browser, 300).until(ec.presence_of_element_located((By.ID, "final")))
    assert status(browser).text == "done"
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE" and "/content" not in e["message"]] == []
