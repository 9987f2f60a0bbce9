"""The local driver runs the profile's image: built here (umoci, skopeo, busybox-static),
unpacked once into a cache by digest, used as every slot's read-only lower layer.

``scripts/setup.sh dev`` installs the tools (Debian, as root). Everything goes through the
public API: profiles with ``image=...``, ``get_status()``, the CLI.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner
from image_builder import OS_RELEASE, images_for_tests, tree
from support import SMALL, bash

from hermes_modal_tool import ImageError, SandboxConfig, SandboxStartError
from hermes_modal_tool.cli import main as cli_main
from hermes_modal_tool.images import ImageCache


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, str]:
    return images_for_tests(tmp_path_factory)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    """A fresh image cache for this test (the driver's default follows the variable)."""
    path = tmp_path / "cache"
    monkeypatch.setenv("HERMES_MODAL_TOOL_IMAGE_CACHE", str(path))
    return path


def image_status(backend) -> dict:
    return backend.get_status()["drivers"]["local"]["images"]


async def test_slot_sees_the_image_its_env_and_workdir_not_the_hosts(make_backend, images,
                                                                       cache_dir):
    backend = await make_backend(image=images["two"], env_vars={"HMT_BOTH": "profile"})
    slot = await backend.acquire("t")
    r = await bash(backend, slot, "cat /etc/os-release; pwd; cat hello.txt; "
                   "echo \"$HMT_IMAGE_VAR $HMT_BOTH $PATH\"; cat /usr/share/hmt/marker; ls /usr")
    assert r.returncode == 0, r.output
    assert r.output == (OS_RELEASE + "/srv/app\nhello from the workdir\n"
                        "from-image profile /usr/local/bin:/usr/bin:/bin\nfrom the image\nshare\n")
    # The host's /usr is not there (the image has busybox and no bash: the host's static
    # bash runs the slot's shell).
    r = await bash(backend, slot, "ls /usr/bin/python3 /usr/lib 2>&1; echo $0; id -u")
    assert "No such file" in r.output and r.output.endswith("/run/hmt-bash\n0\n"), r.output
    status = image_status(backend)
    assert status["size_bytes"] > 1_000_000 and status["cached"] == 1, status
    assert status["counters"]["unpacks"] == 1, status


async def test_whiteouts_opaque_directories_and_replaced_directories(make_backend, images,
                                                                     cache_dir):
    backend = await make_backend(image=images["two"])
    slot = await backend.acquire("t")
    r = await bash(backend, slot, "ls /etc/removed.txt /opt/keep 2>&1; cat /opt/data; "
                   "ls /opt/opq /opt/opq/deep; ls -A /opt")
    assert r.output == ("ls: /etc/removed.txt: No such file or directory\n"
                        "ls: /opt/keep: No such file or directory\n"
                        "a file now\n/opt/opq:\ndeep\nnew\n\n/opt/opq/deep:\nnew2\n"
                        "data\nopq\n"), r.output


def test_own_unpacker_matches_umoci(images, tmp_path):
    """The builtin unpacker (every source) gives the tree ``umoci raw unpack`` gives."""
    layout, tag = images["two"].removeprefix("oci:").rsplit(":", 1)
    subprocess.run(["umoci", "raw", "unpack", "--image", f"{layout}:{tag}", str(tmp_path / "umoci")],
                   check=True, capture_output=True)
    by_layout = ImageCache(tmp_path / "a").get(images["two"])
    by_own = ImageCache(tmp_path / "b").get(images["two_archive"])
    docker = ImageCache(tmp_path / "c").get(images["two_docker"])
    assert by_layout.digest == by_own.digest != docker.digest  # docker: the config's digest
    assert [e["unpacker"] for e in ImageCache(tmp_path / "a").list()] == ["builtin"]
    expected = tree(tmp_path / "umoci")
    assert "opt/opq/new" in expected and "opt/opq/old" not in expected
    assert "opt/opq/deep/new2" in expected and "opt/opq/deep/old2" not in expected
    assert tree(Path(by_layout.rootfs)) == expected
    assert tree(Path(by_own.rootfs)) == expected
    assert tree(Path(docker.rootfs)) == expected
    assert by_own.config["env"]["HMT_IMAGE_VAR"] == "from-image"
    assert (by_own.config["workdir"], by_own.config["user"]) == ("/srv/app", "1000:1000")


async def test_two_profiles_two_images_in_one_backend(make_backend, images, cache_dir):
    base = SandboxConfig(**{**SMALL, "name": "base", "image": images["base"], "max_sandboxes": 1})
    two = SandboxConfig(**{**SMALL, "name": "two", "image": images["two_docker"],
                           "max_sandboxes": 1})
    plain = SandboxConfig(**{**SMALL, "name": "host", "max_sandboxes": 1})
    backend = await make_backend(profiles={"base": base, "two": two, "host": plain},
                                 default_profile="host")
    a = await backend.acquire("a", profile="base")
    b = await backend.acquire("b", profile="two")
    h = await backend.acquire("h", profile="host")
    ra = await bash(backend, a, "cat /etc/removed.txt; ls /opt/opq | grep -v deep")
    rb = await bash(backend, b, "cat /etc/removed.txt 2>&1; ls /opt/opq | grep -v deep")
    rh = await bash(backend, h, "test -x /usr/bin/python3 && echo host")
    assert ra.output == "deleted by the upper layer\nold\n"
    assert rb.output == "cat: can't open '/etc/removed.txt': No such file or directory\nnew\n"
    assert rh.output == "host\n"
    assert image_status(backend)["cached"] == 2


async def test_a_second_backend_reuses_the_cache(make_backend, images, cache_dir):
    first = await make_backend(image=images["two_archive"])
    await bash(first, await first.acquire("t"), "true")
    before = image_status(first)["counters"]
    second = await make_backend(image=images["two_archive"], name="second")
    r = await bash(second, await second.acquire("t"), "cat /usr/share/hmt/marker")
    assert r.output == "from the image\n"
    after = image_status(second)["counters"]
    assert after["unpacks"] == before["unpacks"] == 1, (before, after)
    assert after["hits"] > before["hits"], (before, after)
    assert len(ImageCache(cache_dir).list()) == 1


def bad_image(kind: str, images: dict[str, str], tmp_path: Path) -> tuple[str, str]:
    """An image string that cannot be used, and the cause its error must name."""
    if kind == "missing":
        return f"oci:{tmp_path}/no-such-layout", "does not exist"
    if kind == "tag":
        return f"oci:{images['layout']}:nope", "no tag 'nope'"
    if kind == "host-root":
        return "dir:/", "leave 'image' unset"
    if kind == "corrupt":
        layout = tmp_path / "broken"
        shutil.copytree(images["layout"], layout)
        blobs = sorted((layout / "blobs/sha256").iterdir(), key=lambda p: -p.stat().st_size)
        data = bytearray(blobs[0].read_bytes())  # the biggest blob: busybox's layer
        data[len(data) // 2] ^= 0xFF
        blobs[0].write_bytes(bytes(data))
        shutil.make_archive(str(tmp_path / "broken"), "tar", layout)
        return f"oci-archive:{tmp_path}/broken.tar:two", "layer 1/3"
    # A docker archive's uncompressed layers: checked against the config's diff_ids.
    data = Path(images["two_docker"].split(":", 1)[1]).read_bytes()
    assert data.count(b"hello from the workdir") == 1
    (tmp_path / "broken.docker.tar").write_bytes(
        data.replace(b"hello from the workdir", b"hello from the w0rkdir"))
    return f"docker-archive:{tmp_path}/broken.docker.tar", "is corrupt"


@pytest.mark.parametrize("kind", ["missing", "tag", "host-root", "corrupt", "corrupt-docker"])
async def test_missing_or_corrupt_image_fails_start_naming_it(make_backend, images, cache_dir,
                                                             tmp_path, kind):
    image, cause = bad_image(kind, images, tmp_path)
    backend = await make_backend(image=image, start=False)
    with pytest.raises(SandboxStartError) as err:
        await backend.start()
    assert isinstance(err.value, ImageError) or isinstance(err.value.__cause__, ImageError)
    assert image in str(err.value) and cause in str(err.value), str(err.value)
    cache = ImageCache(cache_dir)
    assert cache.list() == []  # nothing half-unpacked is kept, or used
    assert not any((cache_dir / "tmp").iterdir()) if (cache_dir / "tmp").exists() else True


def test_registry_reference_without_tools_names_them(tmp_path):
    with pytest.raises(ImageError) as err:
        ImageCache(tmp_path).get("python:3.11", tool_path=str(tmp_path))
    text = str(err.value)
    assert "'python:3.11'" in text and "skopeo, podman, docker" in text, text
    assert "apt-get install skopeo" in text and "docker-archive:" in text, text


async def test_registry_pull_failure_fails_start_saying_what_each_tool_said(
        make_backend, cache_dir, monkeypatch):
    """skopeo (and docker, when installed) are tried; with no registry they fail."""
    monkeypatch.setenv("HERMES_MODAL_TOOL_REGISTRY_IMAGES", "pull")  # conftest: "host"
    backend = await make_backend(image="registry.invalid/hmt/none:1", start=False)
    with pytest.raises(ImageError) as err:
        await backend.start()
    text = str(err.value)
    assert "'registry.invalid/hmt/none:1' could not be pulled" in text, text
    assert "skopeo: " in text, text


async def test_slot_writes_stay_in_the_slot_and_never_reach_the_image(make_backend, images,
                                                                      cache_dir):
    backend = await make_backend(image=images["base"])
    s0 = await backend.acquire("a")
    s1 = await backend.acquire("b")
    r = await bash(backend, s0, "echo changed > /usr/share/hmt/marker; rm /etc/os-release; "
                   "touch /bin/new; cat /usr/share/hmt/marker")
    assert r.output == "changed\n", r.output
    r = await bash(backend, s1, "cat /usr/share/hmt/marker; ls /bin/new 2>&1; grep -c ID= "
                   "/etc/os-release")
    assert r.output == "from the image\nls: /bin/new: No such file or directory\n2\n", r.output
    [entry] = ImageCache(cache_dir).list()
    rootfs = Path(entry["path"])
    assert (rootfs / "usr/share/hmt/marker").read_text() == "from the image\n"
    assert (rootfs / "etc/os-release").exists() and not (rootfs / "bin/new").exists()
    await backend.release(s0)
    s0 = await backend.acquire("c")
    r = await bash(backend, s0, "cat /usr/share/hmt/marker")
    assert r.output == "from the image\n"


def test_cli_images_list_and_prune(images, tmp_path):
    cache = ImageCache(tmp_path)
    cache.get(images["two_docker"])
    runner = CliRunner()
    listed = runner.invoke(cli_main, ["images", "list", "--cache-dir", str(tmp_path)])
    assert listed.exit_code == 0 and "1 image(s)" in listed.output, listed.output
    held = cache.hold(cache.list()[0]["digest"])  # a running sandbox uses it
    kept = runner.invoke(cli_main, ["images", "prune", "--cache-dir", str(tmp_path)])
    assert kept.exit_code == 0 and "0 image(s) removed, 1 kept" in kept.output, kept.output
    held.close()
    (tmp_path / "tmp" / "sha256-0123.interrupted").mkdir()  # an unpack that crashed
    pruned = runner.invoke(cli_main, ["images", "prune", "--cache-dir", str(tmp_path)])
    assert "1 image(s) removed, 0 kept" in pruned.output, pruned.output
    assert cache.list() == [] and list((tmp_path / "tmp").iterdir()) == []


async def test_modal_driver_names_a_local_source_it_cannot_use(make_backend, modal_server,
                                                               tmp_path):
    """The Modal driver keeps pulling registry references (Image.from_registry); a file on
    this machine gets a clear error instead of a failed remote build."""
    image = f"docker-archive:{tmp_path}/image.tar"
    backend = await make_backend(driver="modal", image=image, start=False)
    with pytest.raises(ImageError) as err:
        await backend.start()
    assert image in str(err.value) and "registry" in str(err.value), str(err.value)


def test_two_backends_pulling_one_image_at_once_unpack_it_once(images, tmp_path):
    """Two caches on one directory (two backends, here two threads; the lock is a file
    lock, so processes too) ask for the same image at the same time."""
    results, errors = [], []

    def get() -> None:
        try:
            results.append(ImageCache(tmp_path).get(images["two_docker"]))
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=get) for _ in range(3)]
    before = ImageCache(tmp_path).counters
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = ImageCache(tmp_path).counters
    assert not errors, errors
    assert len({r.rootfs for r in results}) == 1
    assert after["unpacks"] - before["unpacks"] == 1 and after["hits"] - before["hits"] == 2


