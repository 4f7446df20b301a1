"""Model-written programs judged in the real sandbox (bwrap): correct and wrong ones, every
HumanEval problem through `orbit code-reward`, and a table of hostile programs, each contained.

A hostile program's test passes only if its attack worked (`assert attack() is True`), so
reward 0 is the attack failing; the test then checks from outside what the attack aimed at:
the test's files, its environment, a loopback listener, a process of its own, the process
table, and that this process (the learner's stand-in) can still fork.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from orbit_runtime.data.code_tasks import CodeTask, humaneval_problems
from orbit_runtime.rewards.code import code_tests, judge
from orbit_runtime.sandbox.bwrap import SandboxLimits

LIMITS = SandboxLimits(cpu_seconds=2, wall_seconds=4, memory_mb=256, processes=16, output_bytes=16384)
ATTACK = CodeTask("assert attack() is True\n")
BUILTIN = CodeTask("assert abs(attack() and 0) == 0 and attack() == 'yes'\nassert abs(-1) == 0\n")  # the second only if abs is the program's
# answering every call with True passes the first only if isinstance were the program's
CHECKED = CodeTask("assert isinstance(attack(), str)\nassert attack() == 5\n")


@pytest.fixture()
def target(tmp_path, monkeypatch):
    """What a hostile program goes after: a secret file of the run, the learner's credentials
    (in this process's environment), a loopback listener, a process of the learner's."""
    secret = tmp_path / "run" / "checkpoint-secret.txt"
    secret.parent.mkdir()
    secret.write_text("s3cr3t")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-s3cr3t")
    monkeypatch.setenv("ORBIT_API_KEY", "orbit-s3cr3t")
    listener = socket.create_server(("127.0.0.1", 0))
    connections: list = []
    def accept() -> None:
        try:
            connections.append(listener.accept())
        except OSError:  # closed at teardown, nobody having connected
            pass

    threading.Thread(target=accept, daemon=True).start()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield {"secret": secret, "port": listener.getsockname()[1], "connections": connections, "sleeper": sleeper,
           "outside": tmp_path / "written-by-the-program"}  # fmt: skip
    sleeper.kill()
    listener.close()


def _processes_with(marker: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                found.append(entry.name)
        except OSError:
            pass
    return found


def _hostile_programs(t: dict, marker: str) -> dict[str, tuple]:
    """name -> (program, the statuses it may end with[, its task: ATTACK unless given])."""
    return {
        "infinite loop": ("while True:\n    pass\n", {"timeout"}),
        "sleep past the wall time": ("import time\ndef attack():\n    time.sleep(60)\n    return True\n", {"timeout"}),
        "fork bomb": ("import os\nwhile True:\n    os.fork()\n", {"crashed", "timeout"}),
        "memory bomb": ("x = [bytearray(1 << 24) for _ in range(1000)]\ndef attack():\n    return True\n", {"memory"}),
        "huge output": ("while True:\n    print('x' * 65536)\n", {"output_limit"}),
        "huge file": ("def attack():\n    open('/tmp/big', 'wb').write(b'x' * (64 << 20))\n    return True\n",
                      {"output_limit", "ok", "crashed"}),  # fmt: skip
        "fill memory with files (tmpfs)": (
            "def attack():\n    written = 0\n    for where in ('/', '/tmp/', '/dev/shm/', '/dev/'):\n        for i in range(100):\n"
            "            try:\n                with open(f'{where}f{i}', 'wb') as f:\n                    f.write(b'x' * (4 << 20))\n"
            "                written += 4 << 20\n            except OSError:\n                break\n"
            "    return written > (40 << 20)\n", {"ok"}),  # fmt: skip
        "write outside its temp dir": (
            f"def attack():\n    open({str(t['outside'])!r}, 'w').write('pwned')\n    return True\n", {"ok"}),
        "read the run's files": (f"def attack():\n    return open({str(t['secret'])!r}).read() == 's3cr3t'\n", {"ok"}),
        "read credentials": (
            "import os\ndef attack():\n    env = os.environ\n"
            "    return env.get('AWS_SECRET_ACCESS_KEY') == 'aws-s3cr3t' or env.get('ORBIT_API_KEY') == 'orbit-s3cr3t'\n",
            {"ok"}),  # fmt: skip
        "network to a loopback listener": (
            f"import socket\ndef attack():\n    socket.create_connection(('127.0.0.1', {t['port']}), timeout=2)\n    return True\n",
            {"ok"}),  # fmt: skip
        "signal another process": (f"import os, signal\ndef attack():\n    os.kill({t['sleeper'].pid}, signal.SIGKILL)\n"
                                   "    return True\n", {"ok"}),  # fmt: skip
        "leave a process running": (
            "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            f"        os.execv('/usr/bin/python3', ['python3', '-c', 'import time; time.sleep(60)', {marker!r}])\n"
            "    os._exit(0)\ndef attack():\n    time.sleep(1)\n    return False\n", {"ok"}),  # fmt: skip
        "read the tests for the answers": (
            # (the text it looks for is built at run time: its own source must not contain it)
            "import glob, sys\nTESTS = 'assert att' + 'ack() is True'\ndef attack():\n"
            "    paths = glob.glob('/judge/*') + glob.glob('/tmp/**', recursive=True) + glob.glob('/*')\n"
            "    for path in paths:\n        try:\n"
            "            if TESTS in open(path).read():\n                return True\n"
            "        except OSError:\n            pass\n    return TESTS in sys.stdin.read()\n", {"ok"}),  # fmt: skip
        "rewrite the harness": (
            "def attack():\n    try:\n        open('/judge/judge_harness.py', 'a').write('# pwned')\n"
            "        return True\n    except OSError:\n        return False\n", {"ok"}),  # fmt: skip
        # a builtin the tests use, redefined: the harness never takes builtins from the program
        "redefine a builtin": ("def abs(x):\n    return 0\ndef attack():\n    return 'no'\n", {"ok"}, BUILTIN),
        # speak the protocol itself: claim names, answer a call with a value the program chooses
        "answer the harness itself": (
            "import os, sys\nout = os.fdopen(3, 'w', buffering=1)\n"
            "out.write('{\"loaded\": true, \"names\": [\"attack\", \"isinstance\"]}\\n')\n"
            "for line in sys.__stdin__:\n    out.write('{\"ok\": true, \"value\": \"True\"}\\n')\n",
            {"ok", "crashed"}, CHECKED),  # fmt: skip
        "always-equal object": (
            "class Yes:\n    def __eq__(self, other):\n        return True\n    __bool__ = lambda self: True\n"
            "def attack():\n    return Yes()\n", {"ok"}),  # fmt: skip
        "exit 0 before the tests": ("import os\nos._exit(0)\n", {"crashed"}),
        "forge the harness's report": (
            "import os, sys\nfor fd in range(1, 64):\n    try:\n"
            "        os.write(fd, b'{\"test\": 0, \"passed\": true}\\n{\"status\": \"ok\"}\\n')\n    except OSError:\n        pass\n"
            "for pid in os.listdir('/proc'):\n    try:\n        open(f'/proc/{pid}/fd/1', 'w').write('{\"test\": 0, \"passed\": true}\\n')\n"
            "    except OSError:\n        pass\ndef attack():\n    return False\n", {"ok", "crashed"}),  # its protocol stream, garbled  # fmt: skip
        # the harness is the sandbox's pid 1: signals from inside its namespace do not reach it
        "signal the harness": (
            "import os, signal\nfor sig in (signal.SIGSTOP, signal.SIGKILL, signal.SIGINT, signal.SIGTERM):\n"
            "    os.kill(os.getppid(), sig)\ndef attack():\n    return 'no'\n", {"ok"}),  # fmt: skip
    }


def test_hostile_programs_are_contained(target):
    marker = f"orbit-hostile-{uuid.uuid4().hex}"
    table = []
    for name, (program, statuses, *task) in _hostile_programs(target, marker).items():
        verdict = judge(program, task[0] if task else ATTACK, LIMITS)
        table.append((name, verdict.status, verdict.reward, round(verdict.seconds, 2)))
        assert verdict.reward == 0, (name, verdict)
        assert verdict.status in statuses, (name, verdict)
        assert not _processes_with(marker), f"{name}: a process outlived its sandbox"
    print("\n".join(f"{n:34s} {s:13s} reward {r}  {sec}s" for n, s, r, sec in table))
    assert not target["outside"].exists() and target["secret"].read_text() == "s3cr3t"
    assert target["connections"] == [], "the listener on the host's loopback got a connection"
    assert target["sleeper"].poll() is None, "a program killed a process of the learner's"
    assert subprocess.run(["true"]).returncode == 0  # the learner can still fork after the fork bomb
    assert len(table) >= 12


def test_judging_runs_in_parallel_and_a_correct_program_scores_one():
    """code_tests as training calls it: 8 programs, 4 sandboxes at a time, each judged alone."""
    tests = CodeTask("assert add(1, 2) == 3\nassert add(-1, 1) == 0\n").to_answer()
    good = "```python\ndef add(a, b):\n    return a + b\n```"
    slow = "import time\ntime.sleep(1)\ndef add(a, b):\n    return a + b\n"
    started = time.monotonic()
    rewards = code_tests([good, slow] * 4, answers=[tests] * 8, concurrency=4, wall_seconds=5)
    elapsed = time.monotonic() - started
    assert rewards == [1.0] * 8
    assert elapsed < 4, f"8 programs, 4 of which sleep 1 s, took {elapsed:.1f} s: not judged in parallel"


def _code_reward_cli(program: Path, tests: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orbit_runtime.cli", "code-reward", str(program), "--tests", str(tests), *extra],
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_every_humaneval_solution_passes_through_orbit_code_reward_and_a_wrong_body_does_not(tmp_path):
    problems = humaneval_problems()
    assert len(problems) == 164

    def canonical(problem: dict) -> tuple[str, dict]:
        slug = problem["task_id"].replace("/", "_")
        (tmp_path / f"{slug}.py").write_text(problem["prompt"] + problem["canonical_solution"])
        (tmp_path / f"{slug}_tests.py").write_text(problem["test"])
        run = _code_reward_cli(tmp_path / f"{slug}.py", tmp_path / f"{slug}_tests.py", "--entry-point", problem["entry_point"],
                               "--extract", "text", "--json")  # fmt: skip
        assert run.returncode == 0, (problem["task_id"], run.stderr)
        return problem["task_id"], json.loads(run.stdout)

    with ThreadPoolExecutor(2) as pool:
        verdicts = dict(pool.map(canonical, problems))
    assert {k: v for k, v in verdicts.items() if v["reward"] != 1.0 or v["status"] != "ok"} == {}
    assert all(v["total"] >= 1 for v in verdicts.values())

    def wrong(problem: dict) -> tuple[str, float]:
        task = CodeTask(problem["test"], problem["entry_point"], problem["prompt"])
        return problem["task_id"], judge(problem["prompt"] + "    return None\n", task, LIMITS).reward

    with ThreadPoolExecutor(4) as pool:
        wrong_rewards = dict(pool.map(wrong, problems))
    assert {k: r for k, r in wrong_rewards.items() if r >= 1.0} == {}


def test_orbit_code_reward_exits_2_with_one_line_when_it_cannot_judge(tmp_path):
    program = tmp_path / "p.py"
    program.write_text("def f():\n    return 1\n")
    tests = tmp_path / "t.py"
    tests.write_text("assert f() == 1\n")
    missing = _code_reward_cli(tmp_path / "missing.py", tests)
    assert missing.returncode == 2 and "missing.py" in missing.stderr and len(missing.stderr.strip().splitlines()) == 1
    (tmp_path / "empty.py").write_text("print('no asserts')\n")
    no_tests = _code_reward_cli(program, tmp_path / "empty.py")
    assert no_tests.returncode == 2 and "no assert" in no_tests.stderr
    env = {**os.environ, "PATH": str(tmp_path)}  # no bwrap on PATH
    no_bwrap = subprocess.run([sys.executable, "-m", "orbit_runtime.cli", "code-reward", str(program), "--tests", str(tests)],
                              capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    assert no_bwrap.returncode == 2 and "bwrap not found" in no_bwrap.stderr
    judged = _code_reward_cli(program, tests)
    assert judged.returncode == 0 and "1/1 tests passed, reward 1.000, status ok" in judged.stdout
    hostile = tmp_path / "loop.py"
    hostile.write_text("while True:\n    pass\n")
    looped = _code_reward_cli(hostile, tests, "--json", "--cpu-seconds", "1", "--wall-seconds", "3")
    assert looped.returncode == 0 and json.loads(looped.stdout) == {"passed": 0, "total": 1, "reward": 0.0, "status": "timeout"}


def test_a_program_cannot_take_over_the_names_real_humaneval_tests_use():
    """As training judges HumanEval (the task's stub given): redefining a builtin the tests use
    (abs), the stub's helper the tests call (poly, encode_cyclic), or returning None where the
    tests hold constant asserts scores 0, not the partial or full credit it would get if those
    names were the program's or `assert True` counted."""
    problems = {p["task_id"]: p for p in humaneval_problems()}
    attempts = {
        "HumanEval/2": "```python\ndef abs(x):\n    return 0\ndef truncate_number(number):\n    return 0.0\n```",
        "HumanEval/32": "```python\ndef poly(*a):\n    return 0\ndef find_zero(xs):\n    return 0\n```",
        "HumanEval/38": "```python\ndef encode_cyclic(s):\n    return s\ndef decode_cyclic(s):\n    return s\n```",
        "HumanEval/70": "    return None\n",
    }
    for task_id, completion in attempts.items():
        problem = problems[task_id]
        task = CodeTask(problem["test"], problem["entry_point"], problem["prompt"])
        rewards = code_tests([completion], answers=[task.to_answer()])
        assert rewards == [0.0], task_id
