import argparse
import json
import shutil
from pathlib import Path

import pytest

from mooncaked.bench import store


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_tiny_bench_store_run_writes_every_figure(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    store.add_arguments(parser)
    out = tmp_path / "store.json"
    args = parser.parse_args(["--num-objects", "16", "--sizes", "65536", "--clients", "1",
                              "--batch-bytes", "262144", "--json", str(out)])
    assert store.run(args) == 0  # nonzero when any object read back had the wrong tag
    result = json.loads(out.read_text())["65536"]
    for name in ("store_get_gbps", "store_put_gbps", "shm_get_gbps", "shm_put_gbps", "redis_get_gbps",
                 "redis_put_gbps", "get_ratio", "put_ratio", "shm_get_ratio", "shm_put_ratio"):
        assert result[name] > 0, name
