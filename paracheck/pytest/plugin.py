"""pytest plugin (entry point `paracheck`): the `--paracheck-backend` option and the `paracheck` marker."""

from __future__ import annotations


def pytest_addoption(parser):
    group = parser.getgroup("paracheck")
    group.addoption("--paracheck-backend", default=None,
                    help="backend for paracheck mixins: auto|gloo|nccl|neuron (default: the class's "
                         "paracheck_backend, else auto)")


def pytest_configure(config):
    config.addinivalue_line("markers", "paracheck: a paracheck parallel-parity test (launches a world of ranks)")


def pytest_generate_tests(metafunc):
    from paracheck.pytest.mixin import generate

    generate(metafunc)
