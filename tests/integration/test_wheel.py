"""The wheel users install, tested as they would use it.

``make wheel`` (run by ``make test`` before pytest) leaves in dist/ an sdist
and the manylinux wheel that auditwheel repaired. Here that wheel goes into a
fresh venv (``python -m venv``: no torch, not editable, the source tree not on
``sys.path``), and every command runs in a private mount namespace where the
system's liburing and ISA-L are empty files, as on a machine without them.
The same is done for a fallback wheel built from the sdist where pkg-config
finds neither library (pread disk backend, SSE4.2 crc32c).
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
VERSION = re.findall(
    r'^__version__ = "(.+)"$', (ROOT / "python/kvtier/__init__.py").read_text(), re.M
)[0]
PY_TAG = f"cp{sys.version_info.major}{sys.version_info.minor}"
HIDDEN_NAMES = ("liburing", "libisal")
BLOCK = 16384

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() != "x86_64",
    reason="the wheel is built for Linux x86_64",
)


def _repaired_wheel() -> Path:
    found = sorted((ROOT / "dist").glob(f"kvtier-{VERSION}-{PY_TAG}-{PY_TAG}-manylinux_*.whl"))
    if not found:
        pytest.skip(f"no dist/kvtier-{VERSION}-{PY_TAG}-*-manylinux_*.whl: `make wheel` builds it")
    return found[-1]


def _system_libs() -> list[Path]:
    """The real files behind every liburing / ISA-L name the loader knows."""
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=True).stdout
    files = set()
    for line in out.splitlines():
        name, _, path = line.strip().partition(" => ")
        if name.startswith(HIDDEN_NAMES) and path:
            files.add(Path(path).resolve())
    return sorted(files)


class Hidden:
    """Runs commands with the system's liburing and ISA-L hidden from them."""

    def __init__(self, empty: Path) -> None:
        self.libs = _system_libs()
        self.empty = empty
        empty.write_bytes(b"")

    def argv(self, cmd: Sequence[str]) -> list[str]:
        # unshare -m makes the new namespace's mounts private: the host keeps its files.
        mounts = "".join(f"mount --bind {self.empty} {shlex.quote(str(f))} && " for f in self.libs)
        return ["unshare", "-m", "sh", "-c", mounts + 'exec "$@"', "sh", *cmd]

    def run(self, cmd: Sequence[str], cwd: Path) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        return subprocess.run(
            self.argv(cmd), cwd=cwd, env=env, capture_output=True, text=True, timeout=300
        )


@pytest.fixture(scope="module")
def hidden(tmp_path_factory: pytest.TempPathFactory) -> Hidden:
    if os.geteuid() != 0:
        pytest.skip("hiding liburing and ISA-L takes bind mounts in a mount namespace: needs root")
    if shutil.which("unshare") is None:
        pytest.skip("hiding liburing and ISA-L needs unshare (util-linux)")
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare -m is not allowed here: {probe.stderr.strip()}")
    return Hidden(tmp_path_factory.mktemp("hide") / "empty")


def _venv(where: Path, wheel: Path) -> Path:
    """A fresh venv with ``wheel`` and its dependencies (not torch) installed."""
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
    py = where / "bin" / "python"
    r = subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheel)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return where


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _venv(tmp_path_factory.mktemp("wheel") / "venv", _repaired_wheel())


