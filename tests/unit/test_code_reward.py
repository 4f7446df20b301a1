"""The code reward's pure parts: how a program is taken out of a completion, how tests are
counted, the sandbox command (every limit on it, nothing of the host's but /usr), and how the
harness's report becomes a verdict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orbit_runtime.data.code_tasks import CodeTask
from orbit_runtime.errors import OrbitError
from orbit_runtime.rewards.code import count_tests, extract_program, program_for
from orbit_runtime.sandbox.bwrap import SandboxLimits, _verdict, bwrap_argv


def test_the_first_fenced_block_is_the_program_else_the_whole_text():
    completion = "Here it is:\n```python\ndef f():\n    return 1\n```\nand another\n```\nx = 2\n```"
    assert extract_program(completion) == "def f():\n    return 1\n"
    assert extract_program("```py\nprint(1)\n```") == "print(1)\n"
    assert extract_program("def f(): return 2") == "def f(): return 2"
    assert extract_program(completion, "text") == completion
    with pytest.raises(OrbitError, match="extract 'xml'"):
        extract_program("x", "xml")


def test_the_stub_goes_first_unless_the_program_defines_the_entry_point():
    task = CodeTask("assert add(1, 2) == 3", "add", "def add(a, b):\n")
    assert program_for("    return a + b\n", task) == "def add(a, b):\n    return a + b\n"  # HumanEval: the body
    whole = "```python\ndef add(a, b):\n    return a + b\n```"
    assert program_for(whole, task) == "def add(a, b):\n    return a + b\n"  # the whole function: no stub
    assert CodeTask.from_answer(task.to_answer()) == task
    with pytest.raises(OrbitError, match="not a code task"):
        CodeTask.from_answer("42")


def test_tests_are_statements_with_an_assert_that_calls_the_program():
    assert count_tests("import math\nassert f(1) == 1\nfor x in range(3):\n    assert f(x) >= 0\nassert True\n") == 2
    humaneval = ("METADATA = {}\n\ndef check(candidate):\n    assert candidate(1) == 2\n    y = 3\n"
                 "    assert candidate(y) == 4\n    assert True, 'constant'\n")  # fmt: skip
    assert count_tests(humaneval, "f") == 2  # `assert True` tests nothing
    with pytest.raises(OrbitError, match="name the entry point"):
        count_tests(humaneval)  # check(candidate) without an entry point would test nothing
    with pytest.raises(OrbitError, match="no assert that calls the program"):
        count_tests("print('no tests')\nassert 1 == 1\n")
    with pytest.raises(OrbitError, match="do not parse"):
        count_tests("assert (")


def test_only_the_names_the_tests_need_from_the_program_reach_it():
    """Builtins, the tests' own names and the stub's helpers are never the program's: a program
    that defines `abs` or `range` cannot change what the tests compute."""
    from orbit_runtime.sandbox.judge_harness import plan_tests

    tests = "import math\ndef helper(x):\n    return x\nassert abs(add(1, 2) - 3) < 1e-6\nfor i in range(2):\n    assert helper(add(i, 0)) == i\n"
    assert plan_tests(tests, None)[2] == {"add"}
    humaneval = "def check(candidate):\n    assert decode(encode('ab')) == 'ab'\n    assert candidate('x') == 'x'\n"
    stub = "def encode(s):\n    return s[::-1]\n\ndef decode(s):\n"  # stops inside decode, as a completion continues it
    assert plan_tests(humaneval, "decode", stub)[2] == {"candidate", "decode"}  # encode is the stub's, trusted


def test_the_sandbox_command_carries_every_limit_and_no_host_path_but_usr(tmp_path):
    limits = SandboxLimits(cpu_seconds=3, wall_seconds=7, memory_mb=256, processes=16, file_size_mb=4, tmp_mb=8)
    argv = bwrap_argv(tmp_path, limits, "/usr/bin/python3", None, info_fd=7)
    prlimit = argv[: argv.index("--")]
    assert prlimit == ["prlimit", "--cpu=3:4", f"--as={256 << 20}", f"--fsize={4 << 20}", "--core=0"]  # processes: inside
    bwrap = argv[argv.index("--") + 1 :]
    assert bwrap[0] == "bwrap" and {"--unshare-all", "--die-with-parent", "--as-pid-1", "--clearenv", "--new-session"} <= set(bwrap)
    assert "--share-net" not in bwrap
    binds = [(bwrap[i], bwrap[i + 1], bwrap[i + 2]) for i, a in enumerate(bwrap) if a in ("--bind", "--ro-bind")]
    assert ("--ro-bind", "/usr", "/usr") in binds and ("--ro-bind", str(tmp_path), "/judge") in binds
    assert all(kind == "--ro-bind" for kind, _, _ in binds)  # nothing of the host is writable
    assert {src for _, src, _ in binds} <= {"/usr", str(tmp_path), "/bin", "/lib", "/lib64", "/sbin"}
    tmpfs = [(bwrap[i - 1], bwrap[i + 1]) for i, a in enumerate(bwrap) if a == "--tmpfs"]
    assert tmpfs == [(str(1 << 20), "/dev/shm"), (str(8 << 20), "/tmp")]  # every tmpfs size-capped
    remounted = [bwrap[i + 1] for i, a in enumerate(bwrap) if a == "--remount-ro"]
    assert remounted == ["/dev", "/"] and "--proc" not in bwrap  # bwrap's own root tmpfs is read-only too
    assert bwrap[bwrap.index("--info-fd") + 1] == "7"
    # bwrap < 0.8 has no --size: then no writable tmpfs at all
    old = bwrap_argv(tmp_path, limits, "/usr/bin/python3", None, sized_tmpfs=False)
    assert "--tmpfs" not in old and "--size" not in old and old[old.index("--dir") + 1] == "/tmp"


def test_the_harness_report_becomes_a_verdict():
    lines = [{"total": 3}, {"test": 0, "passed": True}, {"test": 1, "passed": False}, {"test": 2, "passed": True}, {"status": "ok"}]
    verdict = _verdict("\n".join(json.dumps(x) for x in lines), "", False, 0, 0.1)
    assert verdict.as_json() == {"passed": 2, "total": 3, "reward": 2 / 3, "status": "ok"}
    # killed at the wall limit after one test: what passed counts
    partial = _verdict('{"total": 2}\n{"test": 0, "passed": true}\n', "", True, -9, 10.0)
    assert (partial.status, partial.reward) == ("timeout", 0.5)
    # bwrap never started: a sandbox error, never a wrong program
    broken = _verdict("", "bwrap: No permissions to creating new namespace", False, 1, 0.0)
    assert broken.status == "sandbox_error" and "namespace" in broken.detail
    # an unknown status is the sandbox's problem
    assert _verdict('{"total": 1}\n{"status": "lol"}\n', "", False, 0, 0.0).status == "sandbox_error"


def test_the_in_sandbox_scripts_use_the_standard_library_only():
    """The sandbox has no site-packages: the harness and runner import nothing else."""
    import ast
    import sys

    for name in ("judge_harness.py", "judge_runner.py"):
        tree = ast.parse((Path(__file__).parents[2] / "orbit_runtime" / "sandbox" / name).read_text())
        modules = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        modules |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert modules <= set(sys.stdlib_module_names), (name, modules - set(sys.stdlib_module_names))
