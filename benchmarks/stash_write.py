"""How the executor can write one stash item into a loop-carried arena, each way timed alone.

    python benchmarks/stash_write.py [--json]

A ``lax.scan`` of 22 ticks over a 20 MiB float32 arena (the arena of 1F1B P=4 M=8 save-all on the
tiny GPT of ``overhead.py --profile``), one CPU device. Every third tick writes a 5.1 MiB item at a
moving offset; the others write nothing. Ways:

- ``scatter``: the previous executor's write -- a zero-padded window out of a switch, then a scatter
  with one index per element (lanes past the item's length dropped);
- ``cond``: a dynamic-update-slice inside a two-way ``lax.cond`` whose other side returns the arena
  (what the executor does now);
- ``switch``: the same dynamic-update-slice inside a three-way ``lax.switch``.

Reported: milliseconds per 22 ticks (median of 10 runs) and the copies of the arena that XLA put in
the compiled program (the one outside the loop, which initialises the carry, included).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # its 8 virtual devices; no accelerator plugin tried
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ARENA, ITEM, TICKS = 5_242_880, 1_343_488, 22


def item(off):
    return jnp.full((ITEM,), 1.0) * off.astype(jnp.float32)


def scatter(arena, tick):
    kind, off = tick

    def forward(off):
        return item(off), jnp.int32(ITEM - 100)

    def other(off):
        return jnp.zeros((ITEM,)), jnp.int32(0)

    values, length = jax.lax.switch(kind, [forward, other, other], off)
    lanes = jnp.arange(ITEM, dtype=jnp.int32)
    index = jnp.where(lanes < length, off + lanes, ARENA)
    return arena.at[index].set(values, mode="drop", indices_are_sorted=True, unique_indices=True)


def cond(arena, tick):
    kind, off = tick
    return jax.lax.cond(kind == 0, lambda a: jax.lax.dynamic_update_slice(a, item(off), (off,)), lambda a: a, arena)


def switch(arena, tick):
    kind, off = tick
    write = lambda a: jax.lax.dynamic_update_slice(a, item(off), (off,))  # noqa: E731
    return jax.lax.switch(kind, [write, lambda a: a, lambda a: a], arena)


def measure(step, runs: int = 10) -> dict:
    @jax.jit
    def loop(arena, ticks):
        return jax.lax.scan(lambda a, t: (step(a, t), None), arena, ticks)[0]

    arena = jnp.zeros(ARENA)
    ticks = (jnp.arange(TICKS) % 3, (jnp.arange(TICKS) * ITEM // 3) % (ARENA - ITEM))
    compiled = loop.lower(arena, ticks).compile()
    copies = len(re.findall(rf"= f32\[{ARENA}\]\{{0\}} copy\(", compiled.as_text()))
    compiled(arena, ticks).block_until_ready()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        compiled(arena, ticks).block_until_ready()
        times.append(time.perf_counter() - start)
    return {"milliseconds": 1e3 * float(np.median(times)), "arena_copies": copies}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    record = {name: measure(fn) for name, fn in (("scatter", scatter), ("cond", cond), ("switch", switch))}
    if args.json:
        print(json.dumps(record, indent=2))
    else:
        for name, r in record.items():
            print(f"{name:8s} {r['milliseconds']:7.2f} ms per {TICKS} ticks, {r['arena_copies']} arena copies")
    return record


if __name__ == "__main__":
    main()
