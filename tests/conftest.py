"""Fixtures shared by the tests: one copy each."""

import inspect
import os
from pathlib import Path

# Before torch is imported: the tests and every mtdao process they start run one thread unless
# told otherwise, so results do not depend on the machine's load (mtdao train picks one thread
# on a busy machine, and says so, when OMP_NUM_THREADS is unset or empty).
if not os.environ.get("OMP_NUM_THREADS"):
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

# Small, real, human-written text: a few standard-library modules' source (~200 KB).
CORPUS_MODULES = ("argparse", "textwrap", "csv", "json.decoder", "json.encoder", "string")


def pytest_collection_modifyitems(config, items) -> None:
    """Files with slow tests first, the rest in their order: the two processes share out the
    long files (most wait on subprocesses) while the many quick ones fill the gaps, instead of
    one process running a long file alone at the end. xdist keeps this order only with
    --no-loadscope-reorder (addopts); by default it sorts files by their number of tests."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


@pytest.fixture(scope="session", autouse=True)
def cpp_kernels() -> None:
    """Build the C++ optimizer and codec kernels (once per machine) before any test, so that no
    test's subprocess, with its timeout, is the one that pays for a build. Each kernel's build
    holds a lock of its own: the second of two processes takes the kernels in the other order, so
    on a cold cache they build both at once instead of one after the other."""
    from mtdao.native_build import native_library
    from mtdao.sync.codecs import native_codecs
    from mtdao.sync.codecs.quantize import Codec

    builds = [native_library, lambda: native_codecs.usable(Codec)]
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") == "gw1":
        builds.reverse()
    for build in builds:
        build()


@pytest.fixture(scope="module")
def one_thread():
    """Small problems are fastest single-threaded: a second intra-op thread only adds
    synchronization, and on a busy machine it turns milliseconds into seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def no_plot():
    """Runs in this module draw no loss.png: matplotlib's layout is half of a tiny run's CPU, and
    these tests never look at the plot (test_train_plots.py and test_train_cli.py do)."""
    from mtdao.train import plots

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plots, "plot_run", lambda run_dir, reference=None: None)
        yield


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    """A directory of text files the harness can train on in a fraction of a second."""
    root = tmp_path_factory.mktemp("corpus")
    for name in CORPUS_MODULES:
        module = __import__(name, fromlist=["_"])
        (root / f"{name}.py").write_text(inspect.getsource(module))
    return root
