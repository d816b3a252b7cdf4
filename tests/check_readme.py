"""Runs every command README.md shows, as written: each fenced ```c block is saved as the file the text before it
names, each ```sh block runs in bash, each ```python block in python3, in order, in a scratch directory that sees
the repository's folders and the build directory as `build` (HOME points into it, so an install into ~/.local
stays there). The first block, the two commands that set up a machine, is what CI runs (.ci/run): this checks that
they are the README's first lines and that CI calls both.

    python3 tests/check_readme.py SOURCE_DIR BUILD_DIR PYTHON_SITE [PYTHON]

With PYTHON (the python of a virtual environment kvret's wheel is installed in, as tests/packaging/python_packages.py
makes it), the ```python blocks run with that interpreter and without PYTHON_SITE, as a user runs them after
`pip install .`; the ```sh blocks still see PYTHON_SITE.
"""

import os
import re
import subprocess
import sys
import tempfile

BLOCK = re.compile(r"^```(\w*)\n(.*?)^```\s*$", re.S | re.M)
# What a block's output must show, by language: the run must do what the text around it says.
EXPECTED = {"python": "71432"}  # the pass key the prompt hides


def blocks(readme):
    """(language, code, the text before the block) of every fenced block."""
    out, last = [], 0
    for m in BLOCK.finditer(readme):
        out.append((m.group(1), m.group(2), readme[last : m.start()]))
        last = m.end()
    return out


def main(source, build, site, python=None):
    with open(os.path.join(source, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    found = blocks(readme)
    if not found or not readme.lstrip().split("\n", 1)[1].lstrip().startswith("```sh"):
        sys.exit("README.md: the first thing after the title must be the sh block of the two setup commands")
    first = [line.split("#")[0].strip() for line in found[0][1].splitlines() if line.strip()]
    if first != ["scripts/demo.sh", "scripts/test.sh"]:
        sys.exit(f"README.md: the first block must be scripts/demo.sh and scripts/test.sh, got {first}")
    with open(os.path.join(source, ".ci", "run"), encoding="utf-8") as f:
        ci = f.read()
    for command in first:
        if not re.search(rf"^{re.escape(command)}\b", ci, re.M):
            sys.exit(f".ci/run does not run {command}")

    with tempfile.TemporaryDirectory(prefix="kvret-readme-") as scratch:
        for name in os.listdir(source):
            if name not in ("build", "README.md") and not name.startswith("."):
                os.symlink(os.path.join(source, name), os.path.join(scratch, name))
        os.symlink(os.path.abspath(build), os.path.join(scratch, "build"))
        env = dict(os.environ, HOME=os.path.join(scratch, "home"), PYTHONPATH=site)
        env.pop("LD_LIBRARY_PATH", None)  # a program the README builds must find libkvret by itself
        os.makedirs(env["HOME"])
        if python:  # the package must be the environment's own, not a build tree's
            where = subprocess.run(
                [python, "-c", "import kvret, os, sys; print(os.path.realpath(kvret.__file__)); print(sys.prefix)"],
                cwd=scratch, env={k: v for k, v in env.items() if k != "PYTHONPATH"}, capture_output=True, text=True)
            lines = where.stdout.split("\n")
            if where.returncode != 0 or not lines[0].startswith(os.path.realpath(lines[1]) + os.sep):
                sys.exit(f"{python} does not import kvret from its own environment: {where.stdout}{where.stderr}")
            print(f"README: the Python blocks run with {python}, kvret from {lines[0]}", flush=True)
        for i, (language, code, before) in enumerate(found[1:], start=2):
            if language == "c":
                saved = re.findall(r"Saved as `([\w.]+)`", readme[readme.index(code) + len(code) :])
                name = saved[0] if saved else "program.c"
                with open(os.path.join(scratch, name), "w", encoding="utf-8") as f:
                    f.write(code)
                print(f"README block {i}: saved the C program as {name}", flush=True)
                continue
            if language == "sh":
                command = ["bash", "-euo", "pipefail", "-c", code]
            elif language == "python":
                command = [python or sys.executable, "-c", code]
            else:
                continue  # text, tables, output shown as an example
            print(f"README block {i} ({language}):\n{code}", flush=True)
            block_env = env
            if language == "python" and python:
                block_env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
            run = subprocess.run(command, cwd=scratch, env=block_env, capture_output=True, text=True)
            print(run.stdout[-4000:], run.stderr[-4000:], sep="\n", flush=True)
            if run.returncode != 0:
                sys.exit(f"README block {i} ({language}) failed with exit status {run.returncode}")
            expected = EXPECTED.get(language)
            if expected and expected not in run.stdout:
                sys.exit(f"README block {i} ({language}) printed no {expected!r}")
    print("every command of README.md ran as written")


if __name__ == "__main__":
    main(*sys.argv[1:5])
