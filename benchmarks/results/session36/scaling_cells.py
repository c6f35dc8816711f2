"""Row 5's cells (time and FLOPs x4 per axis) from the thirty-sixth session's full runs:
`.venv/bin/python benchmarks/results/session36/scaling_cells.py` (readings a and b)."""
import re
from pathlib import Path

HERE = Path(__file__).parent
ROWS = ("seq_len x4", "n x4", "d x4", "d_model x4", "batch x4")
for reading, folder in (("a", HERE), ("b", HERE / "b")):
    for t in (1, 2):
        text = (folder / f"full_{t}t.md").read_text()
        parts = re.split(r"\*\*(training step|collapse sweep)[^*]*\*\*", text)
        cells = {}
        for kind, table in zip(parts[1::2], parts[2::2], strict=True):
            for line in table.splitlines():
                cols = [c.strip() for c in line.strip("|").split("|")]
                if cols and cols[0] in ROWS:
                    cells.setdefault(kind, []).append(f"{cols[0]} {cols[5]} (FLOPs {cols[6]})")
        for kind, got in cells.items():
            print(f"{reading} {t}t {kind}: " + "; ".join(got))
