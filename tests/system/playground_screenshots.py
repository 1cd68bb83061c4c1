"""The playground pictures in docs/playground.md: ``python -m tests.system.playground_screenshots --out docs``.

Serves the default model (SmolLM2-135M-Instruct) twice and photographs the page in headless
Chromium (``./dev browser``) at two moments:

- ``playground-parallel.png``: a second chat turn with n = 4, on the snapshot where the samples
  have just copied the prompt's last, partly filled block (copy-on-write, highlighted) while the
  full blocks stay shared by all four; the first turn's blocks wait in the prefix cache.
- ``playground-preemption.png``: a pool too small for the six requests in flight, preempting by
  swap: the map is paused on the snapshot where a request's blocks moved to the CPU pool.

Not a test: it takes a minute or two and its pictures depend on what the model says.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import tempfile
import time
import urllib.request
from pathlib import Path

from tests.doubles.browser import chromium, find_chromium, wait_js
from tests.doubles.serve import start_server, stop

# Pause the map on the first snapshot ``window.__pauseWhen(snapshot)`` accepts.
PAUSE_HOOK = """
window.kvMap.onUpdate.push((m) => {
  if (window.__pauseWhen && window.__pauseWhen(m.lastSnapshot)) {
    window.__pauseWhen = null;
    window.playground.pauseMap(true);
  }
});
"""


def _page(driver, url: str) -> None:
    driver.get(url + "/")
    wait_js(driver, "return document.getElementById('conn').textContent === 'map live' && "
                    "window.playground.state.model", 60)
    driver.execute_script(PAUSE_HOOK)


def _set(driver, **values) -> None:
    for element_id, value in values.items():
        driver.execute_script("const e = document.getElementById(arguments[0]);"
                              "if (e.type === 'checkbox') e.checked = arguments[1]; else e.value = arguments[1];",
                              element_id.replace("_", "-"), value)


def _ask(driver, text: str) -> None:
    box = driver.find_element("id", "prompt")
    box.send_keys(text)
    driver.find_element("id", "send").click()


def _focus_request(driver, request_id: str) -> None:
    from selenium.webdriver.common.action_chains import ActionChains

    row = driver.find_element("css selector", f".req[data-request='{request_id}']")
    driver.execute_script("arguments[0].scrollIntoView({block: 'nearest'})", row)
    ActionChains(driver).move_to_element(row).perform()


def parallel_sampling(url: str, path: Path) -> None:
    with chromium(1440, 900) as driver:
        _page(driver, url)
        _set(driver, temperature=0.7, max_tokens=90, n=1)
        _ask(driver, "In two sentences: what does an operating system's page table do?")
        wait_js(driver, "const r = window.playground.state.requests; return r.length && r[0].done", 300)
        _set(driver, n=4, temperature=1.0, max_tokens=120)
        driver.execute_script("window.__pauseWhen = (s) => s.events.some((e) => e.kind === 'copy')")
        _ask(driver, "Now give me four different one-line analogies for it.")
        wait_js(driver, "return window.playground.state.mapPaused", 300)
        time.sleep(6)  # the answers keep streaming while the map holds that moment
        rid = driver.execute_script("const r = window.playground.state.requests; return r[r.length - 1].id")
        _focus_request(driver, rid)
        time.sleep(0.3)
        driver.save_screenshot(str(path))
        wait_js(driver, "const r = window.playground.state.requests; return r[r.length - 1].done", 300)


def preemption(url: str, path: Path) -> None:
    model = json.loads(urllib.request.urlopen(url + "/v1/models", timeout=30).read())["data"][0]["id"]
    topics = ["tides", "volcanoes", "bread", "bees", "glaciers"]

    def background(topic: str) -> None:
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": f"Tell me about {topic}."}],
                           "max_tokens": 200, "temperature": 0.8, "ignore_eos": True}).encode()
        request = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=600).read()

    with chromium(1440, 900) as driver, concurrent.futures.ThreadPoolExecutor(len(topics)) as pool:
        _page(driver, url)
        _set(driver, n=2, temperature=0.8, max_tokens=200, ignore_eos=True)
        driver.execute_script("window.__pauseWhen = (s) => s.stats.num_swapped > 0 && "
                              "s.events.some((e) => e.kind === 'swap_out')")
        _ask(driver, "Why would a server pause a request and move its memory to the CPU?")
        time.sleep(1.0)
        jobs = [pool.submit(background, topic) for topic in topics]
        wait_js(driver, "return window.playground.state.mapPaused", 600)
        swapped = driver.execute_script("return window.kvMap.lastSnapshot.sequences.find((q) => q.on_cpu).request_id")
        time.sleep(1.5)
        _focus_request(driver, swapped)
        time.sleep(0.3)
        driver.save_screenshot(str(path))
        driver.execute_script("window.playground.pauseMap(false)")
        for job in jobs:
            job.result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="docs", help="folder for the PNG files (default: %(default)s)")
    args = parser.parse_args()
    if find_chromium() is None:
        raise SystemExit("no headless Chromium: `./dev browser` installs chromium, chromium-driver and selenium")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scenes = [
        (parallel_sampling, "playground-parallel.png", ["--num-kv-blocks", "160"]),
        (preemption, "playground-preemption.png",
         ["--num-kv-blocks", "40", "--preemption-mode", "swap", "--swap-space", "0.04", "--max-num-seqs", "8"]),
    ]
    for shoot, name, flags in scenes:
        with tempfile.TemporaryDirectory() as tmp:
            proc, url = start_server(Path(tmp), *flags)
            try:
                shoot(url, out / name)
                print(f"wrote {out / name}")
            finally:
                stop(proc)


if __name__ == "__main__":
    main()
