"""scripts/lock_glibc.py: the glibc floor of the CUDA engine environment, computed from its lock's wheels.

CI runs it against the package index (`bash scripts/engine-lock.sh --check`); these check its pure part on
file names as an index lists them, its reading of the lock, and its HTTP and PEP 503 path on a local index.
"""

from __future__ import annotations

import functools
import http.server
import importlib.util
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("lock_glibc", REPO / "scripts" / "lock_glibc.py")
lock_glibc = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(lock_glibc)

# llguidance 1.7.6 as the index lists it: its only x86_64 glibc wheel for CPython 3.11 is abi3 manylinux_2_31
LLGUIDANCE = [
    "llguidance-1.7.6-cp314-cp314t-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
    "llguidance-1.7.6-cp39-abi3-macosx_11_0_arm64.whl",
    "llguidance-1.7.6-cp39-abi3-manylinux_2_31_aarch64.whl",
    "llguidance-1.7.6-cp39-abi3-manylinux_2_31_x86_64.whl",
    "llguidance-1.7.6-cp39-abi3-manylinux_2_34_i686.whl",
    "llguidance-1.7.6-cp39-abi3-win_amd64.whl",
    "llguidance-1.7.6.tar.gz",
    "llguidance-1.7.5-cp39-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
]


def test_a_package_sets_the_lowest_glibc_of_its_wheels_for_cpython_311_on_linux_x86_64() -> None:
    """Only the pinned version's wheels that CPython 3.11 on x86_64 glibc installs count (not cp314t, aarch64,
    i686, macOS, Windows, another version); a source distribution beside them does not lower the floor."""
    assert lock_glibc.package_floor(LLGUIDANCE, "1.7.6") == (2, 31)
    numpy = [
        "numpy-2.2.6-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
        "numpy-2.2.6-cp311-cp311-manylinux_2_28_x86_64.whl",
        "numpy-2.2.6-cp311-cp311-musllinux_1_2_x86_64.whl",
        "numpy-2.2.6-cp310-cp310-manylinux_2_5_x86_64.manylinux1_x86_64.whl",
        "numpy-2.2.6-cp312-cp312-manylinux_2_5_x86_64.manylinux1_x86_64.whl",
    ]
    assert lock_glibc.package_floor(numpy, "2.2.6") == (2, 17)  # manylinux2014 is glibc 2.17
    assert lock_glibc.package_floor(["old-1.0-cp311-cp311-manylinux1_x86_64.whl"], "1.0") == (2, 5)
    assert lock_glibc.package_floor(["x-1.0-py3-none-manylinux_2_24_x86_64.whl"], "1.0") == (2, 24)
    assert lock_glibc.package_floor(["x-1.0-cp311-none-manylinux_2_27_x86_64.whl"], "1.0") == (2, 27)


def test_a_pure_python_wheel_or_a_source_distribution_alone_sets_no_floor() -> None:
    assert (
        lock_glibc.package_floor(["six-1.17.0-py2.py3-none-any.whl", "six-1.17.0.tar.gz"], "1.17.0") is None
    )
    # compiled wheels with a pure-Python fallback: an older glibc installs the fallback
    both = ["m-2.0-cp311-cp311-manylinux_2_34_x86_64.whl", "m-2.0-py3-none-any.whl"]
    assert lock_glibc.package_floor(both, "2.0") is None
    assert lock_glibc.package_floor(["transformer_engine_torch-2.11.0.tar.gz"], "2.11.0") is None
    # macOS and musl wheels only, and the sdist: built from source on glibc
    assert (
        lock_glibc.package_floor(["z-3.1-cp311-cp311-macosx_11_0_arm64.whl", "z-3.1.tar.gz"], "3.1") is None
    )


def test_a_pin_no_file_installs_on_fails_with_its_reason() -> None:
    with pytest.raises(
        ValueError, match=r"^no wheel for CPython 3.11 on Linux x86_64 and no source distribution"
    ):
        lock_glibc.package_floor(["q-1.0-cp312-cp312-manylinux_2_17_x86_64.whl", "q-0.9.tar.gz"], "1.0")
    with pytest.raises(ValueError, match=r"no source distribution of 9\.9$"):
        lock_glibc.package_floor(LLGUIDANCE, "9.9")


def test_the_environment_floor_is_the_highest_and_names_every_package_that_sets_it() -> None:
    floors = {"a 1": (2, 17), "llguidance 1.7.6": (2, 31), "b 2": None, "c 3": (2, 28), "aa 1": (2, 31)}
    assert lock_glibc.environment_floor(floors) == ((2, 31), ["aa 1", "llguidance 1.7.6"])
    assert lock_glibc.environment_floor({"b 2": None}) == (None, [])


