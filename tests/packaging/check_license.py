"""Checks that the licence (the repository's LICENSE, Apache-2.0) ships inside each package, byte for byte:

    python3 check_license.py LICENSE jar KVRET_JAR...         META-INF/LICENSE in each jar
    python3 check_license.py LICENSE wheel KVRET_WHL          <name>-<version>.dist-info/licenses/LICENSE (and
                                                              METADATA's License: Apache-2.0)
    python3 check_license.py LICENSE sdist KVRET_TAR_GZ       <name>-<version>/LICENSE
    python3 check_license.py LICENSE crates CARGO WORKSPACE   every crate of the Rust workspace: the license field
                                                              is Apache-2.0 and `cargo package --list` ships LICENSE
"""

import json
import os
import subprocess
import sys
import tarfile
import zipfile


def fail(message):
    sys.exit(f"check_license: {message}")


def check_text(where, text, expected):
    if text != expected:
        fail(f"{where} differs from the repository's LICENSE")
    print(f"check_license: {where}: the licence, {len(text)} bytes")


def member(names, wanted, archive):
    """The one member of an archive for which wanted(name) holds."""
    found = [name for name in names if wanted(name)]
    if len(found) != 1:
        fail(f"{archive}: expected one licence file, found {found or 'none'}")
    return found[0]


def check_jar(expected, jars):
    for jar in jars:
        with zipfile.ZipFile(jar) as z:
            if "META-INF/LICENSE" not in z.namelist():
                fail(f"{jar} has no META-INF/LICENSE")
            check_text(f"{jar}!META-INF/LICENSE", z.read("META-INF/LICENSE"), expected)


def check_wheel(expected, wheel):
    with zipfile.ZipFile(wheel) as z:
        name = member(z.namelist(), lambda n: n.split("/")[0].endswith(".dist-info") and n.endswith("/LICENSE"), wheel)
        check_text(f"{wheel}!{name}", z.read(name), expected)
        metadata = z.read(member(z.namelist(), lambda n: n.endswith(".dist-info/METADATA"), wheel)).decode()
        if "License: Apache-2.0" not in metadata.splitlines():
            fail(f"{wheel}: METADATA says no License: Apache-2.0")


def check_sdist(expected, sdist):
    with tarfile.open(sdist) as t:
        name = member(t.getnames(), lambda n: n.count("/") == 1 and n.endswith("/LICENSE"), sdist)
        check_text(f"{sdist}!{name}", t.extractfile(name).read(), expected)


def check_crates(expected, cargo, workspace):
    env = dict(os.environ, CARGO_TERM_COLOR="never")
    metadata = json.loads(subprocess.run(
        [cargo, "metadata", "--offline", "--no-deps", "--format-version", "1", "--manifest-path", workspace],
        env=env, check=True, capture_output=True, text=True).stdout)
    if not metadata["packages"]:
        fail(f"{workspace} has no crates")
    for package in metadata["packages"]:
        name = package["name"]
        if package.get("license") != "Apache-2.0":
            fail(f"crate {name}: license is {package.get('license')!r}, not 'Apache-2.0'")
        listed = subprocess.run(
            [cargo, "package", "--list", "--offline", "--allow-dirty", "-p", name, "--manifest-path", workspace],
            env=env, check=True, capture_output=True, text=True).stdout.split()
        if "LICENSE" not in listed:
            fail(f"crate {name}: `cargo package --list` does not ship LICENSE: {listed}")
        with open(os.path.join(os.path.dirname(package["manifest_path"]), "LICENSE"), "rb") as f:
            check_text(f"crate {name}: LICENSE (shipped by cargo package)", f.read(), expected)


def main(license_path, kind, *args):
    with open(license_path, "rb") as f:
        expected = f.read()
    if b"Apache License" not in expected or b"Version 2.0" not in expected:
        fail(f"{license_path} is not the Apache License 2.0")
    if kind == "jar" and args:
        check_jar(expected, args)
    elif kind == "wheel" and len(args) == 1:
        check_wheel(expected, args[0])
    elif kind == "sdist" and len(args) == 1:
        check_sdist(expected, args[0])
    elif kind == "crates" and len(args) == 2:
        check_crates(expected, *args)
    else:
        fail(__doc__)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        fail(__doc__)
    main(*sys.argv[1:])