@pytest.fixture(scope="module")
def fallback_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from the sdist on a machine where pkg-config finds
    neither liburing nor ISA-L."""
    sdist = ROOT / "dist" / f"kvtier-{VERSION}.tar.gz"
    if not sdist.exists():
        pytest.skip(f"no dist/{sdist.name}: `make wheel` builds it")
    out = tmp_path_factory.mktemp("fallback")
    env = {**os.environ, "PKG_CONFIG_LIBDIR": str(out / "no-pkgconfig")}
    # The build tools of the test venv (scikit-build-core, pybind11, cmake, ninja).
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["--wheel-dir", str(out), str(sdist)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    wheel = next(out.glob("kvtier-*.whl"))
    return _venv(out / "venv", wheel)


def _site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python3.*/site-packages"))


def _kvtier(venv: Path, *args: str) -> list[str]:
    return [str(venv / "bin" / "kvtier"), *args]


def _python(venv: Path, code: str) -> list[str]:
    return [str(venv / "bin" / "python"), "-I", "-c", code]  # -I: no cwd, no PYTHON* env


# -- the repaired wheel ----------------------------------------------------
def test_wheel_is_manylinux_with_its_libraries_inside() -> None:
    wheel = _repaired_wheel()
    auditwheel = Path(sys.executable).parent / "auditwheel"
    show = subprocess.run([str(auditwheel), "show", str(wheel)], capture_output=True, text=True)
    assert show.returncode == 0, show.stderr
    tag = re.search(
        r'consistent with\s+the following platform tag:\s+"(manylinux_2_\d+_x86_64)"', show.stdout
    )
    assert tag, show.stdout
    assert wheel.name == f"kvtier-{VERSION}-{PY_TAG}-{PY_TAG}-{tag[1]}.whl"
    names = zipfile.ZipFile(wheel).namelist()
    # ISA-L ships no static library on Debian, and OpenSSL is linked shared
    # on purpose: bundled. liburing is linked in.
    libs = sorted(n for n in names if n.startswith("kvtier.libs/") and not n.endswith("/"))
    assert len(libs) == 3, libs
    assert re.fullmatch(r"kvtier\.libs/libcrypto-[0-9a-f]{8}\.so\.3", libs[0]), libs
    assert re.fullmatch(r"kvtier\.libs/libisal-[0-9a-f]{8}\.so\.2\.0\.\d+", libs[1]), libs
    assert re.fullmatch(r"kvtier\.libs/libssl-[0-9a-f]{8}\.so\.3", libs[2]), libs
    assert not [n for n in names if "liburing" in n]


def test_imports_with_no_torch_and_no_system_libraries(hidden: Hidden, venv: Path) -> None:
    code = (
        "import ctypes, importlib.util, json, kvtier, kvtier._native\n"
        "hidden = []\n"
        "for n in ('liburing.so.2', 'libisal.so.2'):\n"
        "    try:\n"
        "        ctypes.CDLL(n)\n"
        "    except OSError as e:\n"
        "        hidden.append(str(e))\n"
        "maps = open('/proc/self/maps').read().split()\n"
        "print(json.dumps({'file': kvtier.__file__, 'version': kvtier.__version__,\n"
        "  'torch': importlib.util.find_spec('torch') is not None, 'hidden': hidden,\n"
        "  'loaded': sorted({p for p in maps if 'libisal' in p or 'liburing' in p})}))\n"
    )
    r = hidden.run(_python(venv, code), cwd=venv)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    site = _site_packages(venv)
    assert got["file"] == str(site / "kvtier" / "__init__.py")
    assert got["version"] == VERSION
    assert got["torch"] is False
    # Neither library loads from the system in this namespace (empty files)...
    assert len(got["hidden"]) == 2
    assert all("file too short" in e or "cannot open" in e for e in got["hidden"])
    # ...and the ISA-L that is mapped is the wheel's own copy.
    assert len(got["loaded"]) == 1
    assert got["loaded"][0].startswith(str(site / "kvtier.libs" / "libisal-"))

    r = hidden.run(_kvtier(venv, "--version"), cwd=venv)
    assert (r.returncode, r.stdout) == (0, f"kvtier {VERSION}\n")


def test_the_same_libraries_hidden_break_a_build_that_needs_them(hidden: Hidden) -> None:
    """The hiding has teeth: the editable build of make test links libisal.so.2."""
    if not hidden.libs or shutil.which("readelf") is None:
        pytest.skip("no system liburing or ISA-L to hide, or no readelf")
    needed = subprocess.run(
        ["readelf", "-d", _native_of(sys.executable)], capture_output=True, text=True
    ).stdout
    if "libisal.so.2" not in needed:
        pytest.skip("the kvtier in this test's venv does not link the system libisal.so.2")
    r = hidden.run([sys.executable, "-I", "-c", "import kvtier._native"], cwd=ROOT)
    assert r.returncode == 1
    assert "libisal.so.2: file too short" in r.stderr


def _native_of(python: str) -> str:
    code = "import kvtier._native as n; print(n.__file__)"
    return subprocess.run([python, "-c", code], capture_output=True, text=True).stdout.strip()


def test_doctor_names_the_backends(hidden: Hidden, venv: Path) -> None:
    r = hidden.run(_kvtier(venv, "doctor", "--json"), cwd=venv)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert re.fullmatch(r"liburing 2\.\d+, static", rep["native"]["build"]["io_uring"])
    assert re.fullmatch(r"libisal 2\.\d+\.\d+, shared", rep["native"]["build"]["isa_l"])
    assert re.fullmatch(r"openssl 3\.\d+\.\d+, shared", rep["native"]["build"]["tls"])
    assert rep["native"]["crc32c"] == "isa-l"
    [isal] = rep["native"]["loaded"]  # the wheel's copy, liburing being linked in
    assert isal.startswith(str(_site_packages(venv) / "kvtier.libs" / "libisal-"))
    assert rep["backends"]["crc32c"] == "isa-l"
    assert rep["disk"]["pread"]["ok"] is True
    # io_uring itself is the kernel's: a seccomp filter may refuse it (then pread, and why).
    if rep["disk"]["io_uring"]["ok"]:
        assert rep["backends"]["disk"] == "io_uring"
    else:
        assert rep["backends"]["disk"] == f"pread ({rep['disk']['io_uring']['error']})"
    text = hidden.run(_kvtier(venv, "doctor"), cwd=venv)
    assert text.returncode == 0, text.stderr
    assert text.stdout.startswith("ok  backends   {")


def _replay(venv: Path, hidden: Hidden, tmp: Path) -> dict[str, object]:
    (tmp / "disk").mkdir()
    r = hidden.run(
        _kvtier(venv, "replay", "--host-blocks", "64", "--block-bytes", "16KiB")
        + ["--disk", f"{tmp / 'disk'}:32MiB", "--max-requests", "400"]
        + ["--json", str(tmp / "r.json"), "--no-progress"],
        cwd=tmp,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    js: dict[str, object] = json.loads((tmp / "r.json").read_text())
    return js


def test_replay_with_host_and_disk_tiers(hidden: Hidden, venv: Path, tmp_path: Path) -> None:
    js = _replay(venv, hidden, tmp_path)
    hits = js["hit_blocks"]
    assert isinstance(hits, dict)
    assert js["requests"] == 400
    assert js["verify_failures"] == 0
    assert hits["host"] > 0 and hits["disk"] > 0
    assert js["bytes_loaded"] == (hits["host"] + hits["disk"]) * BLOCK


def test_plan_and_bench_run_without_torch(hidden: Hidden, venv: Path, tmp_path: Path) -> None:
    plan = hidden.run(
        _kvtier(venv, "plan", "--layers", "64", "--kv-heads", "8", "--head-dim", "128")
        + ["--block-tokens", "16", "--partition", "48,16", "--kv-memory", "20GiB", "--json"],
        cwd=tmp_path,
    )
    assert plan.returncode == 0, plan.stderr
    assert [s["layers"] for s in json.loads(plan.stdout.splitlines()[-1])["stages"]] == [48, 16]
    for args in (
        ["manager", "--keys", "2000"],
        ["copy", "--device", "cpu", "--block-bytes", "64KiB"],
    ):
        r = hidden.run(
            _kvtier(venv, "bench", *args, "--repeats", "1", "--json", "--results-dir", ""),
            cwd=tmp_path,
        )
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout.splitlines()[-1])["component"] == args[0]
    # Plots are the one thing that needs an extra, and say so before any work.
    r = hidden.run(_kvtier(venv, "replay", "--plot", "p.png", "--no-progress"), cwd=tmp_path)
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == "kvtier: error: --plot needs matplotlib: pip install 'kvtier[bench]'\n"


# Stores blocks of distinct bytes, loads them into other slots, compares.
ROUND_TRIP = """
import json, sys, time
import numpy as np
from kvtier.pool import HostPool
from kvtier.tiers import LookupResult
from kvtier.tiers.disk import DiskTier, record_bytes

