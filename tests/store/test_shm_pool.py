import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mooncaked.store.shm_pool import PoolFileRefused, ShmPool, pool_path


def test_pool_path_sanitises_names() -> None:
    assert pool_path("c/1", "store 0", "/dev/shm") == "/dev/shm/mooncaked-c_1-store_0"


def test_attached_mapping_sees_the_same_bytes_and_owner_unlinks(tmp_path: Path) -> None:
    path = str(tmp_path / "pool")
    pool = ShmPool.create(path, 1 << 20)
    worker = ShmPool.attach(path)
    pool.write(4096, b"hello")
    assert worker.read(4096, 5) == b"hello"
    target = np.zeros(3, dtype=np.uint8)
    worker.write(8192, np.array([1, 2, 3], dtype=np.uint8))
    pool.read_into(8192, target)
    assert target.tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="outside the pool"):
        worker.write((1 << 20) - 2, b"abc")
    worker.close()
    assert os.path.exists(path)
    pool.close()
    assert not os.path.exists(path)


def test_another_process_writes_through_its_own_mapping(tmp_path: Path) -> None:
    path = str(tmp_path / "pool")
    pool = ShmPool.create(path, 1 << 16)
    script = (
        "import sys; from mooncaked.store.shm_pool import ShmPool; "
        "p = ShmPool.attach(sys.argv[1]); p.write(100, b'from-child'); p.close()"
    )
    subprocess.run([sys.executable, "-c", script, path], check=True, timeout=60)
    assert pool.read(100, 10) == b"from-child"
    pool.close()


def test_attach_to_missing_pool_says_what_to_check(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="is the store on this host running"):
        ShmPool.attach(str(tmp_path / "absent"))


def test_attach_refuses_a_link_a_non_regular_file_and_a_wrong_size(tmp_path: Path) -> None:
    pool = ShmPool.create(str(tmp_path / "pool"), 8192)
    try:
        os.symlink(tmp_path / "pool", tmp_path / "link")
        with pytest.raises(PoolFileRefused, match="symbolic link"):
            ShmPool.attach(str(tmp_path / "link"))
        os.mkfifo(tmp_path / "fifo")
        with pytest.raises(PoolFileRefused, match="not a regular file"):
            ShmPool.attach(str(tmp_path / "fifo"))
        with pytest.raises(PoolFileRefused, match="8192 bytes, the store reports 4096"):
            ShmPool.attach(str(tmp_path / "pool"), expected_bytes=4096)
        attached = ShmPool.attach(str(tmp_path / "pool"), expected_bytes=8192)
        attached.close()
    finally:
        pool.close()
