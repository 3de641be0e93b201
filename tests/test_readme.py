"""Every Python snippet of README.md and docs/*.md runs as written, each in a fresh interpreter.

A snippet that joins a process group (it says it is launched by torchrun) gets what torchrun would
set for a one-process job: RANK, WORLD_SIZE, MASTER_ADDR and a free MASTER_PORT; one that joins a
fault-tolerant run (it reads MTDAO_LIGHTHOUSE) gets a lighthouse there. Nothing else is
substituted; the README keeps its sizes small so that this stays fast. A snippet launched with
several processes (``--nproc-per-node N``) runs in N processes in tests/test_sharded_train.py.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from wait_limits import limit_s

from mtdao.testing.ports import unused_port

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
# a snippet shown on two pages word for word (the README's loop is also docs/library.md's) runs once
SNIPPETS = list(
    dict.fromkeys(
        snippet
        for page in DOCS
        for snippet in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL)
    )
)
ONE_PROCESS_SNIPPETS = [s for s in SNIPPETS if "--nproc-per-node" not in s]
# the costliest snippet took 10.2 core-seconds (importing lightning, 32 steps; the others 3.5 -
# 9.9), a start and a third of wait_limits' measure: two starts bound each
SNIPPET_S = limit_s(starts=2)


@contextlib.contextmanager
def lighthouse():
    """A torchft lighthouse in this process for one replica; yields its host:port."""
    pytest.importorskip("torchft")
    from mtdao import ft as torchft

    server = torchft.start_lighthouse("127.0.0.1:0", 1, join_timeout=1.0, heartbeat_timeout=1.0)
    try:
        yield server.address().split("://")[-1]
    finally:
        server.shutdown()


def test_the_readme_has_python_snippets():
    assert re.search(r"```python\n", README.read_text())  # the plain PyTorch loop
    assert len(SNIPPETS) >= 4  # with docs/library.md's


@pytest.mark.slow  # a fresh interpreter each, importing torch: the file starts early
@pytest.mark.parametrize(
    "snippet", ONE_PROCESS_SNIPPETS, ids=[f"snippet{i}" for i in range(len(ONE_PROCESS_SNIPPETS))]
)
def test_readme_snippet_runs_as_written(snippet, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if "init_process_group" in snippet:
        env.update(
            RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(unused_port())
        )
    with contextlib.ExitStack() as stack:
        if "MTDAO_LIGHTHOUSE" in snippet:
            env["MTDAO_LIGHTHOUSE"] = stack.enter_context(lighthouse())
        done = subprocess.run(
            [sys.executable, "-c", snippet],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=SNIPPET_S,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    if "sync.traffic" in snippet:
        assert "sent per worker" in done.stdout, done.stdout


def test_the_docs_give_the_quickstart_the_readmes_final_loss():
    """docs/training.md's account of the quickstart's curves starts from the README's figure."""
    stated = re.search(r"ends near validation loss (\d\.\d+)", README.read_text())
    training = (ROOT / "docs" / "training.md").read_text()
    explained = re.search(r"the quickstart the validation loss ends near\s+(\d\.\d+)", training)
    assert stated and explained
    assert explained.group(1) == stated.group(1)


def test_every_install_of_mtdao_pins_through_the_constraints():
    """An install from the clone the docs and examples show takes constraints.txt's versions."""
    pages = [*DOCS, *sorted((ROOT / "examples").glob("*.py"))]
    installs = [
        (page.name, line.strip())
        for page in pages
        for line in page.read_text().splitlines()
        if re.search(r"pip install .*-e ", line)
    ]
    assert installs
    assert [found for found in installs if "-c constraints.txt" not in found[1]] == []


def test_the_train_helps_fault_tolerant_example_restarts_with_the_same_line():
    from mtdao.train.command import EXAMPLES

    (line,) = [line for line in EXAMPLES.splitlines() if "--fault-tolerant" in line]
    assert "--resume" in line.split()


def test_the_fault_tolerant_loop_is_started_alike_in_the_example_and_the_docs():
    """examples/fault_tolerant_loop.py's usage and docs/library.md start the lighthouse with the
    same --min-replicas, and both show where the run's secret goes."""
    usage = (ROOT / "examples" / "fault_tolerant_loop.py").read_text().split('"""')[1]
    library = " ".join((ROOT / "docs" / "library.md").read_text().split())
    section = library.split("## Fault-tolerant replicas in your own loop")[1].split("```")[0]
    lighthouse = re.compile(r"mtdao lighthouse [^`&\n]*")
    (in_usage,) = lighthouse.findall(usage)
    (in_docs,) = lighthouse.findall(section)
    for shown in (in_usage, in_docs):
        assert "--min-replicas 3" in shown and "--auth-token-file run.token" in shown, shown
    assert "--auth-token-file run.token" in usage.split("fault_tolerant_loop.py", 1)[1]
    assert 'auth_token_file="run.token"' in section
