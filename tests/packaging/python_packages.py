"""Builds the Python package as a user gets it and uses it from a fresh virtual environment:

  1. the wheel of the CPU build (`pip wheel .`, scikit-build-core, CUDA off as pyproject.toml sets it) and the sdist;
     the wheel's build directory is kept (WORK/wheel-build), so a rerun rebuilds only what changed;
  2. the licence inside both, the sdist's contents (the sources, no build trees); that the wheel was configured
     with KVRET_CUDA=OFF, and that `--config-settings=cmake.define.KVRET_CUDA=ON` reaches CMake (a configure with
     no CUDA compiler, which must stop saying so);
  3. a fresh virtual environment (WORK/venv) with the wheel installed, in which `kvret` must be imported from the
     venv (never from a build tree);
  4. with --readme, README.md's Python lines, run as written with the venv's python, must answer the pass key (CTest
     leaves them to readme.commands, which runs them with WORK/venv/bin/python: tests/check_readme.py).

With --sdist-install, the sdist is also built and installed into a second fresh virtual environment
(WORK/venv-sdist; a whole build of the library, from sources extracted into WORK/sdist-src) and imported there.

    python3 python_packages.py SOURCE_DIR WORK [--readme] [--sdist-install]

The venvs see the system's site-packages (--system-site-packages: NumPy, torch, transformers, and pip itself, which
installs into the venv it is run from, come from there; --without-pip, so no ensurepip is needed); kvret itself is
installed with --no-deps. Each step's time goes to stdout.
"""

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
import check_license  # noqa: E402
import check_readme  # noqa: E402


def step(name, started):
    print(f"python_packages: {name} took {time.monotonic() - started:.1f} s", flush=True)
    return time.monotonic()


def run(command, **kwargs):
    print("python_packages: $ " + " ".join(command), flush=True)
    subprocess.run(command, check=True, **kwargs)


def clean_env(**extra):
    """The environment without anything that points Python or the loader at a build tree."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_LIBRARY_PATH", "PYTHONHOME")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONDONTWRITEBYTECODE="1", **extra)
    return env


def build_wheel(source, work, dist):
    """pip wheel of the source tree, without build isolation (scikit-build-core, NumPy, SWIG are the machine's),
    in a build directory kept across runs, with at most two compile jobs."""
    env = clean_env(CMAKE_BUILD_PARALLEL_LEVEL=os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", "2"))
    run([sys.executable, "-m", "pip", "wheel", source, "--no-build-isolation", "--no-deps", "--no-index",
         "--wheel-dir", dist, f"--config-settings=build-dir={os.path.join(work, 'wheel-build')}"], env=env)
    wheels = [f for f in os.listdir(dist) if f.endswith(".whl")]
    if len(wheels) != 1 or not wheels[0].startswith("kvret-"):
        sys.exit(f"python_packages: expected one kvret wheel in {dist}, found {wheels}")
    return os.path.join(dist, wheels[0])


def cache_value(build_dir, name):
    with open(os.path.join(build_dir, "CMakeCache.txt"), encoding="utf-8") as f:
        for line in f:
            if line.startswith(name + ":"):
                return line.split("=", 1)[1].strip()
    return None


def check_cuda_switch(source, work):
    """The documented switch reaches CMake: with a CUDA compiler that does not exist (CUDACXX), configure must stop
    with the library's message (a configure only: nothing is compiled)."""
    build_dir = os.path.join(work, "cuda-switch-build")
    shutil.rmtree(build_dir, ignore_errors=True)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", source, "--no-build-isolation", "--no-deps",
                        "--no-index", "--wheel-dir", os.path.join(work, "cuda-switch-dist"),
                        "--config-settings=cmake.define.KVRET_CUDA=ON", f"--config-settings=build-dir={build_dir}"],
                       env=clean_env(CUDACXX=os.path.join(work, "no-such-nvcc")), capture_output=True, text=True)
    expected = "KVRET_CUDA=ON but no CUDA compiler was found"
    if r.returncode == 0 or expected not in r.stdout + r.stderr or cache_value(build_dir, "KVRET_CUDA") != "ON":
        print(r.stdout[-4000:], r.stderr[-4000:], sep="\n")
        sys.exit("python_packages: --config-settings=cmake.define.KVRET_CUDA=ON did not reach CMake")
    shutil.rmtree(build_dir, ignore_errors=True)
    print(f"python_packages: cmake.define.KVRET_CUDA=ON reaches CMake ({expected!r} without a CUDA compiler)")


def build_sdist(source, dist):
    """The sdist, by scikit-build-core's PEP 517 hook (what `python -m build --sdist` calls)."""
    code = "import sys, scikit_build_core.build as b; print(b.build_sdist(sys.argv[1]))"
    name = subprocess.run([sys.executable, "-c", code, dist], cwd=source, env=clean_env(), check=True,
                          capture_output=True, text=True).stdout.split()[-1]
    return os.path.join(dist, name)


def check_sdist(sdist):
    with tarfile.open(sdist) as t:
        names = t.getnames()
    top = names[0].split("/")[0]
    for needed in ("pyproject.toml", "CMakeLists.txt", "LICENSE", "include/kvret.h", "bindings/python/kvret_swig.i",
                   "bindings/python/kvret/__init__.py", "pkgconfig/kvret.pc.in"):
        if f"{top}/{needed}" not in names:
            sys.exit(f"python_packages: {sdist} lacks {needed}")
    stray = [n for n in names if n.split("/")[1:2] and n.split("/")[1].startswith(("build", ".ci", "bench"))]
    if stray:
        sys.exit(f"python_packages: {sdist} holds what pyproject.toml excludes: {stray[:5]}")
    print(f"python_packages: {sdist}: {len(names)} entries, the sources without build trees", flush=True)


