"""Running model-written programs: a bubblewrap sandbox (`bwrap.py`) around a judge that keeps
the program in a process of its own (`judge_harness.py`, `judge_runner.py`)."""