def test_the_lock_is_read_with_its_indexes_in_the_order_the_installer_asks_them() -> None:
    lock = (
        "--index-url https://pypi.org/simple/\n--extra-index-url https://download.pytorch.org/whl/cu130\n"
        "numpy==2.2.6\n    # via torch\ntorch==2.11.0+cu130\n    # from https://download.pytorch.org/whl/cu130\n"
        "    # via vllm\nTransformer_Engine==2.11.0 \\\n    --hash=sha256:00\n"
    )
    pins, indexes = lock_glibc.read_lock(lock)
    assert pins == [
        ("numpy", "2.2.6", None),
        ("torch", "2.11.0+cu130", "https://download.pytorch.org/whl/cu130"),
        ("transformer-engine", "2.11.0", None),
    ]
    assert indexes == ["https://download.pytorch.org/whl/cu130", "https://pypi.org/simple"]
    pins, indexes = lock_glibc.read_lock((REPO / "scripts" / "engine-cuda.lock").read_text())
    assert indexes == [lock_glibc.DEFAULT_INDEX] and len(pins) > 200 and ("llguidance", "1.7.6", None) in pins


def test_engine_env_and_the_cluster_doc_state_one_floor_and_a_different_one_fails_in_one_line() -> None:
    env_sh = (REPO / "scripts" / "engine-env.sh").read_text()
    doc = (REPO / "docs" / "CLUSTER.md").read_text()
    assert lock_glibc.check_stated((2, 31), ["llguidance 1.7.6"], env_sh, doc) is None
    problem = lock_glibc.check_stated((2, 34), ["vllm 0.25.0"], env_sh, doc)
    assert problem == (
        "the lock's glibc floor is 2.34, set by vllm 0.25.0, but scripts/engine-env.sh has GLIBC_FLOOR=2.31, "
        "set by llguidance 1.7.6; docs/CLUSTER.md states glibc 2.31; docs/CLUSTER.md does not name vllm 0.25.0"
    )
    stale_doc = doc.replace("glibc >= 2.31", "glibc >= 2.28", 1)
    assert lock_glibc.check_stated((2, 31), ["llguidance 1.7.6"], env_sh, stale_doc) == (
        "the lock's glibc floor is 2.31, set by llguidance 1.7.6, but docs/CLUSTER.md states glibc 2.28, 2.31"
    )


def test_the_cuda_12_lock_has_its_own_stated_floor_and_the_script_takes_one_lock_by_name() -> None:
    """engine-env.sh states the CUDA 12 lock's floor apart (GLIBC_FLOOR_CUDA12, set by vLLM 0.19.1's wheels);
    the doc names its setter; a wrong one fails naming that variable; an unknown argument is exit 2."""
    env_sh = (REPO / "scripts" / "engine-env.sh").read_text()
    doc = (REPO / "docs" / "CLUSTER.md").read_text()
    assert lock_glibc.check_stated((2, 31), ["vllm 0.19.1"], env_sh, doc, "GLIBC_FLOOR_CUDA12") is None
    assert lock_glibc.check_stated((2, 31), ["vllm 0.19.2"], env_sh, doc, "GLIBC_FLOOR_CUDA12") == (
        "the lock's glibc floor is 2.31, set by vllm 0.19.2, but scripts/engine-env.sh has GLIBC_FLOOR_CUDA12=2.31, "
        "set by vllm 0.19.1; docs/CLUSTER.md does not name vllm 0.19.2"
    )
    lock, variable = lock_glibc.LOCKS["--cuda12"]
    pins, indexes = lock_glibc.read_lock(lock.read_text())
    assert variable == "GLIBC_FLOOR_CUDA12" and indexes == [lock_glibc.DEFAULT_INDEX] and ("vllm", "0.19.1", None) in pins
    assert lock_glibc.main(["--cuda11"]) == 2


class _Index(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def test_pins_resolve_over_http_from_a_pep_503_index_first_and_the_default_index_after(
    tmp_path: Path,
) -> None:
    """A package on the extra index (PEP 503 HTML, as download.pytorch.org serves it) is read there, one it
    lacks from the next index; a pin neither index has is an error that names the indexes, never a skip."""
    page = "<html><body>{}</body></html>"
    torch = "torch-2.11.0+cu130-cp311-cp311-manylinux_2_28_x86_64.whl"
    (tmp_path / "cu130" / "torch").mkdir(parents=True)
    (tmp_path / "cu130" / "torch" / "index.html").write_text(
        page.format(f'<a href="/whl/cu130/{torch.replace("+", "%2B")}#sha256=00">{torch}</a><br/>')
    )
    (tmp_path / "simple" / "llguidance").mkdir(parents=True)
    (tmp_path / "simple" / "llguidance" / "index.html").write_text(
        page.format("".join(f'<a href="../../files/{f}">{f}</a>\n' for f in LLGUIDANCE))
    )
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_Index, directory=str(tmp_path))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        indexes = [f"{base}/cu130", f"{base}/simple"]
        assert lock_glibc.floor_of_pin(("torch", "2.11.0+cu130", None), indexes) == (2, 28)
        assert lock_glibc.floor_of_pin(("llguidance", "1.7.6", None), indexes) == (2, 31)
        with pytest.raises(ValueError, match=rf"^not on {base}/cu130, {base}/simple$"):
            lock_glibc.floor_of_pin(("vllm", "0.24.0", None), indexes)
        with pytest.raises(ValueError, match=r"no source distribution of 2\.11\.0$"):
            lock_glibc.floor_of_pin(("torch", "2.11.0", f"{base}/cu130"), indexes)
    finally:
        server.shutdown()
        server.server_close()
