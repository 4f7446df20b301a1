"""Inside the sandbox, untrusted: run the model's program, then answer the judge's calls.

Standard library only (the sandbox has no site-packages). Started by `judge_harness.py` as
its own process; everything here is under the program's control once it has run, so nothing
here decides a test: the harness, another process, evaluates every assert on plain values
(`ast.literal_eval` of what this process answers). The program's prints go to stderr, which
the harness caps.

Protocol, one JSON object per line on the original stdout:
  -> {"loaded": true, "names": [...]}  |  {"loaded": false, "error": "SyntaxError", "detail": "..."}
  <- {"call": NAME, "args": "<repr of a tuple>"}
  -> {"ok": true, "value": "<repr>"}   |  {"ok": false, "error": "TypeName"}
"""

import ast
import json
import os
import sys

PROGRAM = "/judge/program.py"
MAX_REPLY = 1 << 20  # a value whose repr is larger than this is refused (the harness's output cap)


def main() -> None:
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    requests = sys.stdin
    os.dup2(2, 1)  # the program's stdout joins its stderr: neither can reach the protocol stream by accident
    sys.stdout = sys.stderr
    sys.stdin = open(os.devnull)  # the program reads nothing; a call to input() gets EOF
    with open(PROGRAM) as source:
        text = source.read()
    try:
        code = compile(text, "program.py", "exec")
    except (SyntaxError, ValueError) as exc:  # ValueError: null bytes
        replies.write(json.dumps({"loaded": False, "error": "SyntaxError", "detail": str(exc)[:500]}) + "\n")
        return
    namespace = {"__name__": "program", "__builtins__": __builtins__}
    try:
        exec(code, namespace)
    except BaseException as exc:  # noqa: BLE001 - whatever the program raised is its verdict
        replies.write(json.dumps({"loaded": False, "error": type(exc).__name__, "detail": str(exc)[:500]}) + "\n")
        return
    names = sorted(name for name, value in namespace.items() if callable(value) and not name.startswith("__"))
    replies.write(json.dumps({"loaded": True, "names": names}) + "\n")
    for line in requests:
        request = json.loads(line)
        try:
            value = namespace[request["call"]](*ast.literal_eval(request["args"]))
            text = repr(value)
            if len(text) > MAX_REPLY:
                raise OverflowError("reply too large")
            reply = {"ok": True, "value": text}
        except BaseException as exc:  # noqa: BLE001
            reply = {"ok": False, "error": type(exc).__name__}
        replies.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
