"""What a benchmark command leaves behind: its table on stdout and, with `--json FILE`, its result as JSON.

1. A command measures and builds its result: a dict of plain values (numbers, strings, lists, dicts).
2. `report(result, table, json_path)` prints the command's table and writes the result to `json_path` when one
   was asked for; a command that prints its lines as it goes calls `write_json` alone.
3. The JSON file is indented by 2 and ends with a newline; a value JSON has no form for is written as its str.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: str | Path, result: Any) -> None:
    Path(path).write_text(json.dumps(result, indent=2, default=str) + "\n")


def report(result: Any, table: str, json_path: str | Path | None) -> None:
    """Print `table`; write `result` to `json_path` (None or "": no file)."""
    print(table)
    if json_path:
        write_json(json_path, result)
