"""The playground's block-table chips (``static/kvtable.js``) show an entry of -1 (a block freed out
of the sliding window) as "freed", owning no cell; run under Node with a minimal DOM, when present."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

STATIC = Path(__file__).resolve().parents[2] / "services" / "frontend" / "static"

SCRIPT = """
globalThis.document = { createElement: () => ({ style: { setProperty() {} }, children: [],
  appendChild(c) { this.children.push(c); } }) };
require(%s);
const map = { lastSnapshot: { block_size: 4 }, palette: { color: () => "#123" },
  cellOf: (pool, block) => { if (block < 0) throw new Error("cell of a freed entry"); return { refCount: 1 }; } };
const wrap = KvTable.chips({ block_table: [-1, -1, 7, 9], num_tokens: 14, on_cpu: false, request_id: "r", choice: 0 }, map);
console.log(JSON.stringify(wrap.children.map((c) => [c.className, c.textContent])));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node")
def test_freed_entries_render_as_freed_chips():
    script = SCRIPT % json.dumps(str(STATIC / "kvtable.js"))
    out = subprocess.run(["node", "-e", script], capture_output=True, text=True, timeout=30, check=True).stdout
    assert json.loads(out) == [["kv-chip freed", "0\u2192freed"], ["kv-chip freed", "1\u2192freed"],
                               ["kv-chip", "2\u21927"], ["kv-chip partial", "3\u21929"]]
