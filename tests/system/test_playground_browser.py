"""The playground in a real browser (headless Chromium): chat with a tiny-model server and watch the
request's blocks take its colour on the map, be shared by the samples of n = 3, and come free; and
the replay page of ``simulate --html``. Screenshots are saved under pytest's tmp dir (paths printed).

Skipped where no Chromium is installed (``./dev browser`` installs it)."""

from __future__ import annotations

import pytest

from tests.doubles.browser import chromium, console_errors, skip_without_chromium, wait_js
from tests.doubles.serve import tiny_server

pytestmark = [pytest.mark.slow, pytest.mark.browser]

API_KEY = "sk-browser-test"

# Installed in the page: after every snapshot the map draws, note the cells of the newest request,
# the colour actually painted on the canvas for one of its full blocks, and the chat's text so far.
RECORDER = """
window.__seen = [];
window.__textChanges = 0;
new MutationObserver(() => { window.__textChanges += 1; })
  .observe(document.getElementById('messages'), {subtree: true, characterData: true, childList: true});
const toRgb = (css) => {
  const probe = document.createElement('span');
  probe.style.color = css;
  document.body.appendChild(probe);
  const rgb = getComputedStyle(probe).color.match(/\\d+/g).slice(0, 3).map(Number);
  probe.remove();
  return rgb;
};
window.kvMap.onUpdate.push((m) => {
  const requests = window.playground.state.requests;
  const rid = requests.length ? requests[requests.length - 1].id : null;
  const mine = m.cells.filter((c) => c.owners.some((o) => o.requestId === rid));
  const full = mine.find((c) => c.fill >= m.lastSnapshot.block_size && c.refCount === 1);
  let probe = null;
  if (full) {
    const r = m.cellRect('device', full.block);
    const dpr = window.devicePixelRatio || 1;
    const ctx = m.device.getContext('2d');
    const px = ctx.getImageData(Math.floor((r.x + 2) * dpr), Math.floor((r.y + 2) * dpr), 1, 1).data;
    probe = {painted: [px[0], px[1], px[2]], expected: toRgb(full.color)};
  }
  window.__seen.push({snapshotId: m.lastSnapshot.snapshot_id, rid, probe,
    cells: mine.map((c) => ({block: c.block, state: c.state, refCount: c.refCount, color: c.color,
                             requestId: c.requestId, choices: c.owners.map((o) => o.choice)}))});
  if (window.__pauseWhen && window.__pauseWhen(mine)) {
    window.__pauseWhen = null;
    window.playground.pauseMap(true);
  }
});
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    skip_without_chromium()
    yield from tiny_server(tmp_path_factory, "playground-browser", "--num-kv-blocks", "256", "--api-key", API_KEY,
                           model_dir=tiny_model_dir)


def _set(driver, element_id: str, value) -> None:
    driver.execute_script("const e = document.getElementById(arguments[0]);"
                          "if (e.type === 'checkbox') e.checked = arguments[1]; else e.value = arguments[1];",
                          element_id, value)


def _ask(driver, text: str) -> None:
    box = driver.find_element("id", "prompt")
    box.clear()
    box.send_keys(text)
    driver.find_element("id", "send").click()


def _last_request(driver) -> dict:
    return driver.execute_script("const r = window.playground.state.requests; return r[r.length - 1];")


def _wait_free(driver, request_id: str) -> None:
    wait_js(driver, "return window.kvMap.lastSnapshot && window.kvMap.cells.every("
                    "(c) => !c.owners.some((o) => o.requestId === arguments[0]))", 60, request_id)


def test_chat_streams_and_the_map_follows_its_blocks(server, tmp_path):
    with chromium() as driver:
        driver.get(server + "/")
        wait_js(driver, "return document.getElementById('key-box').classList.contains('needed')")  # 401 seen
        driver.find_element("id", "api-key").send_keys(API_KEY)
        wait_js(driver, "return document.getElementById('conn').textContent === 'map live' && "
                        "window.playground.state.model")
        driver.execute_script(RECORDER)
        _one_answer_takes_blocks_in_its_colour_and_frees_them(driver)
        driver.find_element("id", "new-chat").click()  # a fresh conversation: the tiny model holds 256 tokens
        _three_samples_share_the_prompt(driver, tmp_path)
        final = tmp_path / "playground-after.png"
        driver.save_screenshot(str(final))
        print(f"screenshot: {final}")
        # the only errors: the 401s the page got before the key was typed
        assert [e for e in console_errors(driver) if "401 (Unauthorized)" not in e] == []


def _one_answer_takes_blocks_in_its_colour_and_frees_them(driver) -> None:
    _set(driver, "max-tokens", 200)
    _set(driver, "ignore-eos", True)
    _ask(driver, "Hello there, how are the blocks?")
    wait_js(driver, "const r = window.playground.state.requests; return r.length && r[0].done", 120)
    record = _last_request(driver)
    rid = record["id"]
    assert record["error"] is None and rid.startswith("chatcmpl-")
    bubble = driver.execute_script("return [...document.querySelectorAll('.msg.assistant .text')]"
                                   ".pop().textContent")
    assert bubble == record["texts"][0] and len(bubble) > 0
    assert driver.execute_script("return window.__textChanges") > 10  # streamed, not all at once
    seen = [e for e in driver.execute_script("return window.__seen") if e["rid"] == rid and e["cells"]]
    assert seen, "no snapshot showed the request's blocks"
    color = driver.execute_script("return window.playground.palette.color(arguments[0], 0)", rid)
    swatch = driver.execute_script("return [...document.querySelectorAll('.msg.assistant .swatch')].pop()"
                                   ".style.getPropertyValue('--c')")
    assert swatch == color  # the chat and the map say the same colour
    assert all(c["color"] == color and c["state"] == "used" for e in seen for c in e["cells"])
    probes = [e["probe"] for e in seen if e["probe"]]
    assert probes and all(max(abs(a - b) for a, b in zip(p["painted"], p["expected"])) <= 2 for p in probes)
    _wait_free(driver, rid)


def _three_samples_share_the_prompt(driver, tmp_path) -> None:
    """n = 3: the samples share the prompt's full blocks (count 3). The map pauses on the first
    snapshot that shows it, so the test can look closely: hover a shared cell, then the request."""
    from selenium.webdriver.common.action_chains import ActionChains

    _set(driver, "n", 3)
    driver.execute_script("window.__pauseWhen = (mine) => mine.some((c) => c.refCount === 3);")
    _ask(driver, "Now three answers, please.")
    wait_js(driver, "return window.playground.state.mapPaused", 120)
    rid = _last_request(driver)["id"]
    shared = driver.execute_script(
        "return window.kvMap.cells.filter((c) => c.refCount === 3 && c.requestId === arguments[0])"
        ".map((c) => ({block: c.block, choices: c.owners.map((o) => o.choice).sort()}))", rid)
    assert shared and all(c["choices"] == [0, 1, 2] for c in shared)
    shot = tmp_path / "playground-n3.png"
    driver.save_screenshot(str(shot))
    print(f"\nscreenshot: {shot}")
    canvas = driver.find_element("id", "device-map")
    rect = driver.execute_script("return window.kvMap.cellRect('device', arguments[0])", shared[0]["block"])
    size = canvas.size
    ActionChains(driver).move_to_element_with_offset(
        canvas, rect["x"] + rect["size"] / 2 - size["width"] / 2, rect["y"] + rect["size"] / 2 - size["height"] / 2,
    ).perform()
    tip = wait_js(driver, "const t = document.getElementById('tip'); return !t.hidden && t.textContent", 10)
    assert f"block {shared[0]['block']}" in tip and "shared by 3 block tables" in tip
    ActionChains(driver).move_to_element(driver.find_element("css selector", f".req[data-request='{rid}']")).perform()
    tables = wait_js(driver, "const s = document.querySelectorAll('#detail .detail-seq'); "
                             "return s.length === 3 && [...s].map((e) => e.textContent)", 10)
    assert all("\u00d73" in t for t in tables)  # each table shows the shared blocks' count
    driver.execute_script("window.playground.pauseMap(false)")
    wait_js(driver, "const r = window.playground.state.requests; return r[r.length - 1].done", 120)
    record = _last_request(driver)
    assert record["error"] is None and all(record["texts"])
    _wait_free(driver, rid)
    assert driver.execute_script("return window.kvMap.cells.some((c) => c.state === 'cached')")


def test_replay_page_plays_both_policies(tmp_path):
    skip_without_chromium()
    from services.replay_page import render_page, replay_data
    from services.scheduler.simulate import DEFAULT_REQUESTS, parse_requests

    data = replay_data(parse_requests(DEFAULT_REQUESTS), 256, 8, 64)
    page = tmp_path / "replay.html"
    page.write_text(render_page(data))
    with chromium() as driver:
        driver.get(page.as_uri())
        wait_js(driver, "return window.replay && window.replay.step === 0", 20)
        last = driver.execute_script("return window.replay.data.runs.contiguous.frames.length - 1")
        driver.execute_script("window.replay.show(12)")
        busy = driver.execute_script("return window.replay.sides.map((s) => s.map.cells.filter("
                                     "(c) => c.state === 'used').length)")
        running = data["runs"]["contiguous"]["frames"][12]["snapshot"]["stats"]["num_running"]
        assert running >= 3 and busy[0] == running * 8 and busy[1] > 0  # contiguous: 8-block reservations
        shot = tmp_path / "replay-step12.png"
        driver.save_screenshot(str(shot))
        print(f"\nscreenshot: {shot}")
        driver.find_element("id", "play").click()
        wait_js(driver, "return window.replay.step > 14", 20)
        driver.execute_script("window.replay.show(arguments[0])", last)
        assert driver.execute_script("return window.replay.sides.every((s) => s.map.cells.every("
                                     "(c) => c.state === 'free'))")
        assert driver.find_element("id", "step-label").text == f"step {last} / {last}"
        assert console_errors(driver) == []