B, N = 16384, 8
def wait(t, token):
    for _ in range(20000):
        for c in t.poll():
            if c.token == token:
                return list(c.key_ok or [])
        time.sleep(0.0005)
    raise SystemExit("disk job did not finish")

t = DiskTier(sys.argv[1], 64 * record_bytes(B), B, backend=sys.argv[2])
with HostPool(2 * N, record_bytes(B)) as p:
    t.attach(p)
    data = [np.random.default_rng(i).integers(0, 256, B, dtype=np.uint8) for i in range(N)]
    keys = [b"wheel-%d" % i for i in range(N)]
    for i in range(N):
        p.view(i)[:B] = data[i]
    stored = wait(t, t.submit_store(keys, list(range(N))))
    loaded = wait(t, t.submit_load(keys, list(range(N, 2 * N))))
    same = [bytes(p.view(N + i)[:B]) == data[i].tobytes() for i in range(N)]
    print(json.dumps({"backend": t.store.backend, "stored": stored, "loaded": loaded,
                      "same": same, "unknown": t.lookup(b"never-stored").name}))
    t.close()
"""


def _round_trip(venv: Path, hidden: Hidden, tmp: Path, backend: str) -> dict[str, object]:
    d = tmp / backend
    d.mkdir()
    r = hidden.run(_python(venv, ROUND_TRIP) + [str(d), backend], cwd=tmp)
    assert r.returncode == 0, r.stderr
    out: dict[str, object] = json.loads(r.stdout)
    return out


TLS_ROUND_TRIP = """
import json, sys, time
import numpy as np
from kvtier.pool import HostPool
from kvtier.tiers.remote import RemoteTier

