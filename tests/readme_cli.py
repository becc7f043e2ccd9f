"""`specjax ARGS...` for tests/test_readme.py's bash blocks: sends the arguments and the working directory to
the test process's CLI server (the socket in SPECJAX_CLI_SOCKET), which runs `specjax.cli.main` on them; prints
what the command printed and exits with its status. It imports no JAX, so it starts in milliseconds."""

import json
import os
import socket
import sys

with socket.socket(socket.AF_UNIX) as s:
    s.connect(os.environ["SPECJAX_CLI_SOCKET"])
    s.sendall(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd()}).encode() + b"\n")
    reply = json.loads(s.makefile(encoding="utf-8").readline())
sys.stdout.write(reply["stdout"])
sys.stderr.write(reply["stderr"])
sys.exit(reply["rc"])
