"""The environment local workers start with (``runtime.worker_env``): threads of a waiting worker
sleep after a short spin, a CPU plan's workers keep the memory malloc frees, and a user's own
settings win. Expected values from glibc's and libgomp's documented variables."""

import os

import pytest

from runtime.worker_env import CPU_MALLOC, OMP_PASSIVE, OMP_SPIN, started_with

KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_")


@pytest.fixture
def clean(monkeypatch):
    for key in KEYS:
        monkeypatch.delenv(key, raising=False)


def test_workers_get_a_short_spin_then_sleep_and_the_env_is_restored(clean):
    with started_with(OMP_PASSIVE):
        assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE" and os.environ["GOMP_SPINCOUNT"] == OMP_SPIN == "10000"
    assert "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ


def test_a_cpu_plans_workers_never_mmap_nor_trim(clean):
    with started_with({**OMP_PASSIVE, **CPU_MALLOC}):
        assert os.environ["MALLOC_MMAP_MAX_"] == "0"
        assert os.environ["MALLOC_TRIM_THRESHOLD_"] == str(2 ** 40)  # 1 TiB: never reached
    assert not any(key in os.environ for key in KEYS)


def test_a_users_settings_win(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "65536")  # glibc's default back
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "")  # set, though empty: left as the user set it
    with started_with({**OMP_PASSIVE, **CPU_MALLOC}):
        assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE" and os.environ["GOMP_SPINCOUNT"] == "0"
        assert os.environ["MALLOC_MMAP_MAX_"] == "65536" and os.environ["MALLOC_TRIM_THRESHOLD_"] == ""
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE" and os.environ["MALLOC_MMAP_MAX_"] == "65536"


def test_the_local_launcher_gives_the_malloc_variables_to_cpu_plans_only():
    from runtime.launch import _worker_env

    assert _worker_env("cpu") == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000", "MALLOC_MMAP_MAX_": "0",
                                  "MALLOC_TRIM_THRESHOLD_": str(2 ** 40)}
    assert _worker_env("cuda") == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"}
