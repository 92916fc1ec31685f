"""``kvrt bench elastic --part a``: each CUDA VMM call's cost per page, and the page supply latency of ``grow_to``.

Each driver call (cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap, cuMemRelease) is
timed alone through :class:`kvrt.memory.vmm.CudaDriver`, Python call overhead included;
then a tenant crosses ``--pages`` page boundaries with the next page mapped ahead, with
pages created ahead but not mapped, and cold. Also the percentile helpers and page
driver the other parts share.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

from kvrt.memory.elastic import ElasticPool

MiB = 1 << 20


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def summary_us(values_s: list[float]) -> dict[str, float]:
    us = [v * 1e6 for v in values_s]
    return {"n": len(us), "p50_us": pct(us, 50), "p99_us": pct(us, 99), "mean_us": statistics.fmean(us) if us else 0}


def page_driver(kind: str, page_bytes: int = 2 * MiB) -> Any:
    from kvrt.memory.vmm import CudaDriver, HostDriver

    # the trace never reads the KV: poisoning unmapped pages would only commit host memory
    return CudaDriver() if kind == "cuda" else HostDriver(page_bytes, poison=False)



def part_a(args: argparse.Namespace) -> dict[str, Any]:
    driver = page_driver(args.driver)
    page, n = driver.page_bytes, args.pages
    va = driver.reserve(n * page)
    times: dict[str, list[float]] = {k: [] for k in ("create", "map", "set_access", "unmap", "release")}
    handles = []
    for _ in range(n):
        t0 = time.perf_counter()
        handles.append(driver.create_page())
        times["create"].append(time.perf_counter() - t0)
    for i, handle in enumerate(handles):
        t0 = time.perf_counter()
        driver.map_page(va + i * page, handle)
        t1 = time.perf_counter()
        driver.set_access(va + i * page, page)
        t2 = time.perf_counter()
        times["map"].append(t1 - t0)
        times["set_access"].append(t2 - t1)
    for i in range(n):
        t0 = time.perf_counter()
        driver.unmap_page(va + i * page)
        times["unmap"].append(time.perf_counter() - t0)
    for handle in handles:
        t0 = time.perf_counter()
        driver.release_page(handle)
        times["release"].append(time.perf_counter() - t0)
    driver.free_reservation(va, n * page)
    per_call = {k: summary_us(v) for k, v in times.items()}

    def supply(ahead: int, idle: int) -> dict[str, float]:
        pool = ElasticPool(driver, map_ahead_stripes=ahead, idle_target_pages=idle, idle_max_pages=max(idle, 1))
        tenant = pool.add_tenant("grower", (n + ahead + 1) * page)
        pool.maintain()
        lat = []
        for k in range(1, n + 1):
            t0 = time.perf_counter()
            tenant.grow_to(k * page)
            lat.append(time.perf_counter() - t0)
            if ahead or idle:
                pool.maintain()  # the filler's work, between crossings and untimed
        shrink = []
        for k in range(n - 1, -1, -1):
            t0 = time.perf_counter()
            tenant.shrink_to(k * page)
            shrink.append(time.perf_counter() - t0)
        pool.close()
        return {**summary_us(lat), "shrink_p50_us": pct([s * 1e6 for s in shrink], 50),
                "shrink_p99_us": pct([s * 1e6 for s in shrink], 99)}

    result = {
        "page_bytes": page,
        "per_call": per_call,
        "supply": {
            "pre_mapped": supply(ahead=1, idle=0),
            "pre_created_not_mapped": supply(ahead=0, idle=n + 1),
            "cold": supply(ahead=0, idle=0),
        },
    }
    for name, row in per_call.items():
        print(f"  {name:>11}: p50 {row['p50_us']:8.1f} us  p99 {row['p99_us']:8.1f} us")
    for name, row in result["supply"].items():
        print(f"  supply {name:>22}: p50 {row['p50_us']:8.1f} us  p99 {row['p99_us']:8.1f} us")
    return result

