"""The container path, for real: scripts/compose_ci.sh builds the images, runs the compose stack
(TinyGPT), sends requests through the published router port, scales decode to two, reads the
handoff metrics, asks the default model (SmolLM2) one chat question and takes everything down
again. Then: the image runs its service as a non-root user, and holds the default model ready to
serve (no network, read-only file system: nothing to fetch, nothing to convert).

Needs root and Debian's packages (docker.io, docker-compose, debootstrap), which the script
installs when absent. Where that cannot work, the tests fail and say why; set
PDSERVE_SKIP_COMPOSE=1 to skip them instead.
"""

import os
import pathlib
import re
import signal
import subprocess
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "compose_ci.sh"
IMAGE = os.environ.get("PDSERVE_IMAGE", "pdserve:local")
# Cold (engine install, base image, wheels, image build) takes about 5 minutes on 2 cores.
STAGE_TIMEOUT_SECONDS = 900
CLEANUP_SECONDS = 180

pytestmark = pytest.mark.skipif(
    os.environ.get("PDSERVE_SKIP_COMPOSE") == "1",
    reason="PDSERVE_SKIP_COMPOSE=1 was set: the person running the suite opted out of the "
    "container stage (.ci/run never sets it; a machine where Docker fails is a failure)",
)


def _run_stage() -> tuple[int, str]:
    env = dict(os.environ, PDSERVE_CI_KEEP_DOCKERD="1")
    proc = subprocess.Popen(
        ["bash", str(SCRIPT)],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=STAGE_TIMEOUT_SECONDS)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # the script's trap takes the stack down
        try:
            out, _ = proc.communicate(timeout=CLEANUP_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        return -1, out + f"\n[timed out after {STAGE_TIMEOUT_SECONDS} s]"


def _stop_dockerd(pid: int) -> None:
    """Stops the dockerd that the stage started (and only that one), bounded."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def stage():
    """Runs the CI stage once; stops afterwards the dockerd it started, if it started one."""
    rc, out = _run_stage()
    started = re.search(r"left running: dockerd pid (\d+)", out)
    yield rc, out
    if started:
        _stop_dockerd(int(started.group(1)))


def test_compose_stage_passes(stage):
    rc, out = stage
    tail = "\n".join(out.splitlines()[-80:])
    assert rc == 0 and "compose_ci: PASS" in out, (
        f"scripts/compose_ci.sh failed (exit {rc}); if the Docker engine cannot be installed or "
        f"started on this machine, set PDSERVE_SKIP_COMPOSE=1 to skip. Last lines:\n{tail}"
    )
    print(out)


def test_image_runs_as_non_root(stage):
    rc, _ = stage
    if rc != 0:
        pytest.fail("the CI stage failed, so the image could not be checked (see the test above)")
    uid = subprocess.run(
        ["docker", "run", "--rm", "--entrypoint", "id", IMAGE, "-u"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert uid.returncode == 0, uid.stderr
    assert uid.stdout.strip().isdigit() and int(uid.stdout) != 0, (
        f"{IMAGE} runs as uid {uid.stdout.strip()!r}"
    )


def test_image_holds_the_default_model(stage):
    rc, _ = stage
    if rc != 0:
        pytest.fail("the CI stage failed, so the image could not be checked (see the test above)")
    # The default model name, resolved as a service resolves it, in a container that could
    # neither download nor write: it must find the conversion made at image build time.
    script = (
        "import os; from pdserve.models.loading import load_served_model; "
        "served = load_served_model('smollm2-135m-instruct', weights=False); "
        "print(os.environ['PDSERVE_CACHE_DIR'], served.source, served.tokenizer.vocab_size)"
    )
    run = subprocess.run(
        [
            "docker",
            "run",
            "--rm",
            "--network",
            "none",
            "--read-only",
            "--entrypoint",
            "python",
            IMAGE,
            "-c",
            script,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    cache, source, vocab = run.stdout.split()
    assert source.startswith(cache + "/"), f"loaded from {source}, not from the cache {cache}"
    assert int(vocab) > 256, f"vocabulary of {vocab}: not SmolLM2's tokenizer"
