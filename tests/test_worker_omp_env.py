"""The OpenMP settings local workers start with (``runtime.launch``): threads of a waiting worker
sleep after a short spin, and a user's own settings win."""

import os

from runtime.launch import OMP_SPIN, _passive_omp


def test_workers_get_a_short_spin_then_sleep_and_the_env_is_restored(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    with _passive_omp():
        assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE" and os.environ["GOMP_SPINCOUNT"] == OMP_SPIN == "10000"
    assert "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ


def test_a_users_omp_settings_win(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    with _passive_omp():
        assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE" and os.environ["GOMP_SPINCOUNT"] == "0"
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE" and os.environ["GOMP_SPINCOUNT"] == "0"
