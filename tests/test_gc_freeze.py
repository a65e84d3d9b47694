"""``freeze_startup_heap`` (called once the API process and the engine core are ready): what start-up made leaves
the collector's generations, so full collections stop walking it; ``STRATA_GC_FREEZE=0`` turns it off. Run in a
fresh interpreter: freezing this test process would keep its garbage cycles forever."""
from __future__ import annotations

import os
import subprocess
import sys

PROBE = """
import gc, json
import strataserve.api.server  # the API process's imports: FastAPI, pydantic, the router
from strataserve.startup import freeze_startup_heap
young = len(gc.get_objects())
frozen = freeze_startup_heap()
junk = [[i] for i in range(1000)]  # made after the freeze: tracked as usual
print(json.dumps({"young": young, "frozen": frozen, "count": gc.get_freeze_count(), "left": len(gc.get_objects())}))
"""


def _probe(**env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True)
    import json

    return json.loads(out.stdout.strip().splitlines()[-1])


def test_start_up_objects_leave_the_generations():
    r = _probe()
    assert r["frozen"] == r["count"] > 0.5 * r["young"] > 10_000  # tens of thousands of objects from imports alone
    assert 1000 <= r["left"] < 0.1 * r["young"]  # a full collection walks what came after, not the imports


def test_switch_off():
    r = _probe(STRATA_GC_FREEZE="0")
    assert r["frozen"] == r["count"] == 0 and r["left"] >= r["young"]