url, ca, cert, key = sys.argv[1:5]
t = RemoteTier(url, 16384, namespace="wheel-tls", tls_ca_file=ca, tls_cert_file=cert,
               tls_key_file=key)
with HostPool(8, 16384) as p:
    t.attach(p)
    p.view(0, 4)[:] = np.arange(4 * 16384, dtype=np.uint32).astype(np.uint8).reshape(4, 16384)
    out = []
    for kind, slots in (("store", [0, 1, 2, 3]), ("load", [4, 5, 6, 7])):
        token = getattr(t, "submit_" + kind)([b"k%d" % i for i in range(4)], slots)
        t.engine.wait(sorted(t.jobs.in_flight()))
        out += [c.key_ok for c in t.poll() if c.token == token]
    out.append(bool((p.view(0, 4) == p.view(4, 4)).all()))
    maps = open("/proc/self/maps").read().split()
    out.append(sorted({m.rsplit("/", 1)[-1].split("-")[0] for m in maps if "kvtier.libs/" in m}))
    print(json.dumps(out))
    t.close()
"""


def test_tls_round_trip_with_the_bundled_openssl(
    hidden: Hidden, venv: Path, redis_tls: Any
) -> None:
    c = redis_tls.tls
    args = [redis_tls.tls_url, str(c.ca), str(c.client_cert), str(c.client_key)]
    r = hidden.run(_python(venv, TLS_ROUND_TRIP) + args, cwd=venv)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [
        [True] * 4,
        [True] * 4,
        True,
        ["libcrypto", "libisal", "libssl"],
    ]


def test_disk_tier_round_trip_bytes(hidden: Hidden, venv: Path, tmp_path: Path) -> None:
    for backend in ("pread", "auto"):
        got = _round_trip(venv, hidden, tmp_path, backend)
        assert got["stored"] == got["loaded"] == got["same"] == [True] * 8, got
        assert got["unknown"] == "MISS"
        if backend == "pread":
            assert got["backend"] == "pread"


# -- the fallback build ----------------------------------------------------
def test_fallback_build_without_liburing_and_isal(
    hidden: Hidden, fallback_venv: Path, tmp_path: Path
) -> None:
    venv = fallback_venv
    names = zipfile.ZipFile(next(venv.parent.glob("kvtier-*.whl"))).namelist()
    assert not [n for n in names if "libisal" in n or "liburing" in n]

    r = hidden.run(_kvtier(venv, "doctor", "--json"), cwd=venv)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    # zlib's headers are on this machine: the journal's crc32 is zlib's.
    assert re.fullmatch(r"zlib \d+\.\d+(\.\d+)*", rep["native"]["build"].pop("zlib"))
    assert rep["native"]["build"] == {
        "io_uring": "not built (liburing not found)",
        "isa_l": "not built (libisal not found)",
        "tls": "not built (openssl not found)",
    }
    assert rep["native"]["loaded"] == []
    assert rep["backends"] == {
        "ok": True,
        "crc32c": "sse4.2",
        "disk": "pread ([Errno 38] kvtier was built without liburing)",
    }
    text = hidden.run(_kvtier(venv, "doctor"), cwd=venv).stdout
    assert text.splitlines()[0] == (
        'ok  backends   {"crc32c": "sse4.2", "disk": "pread ([Errno 38] kvtier was built without liburing)"}'
    )

    js = _replay(venv, hidden, tmp_path)
    assert js["verify_failures"] == 0

    code = (
        "import kvtier\n"
        "from kvtier.tiers.remote import RemoteTier\n"
        "try:\n"
        "    RemoteTier('rediss://127.0.0.1:1', 4096)\n"
        "except kvtier.TlsError as e:\n"
        "    print(e)\n"
    )
    r = hidden.run(_python(venv, code), cwd=venv)
    assert r.stdout == (
        "[Errno 93] this build of kvtier has no TLS (OpenSSL was not found when it was built): "
        "rediss:// is not available\n"
    ), r.stderr
    got = _round_trip(venv, hidden, tmp_path, "auto")
    assert got["backend"] == "pread"
    assert got["stored"] == got["loaded"] == got["same"] == [True] * 8, got
    # Asking for io_uring from this build is a clear error, not a silent pread.
    r = hidden.run(_python(venv, ROUND_TRIP) + [str(tmp_path / "auto"), "io_uring"], cwd=tmp_path)
    assert r.returncode == 1
    assert "kvtier.errors.IoError: [Errno 38] kvtier was built without liburing" in r.stderr


def test_build_option_makes_io_uring_required(tmp_path: Path) -> None:
    cmake = shutil.which("cmake", path=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    if cmake is None:
        pytest.skip("no cmake")
    env = {**os.environ, "PKG_CONFIG_LIBDIR": str(tmp_path / "no-pkgconfig")}

    def configure(uring: str) -> str:
        """Configure with KVTIER_URING=``uring`` where pkg-config finds
        nothing; must fail. Its error output, white space folded."""
        cmd = [cmake, "-S", str(ROOT), "-B", str(tmp_path / uring), "-DKVTIER_BUILD_PYTHON=OFF"]
        r = subprocess.run(
            cmd + [f"-DKVTIER_URING={uring}"], env=env, capture_output=True, text=True
        )
        assert r.returncode != 0
        return " ".join(r.stderr.split())

    err = configure("ON")
    assert "kvtier: KVTIER_URING=ON but liburing was not found by pkg-config." in err
    assert "KVTIER_URING must be AUTO, ON or OFF, not 'maybe'" in configure("maybe")
