"""HostFS never reaches outside --root: every path resolves beneath it as if it were ``/``
(openat2's RESOLVE_IN_ROOT), writes refuse links that leave it. The same cases run against
both resolvers, the kernel's openat2 and the component walk, and must give the same answers."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from gpu_tune.errors import HostError
from gpu_tune.host.fs import HostFS
from gpu_tune.host.resolve import MAX_SYMLINKS, Openat2Resolver
from tests import skips


def _openat2_here() -> bool:
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY)
    try:
        Openat2Resolver(fd)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


RESOLVERS = ["walk", pytest.param("openat2", marks=skips.skipif("no-openat2", not _openat2_here(),
                                                                     "no openat2 in this kernel"))]


@pytest.fixture(params=RESOLVERS)
def resolver(request) -> str:
    return request.param


@pytest.fixture
def tree(tmp_path) -> tuple[Path, Path]:
    """(root, outside): a root with proc/ and sys/, and an outside folder holding files that a
    link inside the root names by their real path or by a climbing relative path."""
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    for d in ("proc/sys/vm", "sys/kernel/mm", "etc", "usr/lib", "var/lib"):
        (root / d).mkdir(parents=True)
    outside.mkdir()
    (outside / "secret").write_text("OUTSIDE\n")
    # the twin beneath the root of the outside file's real path: where an absolute link means
    twin = root / str(outside / "secret").lstrip("/")
    twin.parent.mkdir(parents=True)
    twin.write_text("TWIN\n")
    (root / "outside").mkdir()
    (root / "outside/secret").write_text("CLAMPED\n")
    (root / "usr/lib/real").write_text("REAL\n")
    # sysfs's own relative links
    dev = root / "sys/devices/pci0000:00/0000:00:01.0"
    dev.mkdir(parents=True)
    (dev / "vendor").write_text("0x10de\n")
    (root / "sys/bus/pci/devices").mkdir(parents=True)
    os.symlink("../../../devices/pci0000:00/0000:00:01.0", root / "sys/bus/pci/devices/0000:00:01.0")
    # links that leave the root by their text
    os.symlink(str(outside / "secret"), root / "etc/abs")                 # absolute
    os.symlink("../../../../outside/secret", root / "proc/sys/vm/swappiness")  # climbs above root
    os.symlink("/usr/lib/real", root / "etc/abs-in-root")                # absolute, meant in-root
    os.symlink(str(outside), root / "sys/kernel/mm/transparent_hugepage")  # a symlinked folder
    os.symlink("/", root / "etc/slash")
    os.symlink("loop-b", root / "etc/loop-a")
    os.symlink("loop-a", root / "etc/loop-b")
    os.symlink("/nowhere/at/all", root / "etc/dangling")
    return root, outside


def test_the_cases_lead_outside_when_followed_naively(tree):
    """The fixture is meaningful: the ordinary resolution of these links leaves the root."""
    root, outside = tree
    assert (root / "etc/abs").read_text() == "OUTSIDE\n"
    assert (root / "proc/sys/vm/swappiness").read_text() == "OUTSIDE\n"
    assert (root / "sys/kernel/mm/transparent_hugepage/secret").read_text() == "OUTSIDE\n"


def test_reads_resolve_beneath_the_root(tree, resolver):
    root, outside = tree
    fs = HostFS(root, resolver=resolver)
    assert fs.resolver == resolver
    # an absolute link means the same path beneath the root
    assert fs.read_value("/etc/abs") == "TWIN"
    assert fs.read_value("/etc/abs-in-root") == "REAL"
    # '..' stops at the root
    assert fs.read_value("/proc/sys/vm/swappiness") == "CLAMPED"
    # a symlinked folder is followed beneath the root too
    assert fs.read_value("/sys/kernel/mm/transparent_hugepage/secret") == "TWIN"
    assert fs.listdir("/sys/kernel/mm/transparent_hugepage") == ["secret"]
    assert fs.realpath("/sys/kernel/mm/transparent_hugepage/secret") == f"{outside}/secret"
    # sysfs's relative links keep working
    assert fs.read_value("/sys/bus/pci/devices/0000:00:01.0/vendor") == "0x10de"
    assert fs.realpath("/sys/bus/pci/devices/0000:00:01.0") == "/sys/devices/pci0000:00/0000:00:01.0"
    assert fs.is_dir("/sys/bus/pci/devices/0000:00:01.0")
    # a link to / is the root
    assert "proc" in fs.listdir("/etc/slash") and fs.is_dir("/etc/slash")
    assert fs.read_value("/etc/slash/usr/lib/real") == "REAL"


def test_missing_loops_and_dotdot(tree, resolver):
    root, _ = tree
    fs = HostFS(root, resolver=resolver)
    assert not fs.exists("/etc/dangling") and fs.read_optional("/etc/dangling") is None
    assert fs.listdir("/etc/dangling") == []
    with pytest.raises(HostError) as loop:
        fs.read_text("/etc/loop-a")
    assert loop.value.errno == errno.ELOOP
    with pytest.raises(HostError, match="'..' is not allowed"):
        fs.read_text("/proc/../../outside/secret")


def test_too_many_links_is_eloop(tmp_path, resolver):
    root = tmp_path / "root"
    (root / "proc").mkdir(parents=True)
    (root / "sys").mkdir()
    (root / "end").write_text("end\n")
    os.symlink("/end", root / f"l{MAX_SYMLINKS}")
    for i in range(MAX_SYMLINKS):
        os.symlink(f"l{i + 1}", root / f"l{i}")
    fs = HostFS(root, resolver=resolver)
    assert fs.read_value(f"/l{1}") == "end"  # 40 links: the kernel's limit, still allowed
    with pytest.raises(HostError) as exc:
        fs.read_value("/l0")  # 41
    assert exc.value.errno == errno.ELOOP


def test_a_read_error_names_the_link_that_leaves_the_root(tree, resolver):
    root, outside = tree
    (root / str(outside / "secret").lstrip("/")).unlink()  # no twin: the in-root reading is missing
    fs = HostFS(root, resolver=resolver)
    with pytest.raises(HostError) as exc:
        fs.read_text("/etc/abs")
    assert f"the symlink /etc/abs -> {outside}/secret leads outside --root" in str(exc.value)


@pytest.mark.parametrize("path, link", [
    ("/etc/abs", "/etc/abs"),
    ("/proc/sys/vm/swappiness", "/proc/sys/vm/swappiness"),
    ("/sys/kernel/mm/transparent_hugepage/secret", "/sys/kernel/mm/transparent_hugepage"),
    ("/etc/abs-in-root", "/etc/abs-in-root"),
])
def test_writes_through_a_link_that_leaves_the_root_are_refused(tree, resolver, path, link):
    root, outside = tree
    fs = HostFS(root, resolver=resolver)
    before = {p: p.read_bytes() for p in (*outside.rglob("*"), *root.rglob("*")) if p.is_file() and not p.is_symlink()}
    with pytest.raises(HostError) as exc:
        fs.write_text(path, "0")
    assert exc.value.errno == errno.EXDEV
    assert f"not written: the symlink {link} -> " in str(exc.value) and "leads outside --root" in str(exc.value)
    with pytest.raises(HostError, match=f"the symlink {link} -> "):
        fs.write_bytes_exact(path, b"0\n")
    after = {p: p.read_bytes() for p in (*outside.rglob("*"), *root.rglob("*")) if p.is_file() and not p.is_symlink()}
    assert after == before


def test_writes_through_relative_links_beneath_the_root_work(tree, resolver):
    root, _ = tree
    fs = HostFS(root, resolver=resolver)
    fs.write_text("/sys/bus/pci/devices/0000:00:01.0/vendor", "0x8086")
    assert (root / "sys/devices/pci0000:00/0000:00:01.0/vendor").read_text() == "0x8086"


def test_state_files_never_land_outside(tree, resolver):
    """allocator.env, the journal and the lock: a symlinked etc/gpu-tune or var/lib/gpu-tune
    (absolute, or climbing out) is refused; nothing is created on either side of the link."""
    root, outside = tree
    os.symlink(str(outside), root / "etc/gpu-tune")
    os.symlink("../../../outside", root / "var/lib/gpu-tune")
    fs = HostFS(root, resolver=resolver)
    listing = sorted(p.name for p in outside.iterdir())
    with pytest.raises(HostError, match="the symlink /etc/gpu-tune -> .* leads outside --root"):
        fs.write_file_atomic("/etc/gpu-tune/allocator.env", b"LD_PRELOAD=x\n")
    with pytest.raises(HostError, match="the symlink /var/lib/gpu-tune -> ../../../outside leads outside"):
        fs.write_file_atomic("/var/lib/gpu-tune/journal.json", b"{}\n")
    with pytest.raises(HostError, match="the symlink /var/lib/gpu-tune -> "):
        os.close(fs.open_lock_file("/var/lib/gpu-tune/lock"))
    with pytest.raises(HostError, match="the symlink /etc/gpu-tune -> "):
        fs.remove("/etc/gpu-tune/secret")
    assert not fs.rmdir_if_empty("/etc/gpu-tune/x")
    assert sorted(p.name for p in outside.iterdir()) == listing
    assert (outside / "secret").read_text() == "OUTSIDE\n"
    assert not (root / "outside/allocator.env").exists() and not (root / "outside/lock").exists()


def test_atomic_write_refuses_a_symlink_in_place_of_the_file(tree, resolver):
    root, outside = tree
    (root / "etc/gpu-tune").mkdir()
    os.symlink("../../usr/lib/real", root / "etc/gpu-tune/allocator.env")
    fs = HostFS(root, resolver=resolver)
    with pytest.raises(HostError, match="it is a symlink"):
        fs.write_file_atomic("/etc/gpu-tune/allocator.env", b"x\n")
    assert (root / "usr/lib/real").read_text() == "REAL\n"
    assert os.readlink(root / "etc/gpu-tune/allocator.env") == "../../usr/lib/real"


def test_atomic_write_creates_folders_beneath_the_root(tree, resolver):
    root, _ = tree
    os.symlink("../usr/lib", root / "etc/libs")  # a relative link that stays beneath the root
    fs = HostFS(root, resolver=resolver)
    fs.write_file_atomic("/var/lib/gpu-tune/journal.json", b"{}\n", mode=0o600)
    assert (root / "var/lib/gpu-tune/journal.json").read_bytes() == b"{}\n"
    assert (root / "var/lib/gpu-tune/journal.json").stat().st_mode & 0o777 == 0o600
    fs.write_file_atomic("/etc/libs/new/file", b"n\n")
    assert (root / "usr/lib/new/file").read_bytes() == b"n\n"
    assert [p.name for p in (root / "usr/lib/new").iterdir()] == ["file"]  # no temp file left
    fs.remove("/etc/libs/new/file")
    assert fs.rmdir_if_empty("/etc/libs/new") and not (root / "usr/lib/new").exists()
    fd = fs.open_lock_file("/var/lib/gpu-tune/lock")
    os.close(fd)
    assert (root / "var/lib/gpu-tune/lock").exists()


def test_both_resolvers_agree(tree):
    """One table of operations, answered by each resolver: identical results."""
    if not _openat2_here():
        skips.condition("no-openat2", "no openat2 in this kernel")
    root, outside = tree
    paths = ["/", "/etc/abs", "/etc/abs-in-root", "/proc/sys/vm/swappiness", "/etc/slash", "/etc/slash/etc/abs",
             "/sys/kernel/mm/transparent_hugepage", "/sys/kernel/mm/transparent_hugepage/secret",
             "/sys/bus/pci/devices/0000:00:01.0/vendor", "/etc/dangling", "/etc/loop-a", "/nope", "/usr/lib/real/x"]

    def answers(fs: HostFS):
        out = []
        for p in paths:
            out.append((p, fs.exists(p), fs.is_dir(p), fs.read_optional(p), fs.listdir(p) if fs.is_dir(p) else None,
                        fs.realpath(p) if fs.exists(p) else None, fs.is_kernel_file(p)))
            for write in (lambda: fs.write_text(p, "x"),):
                try:
                    write()
                    out.append((p, "written"))
                except HostError as exc:
                    out.append((p, exc.errno, str(exc)))
        return out

    def fresh():
        return {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and not p.is_symlink()}

    snap = fresh()
    walk = answers(HostFS(root, resolver="walk"))
    for p, data in snap.items():
        p.write_bytes(data)
    kernel = answers(HostFS(root, resolver="openat2"))
    assert walk == kernel


def test_auto_uses_openat2_where_the_kernel_has_it(tree):
    root, _ = tree
    assert HostFS(root).resolver == ("openat2" if _openat2_here() else "walk")
    assert HostFS("/").resolver == "plain"


def test_kernel_files_are_told_from_regular_files(tree, resolver):
    root, _ = tree
    fs = HostFS(root, resolver=resolver)
    assert not fs.is_kernel_file("/usr/lib/real")
    if Path("/proc/sys/vm/swappiness").exists():
        assert HostFS("/").is_kernel_file("/proc/sys/vm/swappiness")
    if Path("/proc/self/stat").exists():
        os.symlink("/proc", root / "realproc")  # means <root>/proc beneath the root: a plain folder
        assert not fs.is_kernel_file("/realproc/sys/vm/swappiness")


@pytest.mark.parametrize("code", [errno.ENOSYS, errno.EPERM])
def test_auto_falls_back_to_the_walk_without_openat2(tree, monkeypatch, code):
    """An old kernel (ENOSYS) or a seccomp profile that refuses openat2 (EPERM): the walk."""
    import gpu_tune.host.fs as hostfs

    root, _ = tree

    def refused(self, root_fd):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(hostfs.Openat2Resolver, "__init__", refused)
    fs = HostFS(root)
    assert fs.resolver == "walk"
    assert fs.read_value("/etc/abs") == "TWIN" and fs.read_value("/proc/sys/vm/swappiness") == "CLAMPED"
    from gpu_tune.errors import InputError
    with pytest.raises(InputError, match="openat2 is not available"):
        HostFS(root, resolver="openat2")
