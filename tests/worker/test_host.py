import torch

from worker import host


def test_tune_malloc_is_idempotent():
    first = host.tune_malloc()
    assert host.tune_malloc() == first
    assert isinstance(first, bool)


def test_set_threads_only_when_asked():
    before = torch.get_num_threads()
    host.set_threads(None)
    assert torch.get_num_threads() == before
    host.set_threads(1)
    assert torch.get_num_threads() == 1
    host.set_threads(before)
    assert torch.get_num_threads() == before


def test_omp_binding_is_recognised_only_when_set():
    assert not host.omp_is_bound({})
    assert not host.omp_is_bound({"OMP_PROC_BIND": "false"})
    assert host.omp_is_bound(dict(host.OMP_BINDING))
    assert host.omp_is_bound({"OMP_PROC_BIND": "spread"})