def test_cli_exec_on_an_image_profile_shows_progress(images, tmp_path, monkeypatch):
    monkeypatch.setenv("HERMES_MODAL_TOOL_IMAGE_CACHE", str(tmp_path / "cache"))
    profiles = tmp_path / "profiles.yaml"
    profiles.write_text(f"profiles:\n  img:\n    image: {images['two_archive']}\n"
                        "    slots_per_sandbox: 1\n    max_sandboxes: 1\n")
    proc = subprocess.run([str(Path(sys.executable).with_name("hermes-modal-tool")), "exec",
                           "--profiles-file", str(profiles), "--profile", "img", "--",
                           "cat /etc/os-release | head -1; pwd"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == 'PRETTY_NAME="hmt test image"\n/srv/app\n', proc.stdout
    assert "layer 1/3" in proc.stderr and "layer 3/3" in proc.stderr, proc.stderr


def test_image_progress_is_a_bar_on_a_terminal_and_lines_elsewhere():
    """The CLI's image progress handler: per-layer records (``image_step``) drive a rich
    progress bar per image on a terminal; without a terminal the lines are printed."""
    import io
    import logging

    from rich.console import Console

    from hermes_modal_tool.cli._image_progress import ImageProgress

    def run(terminal: bool) -> str:
        out = io.StringIO()
        handler = ImageProgress(Console(file=out, force_terminal=terminal, width=100))
        log = logging.getLogger("hermes_modal_tool.images.test-progress")
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
        try:
            log.info("image demo:1: pulling")  # no count: a line either way
            for i in range(3):
                log.info("image demo:1: layer %d/3", i + 1, extra={"image": "demo:1", "image_step": (i, 3)})
            log.info("image demo:1: unpacked", extra={"image": "demo:1", "image_step": (3, 3)})
        finally:
            log.removeHandler(handler)
        assert handler.progress is None  # the bar is closed once every layer is in
        return out.getvalue()

    plain = run(terminal=False)
    assert "hermes-modal-tool: image demo:1: layer 2/3" in plain and "unpacking" not in plain
    bar = run(terminal=True)
    assert "unpacking demo:1" in bar and "3/3" in bar and "layer 2/3" not in bar, bar
    assert "hermes-modal-tool: image demo:1: pulling" in bar