def fresh_venv(path, package):
    """A new virtual environment with `package` (a wheel or an sdist) installed; returns its python."""
    shutil.rmtree(path, ignore_errors=True)
    run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", path], env=clean_env())
    python = os.path.join(path, "bin", "python")
    run([python, "-m", "pip", "install", "--no-deps", "--no-index", "--no-build-isolation", package],
        env=clean_env(CMAKE_BUILD_PARALLEL_LEVEL="2"))
    return python


def check_import(python, venv, scratch):
    """kvret must be the venv's: its package, its extension and the libkvret the process loaded."""
    code = ("import os, kvret; from kvret import kvret_swig as s; print(kvret.version()); "
            "print(os.path.realpath(kvret.__file__)); print(os.path.realpath(s._kvret_swig.__file__)); "
            "print(next(l.split()[-1] for l in open('/proc/self/maps') if 'libkvret' in l))")
    out = subprocess.run([python, "-c", code], cwd=scratch, env=clean_env(), check=True, capture_output=True,
                         text=True).stdout.split("\n")
    version, files = out[0], out[1:4]
    root = os.path.realpath(venv) + os.sep
    for file in files:
        if not file.startswith(root):
            sys.exit(f"python_packages: kvret came from {file}, not from the venv {venv}")
    print(f"python_packages: kvret {version} imported from {files[0]}, libkvret from {files[2]}", flush=True)


def readme_python(source, python, scratch):
    """README.md's Python blocks, as written, with the venv's python; each must print the pass key."""
    with open(os.path.join(source, "README.md"), encoding="utf-8") as f:
        found = [(code, lang) for lang, code, _ in check_readme.blocks(f.read()) if lang == "python"]
    if not found:
        sys.exit("python_packages: README.md has no Python block")
    for code, lang in found:
        print(f"python_packages: README's Python block with {python}:\n{code}", flush=True)
        r = subprocess.run([python, "-c", code], cwd=scratch, env=clean_env(), capture_output=True, text=True)
        print(r.stdout[-4000:], r.stderr[-4000:], sep="\n", flush=True)
        if r.returncode != 0:
            sys.exit(f"python_packages: README's Python block failed with exit status {r.returncode}")
        if check_readme.EXPECTED[lang] not in r.stdout:
            sys.exit(f"python_packages: README's Python block printed no {check_readme.EXPECTED[lang]!r}")


def main(source, work, *options):
    source, work = os.path.abspath(source), os.path.abspath(work)
    unknown = set(options) - {"--readme", "--sdist-install"}
    if unknown:
        sys.exit(__doc__)
    license_path = os.path.join(source, "LICENSE")
    dist = os.path.join(work, "dist")
    shutil.rmtree(dist, ignore_errors=True)
    os.makedirs(dist)
    t = time.monotonic()
    wheel = build_wheel(source, work, dist)
    t = step("the wheel (pip wheel .)", t)
    if cache_value(os.path.join(work, "wheel-build"), "KVRET_CUDA") != "OFF":
        sys.exit("python_packages: the wheel was not configured with KVRET_CUDA=OFF")
    sdist = build_sdist(source, dist)
    t = step("the sdist", t)
    check_cuda_switch(source, work)
    t = step("the CUDA switch (a configure)", t)
    check_license.main(license_path, "wheel", wheel)
    check_license.main(license_path, "sdist", sdist)
    check_sdist(sdist)

    with tempfile.TemporaryDirectory(prefix="kvret-venv-run-") as scratch:
        venv = os.path.join(work, "venv")
        python = fresh_venv(venv, wheel)
        t = step("a fresh venv with the wheel", t)
        check_import(python, venv, scratch)
        if "--readme" in options:
            readme_python(source, python, scratch)
            t = step("README's Python lines in the venv", t)

        if "--sdist-install" in options:
            # extracted to the same place each time, with the archive's times: a rerun's build is incremental
            sdist_src = os.path.join(work, "sdist-src")
            shutil.rmtree(sdist_src, ignore_errors=True)
            with tarfile.open(sdist) as archive:
                archive.extractall(sdist_src, filter="data")
            top = os.path.join(sdist_src, os.listdir(sdist_src)[0])
            venv_sdist = os.path.join(work, "venv-sdist")
            shutil.rmtree(venv_sdist, ignore_errors=True)
            run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv_sdist], env=clean_env())
            python_sdist = os.path.join(venv_sdist, "bin", "python")
            run([python_sdist, "-m", "pip", "install", "--no-deps", "--no-index", "--no-build-isolation", top,
                 f"--config-settings=build-dir={os.path.join(work, 'sdist-build')}"],
                env=clean_env(CMAKE_BUILD_PARALLEL_LEVEL="2"))
            check_import(python_sdist, venv_sdist, scratch)
            step("the sdist built and installed in a fresh venv", t)
    print(f"python_packages: the wheel and the sdist are built; the wheel is installed in the fresh venv {venv}")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(*sys.argv[1:])
