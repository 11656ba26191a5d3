"""The console under a large fleet: the Hardware page in Chromium, and the telemetry chart
endpoint, each side by side with a reference measured in the same run.

    .venv/bin/python bench/console.py [--nodes 1000] [--refreshes 4] [--requests 50]

Starts `modelforge serve` on a fresh SQLite state directory holding ``--nodes`` nodes of
8 GPUs and one hour of telemetry at 10 s for 50 of them (144,000 samples), then

- times GET .../nodes/{id}/telemetry for one node over the last hour (2,880 samples),
  against GET /healthz and GET .../nodes/{id} on the same server;
- opens the Hardware page in headless Chromium (Debian's, through Playwright) and reports
  the time from navigation to every row drawn, and each periodic refresh (fetch + DOM
  update), against a bare fetch + JSON parse of the same fleet answer in the same page.

Targets: the chart endpoint under 100 ms; the page's render and refresh under a second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from _load import modelforge, modelforge_env, start_modelforge, temp_state, wait_until_serving

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from modelforge_appliance.core.clock import ManualClock  # noqa: E402
from modelforge_appliance.store.database import Store  # noqa: E402
from modelforge_appliance.store.tables import GpuSample  # noqa: E402
from tests.harness.seeded_fleet import add_nodes  # noqa: E402

PASSWORD = "bench password, long enough"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip


def populate(state: str, nodes: int) -> list[str]:
    store = Store(f"sqlite:///{state}/modelforge.sqlite3", ManualClock(time.time()))
    store.migrate()
    ids = add_nodes(store, nodes)
    now = store.clock.now()
    rows = [
        {
            "node_id": node_id,
            "gpu_uuid": f"GPU-{gpu:02d}",
            "gpu_index": gpu,
            "at": now - 3600 + 10 * step,
            "utilization_gpu_percent": (step + gpu) % 101,
            "memory_used_bytes": (20 + step % 50) * 2**30,
            "memory_total_bytes": 80 * 2**30,
            "temperature_c": 45 + step % 30,
            "power_w": 150.0 + step % 500,
        }
        for node_id in ids[:50]
        for step in range(360)
        for gpu in range(8)
    ]
    with store.write():
        for start in range(0, len(rows), 500):
            GpuSample.insert_many(rows[start : start + 500]).execute()
    store.close()
    return ids


def timed_get(url: str, headers: dict, count: int) -> list[float]:
    times = []
    for _ in range(count):
        request = urllib.request.Request(url, headers=headers)
        started = time.perf_counter()
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()
        times.append((time.perf_counter() - started) * 1000)
    return times


def describe(label: str, times: list[float]) -> str:
    ordered = sorted(times)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return (
        f"{label:44} p50 {statistics.median(ordered):7.1f} ms   p99 {p99:7.1f} ms   "
        f"max {ordered[-1]:7.1f} ms"
    )


def browser_figures(url: str, chromium: str, refreshes: int) -> dict:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=chromium, headless=True, args=CHROMIUM_ARGS
        )
        page = browser.new_page(viewport={"width": 1280, "height": 860})
        page.goto(f"{url}/console/sign-in")
        page.get_by_test_id("login-password").fill(PASSWORD)
        page.get_by_test_id("login-submit").click()
        page.wait_for_url(f"{url}/console/")
        page.get_by_test_id("node-row").nth(0).wait_for()
        body = page.locator("body")
        first = page.evaluate("({...document.body.dataset})")
        rows = page.get_by_test_id("node-row").count()
        totals, renders = [], []
        seen = int(first["fleetRefreshes"])
        deadline = time.monotonic() + 10 * refreshes + 30
        while len(totals) < refreshes and time.monotonic() < deadline:
            time.sleep(0.25)
            data = page.evaluate("({...document.body.dataset})")
            if int(data["fleetRefreshes"]) > seen:
                seen = int(data["fleetRefreshes"])
                totals.append(float(data["fleetRefreshMs"]))
                renders.append(float(data["fleetRenderMs"]))
        bare = page.evaluate(
            """async () => {
              const times = [];
              for (let i = 0; i < 5; i++) {
                const t = performance.now();
                const r = await fetch("/api/v1/admin/hardware/nodes", {cache: "no-store"});
                await r.json();
                times.push(performance.now() - t);
              }
              return times;
            }"""
        )
        del body
        browser.close()
    return {"rows": rows, "first": first, "totals": totals, "renders": renders, "bare": bare}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--refreshes", type=int, default=4)
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()

    state = temp_state()
    env = modelforge_env(state)
    admin_token = json.loads(modelforge(env, "init", "--json"))["admin_token"]
    subprocess.run(
        [sys.executable, "-m", "modelforge_appliance.cli", "admin-password", "set"],
        input=PASSWORD + "\n", env=env, check=True, capture_output=True, text=True,
    )  # fmt: skip
    started = time.perf_counter()
    ids = populate(state, args.nodes)
    print(
        f"store: {args.nodes} nodes, 144,000 telemetry samples ({time.perf_counter() - started:.1f} s)"
    )

    port, process = start_modelforge(env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until_serving(port, process)
        url = f"http://127.0.0.1:{port}"
        admin = {"X-ModelForge-Admin-Token": admin_token}
        node = f"{url}/api/v1/admin/hardware/nodes/{ids[0]}"
        timed_get(f"{node}/telemetry", admin, 3)  # warm the page cache
        chart = timed_get(f"{node}/telemetry", admin, args.requests)
        healthz = timed_get(f"{url}/healthz", {}, args.requests)
        one = timed_get(node, admin, args.requests)
        with urllib.request.urlopen(
            urllib.request.Request(f"{node}/telemetry", headers=admin)
        ) as r:
            samples = sum(len(g["samples"]) for g in json.loads(r.read())["gpus"])
        print(
            f"\nchart endpoint ({samples} samples, 8 GPUs, one hour), {args.requests} requests each:"
        )
        print(describe("GET /healthz (floor)", healthz))
        print(describe("GET …/nodes/{id}", one))
        print(describe("GET …/nodes/{id}/telemetry", chart))
        print(
            f"ratio telemetry p50 / healthz p50: {statistics.median(chart) / statistics.median(healthz):.1f}"
        )

        figures = browser_figures(url, args.chromium, args.refreshes)
        first = figures["first"]
        print(f"\nHardware page, {figures['rows']} rows in Chromium:")
        print(f"navigation to every row drawn: {float(first['fleetRenderedAt']):7.0f} ms")
        print(
            f"first refresh (fetch + DOM):   {float(first['fleetRefreshMs']):7.0f} ms, of which DOM {float(first['fleetRenderMs']):.0f} ms"
        )
        for total, render in zip(figures["totals"], figures["renders"], strict=True):
            print(f"periodic refresh:              {total:7.0f} ms, of which DOM {render:.0f} ms")
        bare = statistics.median(figures["bare"])
        print(f"bare fetch + JSON parse (ref): {bare:7.0f} ms (median of 5)")
        if figures["totals"]:
            print(f"ratio refresh / bare fetch: {statistics.median(figures['totals']) / bare:.2f}")
    finally:
        process.terminate()
        process.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
