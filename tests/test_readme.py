"""Every Python snippet of README.md and docs/*.md runs as written, each in a fresh process.

A snippet that joins a process group (it says it is launched by torchrun) gets what torchrun would
set for a one-process job: RANK, WORLD_SIZE, MASTER_ADDR and a free MASTER_PORT; one that joins a
fault-tolerant run (it reads MTDAO_LIGHTHOUSE) gets a lighthouse there. Nothing else is
substituted; the README keeps its sizes small so that this stays fast. A snippet launched with
several processes (``--nproc-per-node N``) runs in N processes in tests/test_sharded_train.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
from sessions import killed_at_exit
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
# the costliest snippet took 10.2 core-seconds in a process of its own (importing lightning, 32
# steps; the others 3.5 - 9.9), a start and a third of wait_limits' measure: two starts bound each
SNIPPET_S = limit_s(starts=2)
FORKED_SOURCES = Path(__file__).with_name("forked_sources.py")
# imported once for all the snippets: torch (each imports it) and the Trainer (two do)
PRELOAD = ("torch", "transformers.trainer")
PRELOAD_S = limit_s(starts=2)  # 9 core-seconds, little more than a start


@contextlib.contextmanager
def lighthouse():
    """A torchft lighthouse in this process for one replica; yields its host:port."""
    from mtdao import ft as torchft

    server = torchft.start_lighthouse("127.0.0.1:0", 1, join_timeout=1.0, heartbeat_timeout=1.0)
    try:
        yield server.address().split("://")[-1]
    finally:
        server.shutdown()


def test_the_readme_has_python_snippets():
    assert re.search(r"```python\n", README.read_text())  # the plain PyTorch loop
    assert len(SNIPPETS) >= 4  # with docs/library.md's


def snippet_job(snippet: str, folder: Path) -> dict:
    """tests/forked_sources.py's job for ``snippet``: run in ``folder``/run, output beside it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if "init_process_group" in snippet:
        port = str(unused_port())
        env.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    (folder / "run").mkdir(parents=True)
    return dict(
        source=snippet, cwd=str(folder / "run"), env=env, out=str(folder), timeout_s=SNIPPET_S
    )


@pytest.fixture(scope="module")
def snippet_runs(tmp_path_factory) -> list[dict | None]:
    """Each one-process snippet's exit status, stdout and stderr (None: torchft, which it
    needs, is not installed). They run one after the other, each in a process of its own forked
    from one interpreter that imported torch and the Trainer first: a fresh start, as with
    ``python -c``, without paying for those imports seven times."""
    root = tmp_path_factory.mktemp("snippets")
    jobs = [snippet_job(s, root / f"snippet{i}") for i, s in enumerate(ONE_PROCESS_SNIPPETS)]
    with contextlib.ExitStack() as stack:
        for job in list(jobs):
            if "MTDAO_LIGHTHOUSE" not in job["source"]:
                continue
            if find_spec("torchft") is None:
                jobs.remove(job)
            else:
                job["env"]["MTDAO_LIGHTHOUSE"] = stack.enter_context(lighthouse())
        (root / "jobs.json").write_text(json.dumps(jobs))
        runner = subprocess.Popen(
            [sys.executable, str(FORKED_SOURCES), str(root / "jobs.json"), *PRELOAD],
            cwd=root,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # the snippets' processes are in its group, killed with it
        )
        with killed_at_exit(runner):
            output = runner.communicate(timeout=PRELOAD_S + SNIPPET_S * len(jobs))[0]
    assert runner.returncode == 0, output[-3000:]
    ran = {job["source"]: Path(job["out"]) for job in jobs}
    return [
        {name: (ran[s] / name).read_text() for name in ("status", "stdout", "stderr")}
        if s in ran
        else None
        for s in ONE_PROCESS_SNIPPETS
    ]


@pytest.mark.slow  # the snippets' processes: the file starts early
@pytest.mark.parametrize(
    "index",
    range(len(ONE_PROCESS_SNIPPETS)),
    ids=[f"snippet{i}" for i in range(len(ONE_PROCESS_SNIPPETS))],
)
def test_readme_snippet_runs_as_written(index, snippet_runs):
    done = snippet_runs[index]
    if done is None:
        pytest.skip("needs torchft (the ft extra)")
    assert done["status"] == "0", done["stderr"][-3000:]
    if "sync.traffic" in ONE_PROCESS_SNIPPETS[index]:
        assert "sent per worker" in done["stdout"], done["stdout"]


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
