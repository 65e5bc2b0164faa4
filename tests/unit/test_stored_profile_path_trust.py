"""A stored snapshot that names a profile *path* is loaded by the control plane only where the
operator could have given that path (control.profile_trust): the plane's own setting, or a regular
file only this user or root can change, outside the state directory. Otherwise whoever can write
current.json could set the base of every later change by editing a file of their own."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from flyserve.control import ControlPlane
from flyserve.control.errors import ControlIOError
from flyserve.control.profile_trust import stored_profile_refusal
from flyserve.control.rank import RankControl
from flyserve.control.repair import repair
from flyserve.control.snapshot import ConfigSnapshot
from flyserve.files.atomic import atomic_write
from flyserve.thresholds_files import load_profile, profile_path

SHIPPED = profile_path("gfx950")


@pytest.fixture
def plane(tmp_path: Path) -> ControlPlane:
    p = ControlPlane(tmp_path / "state", profile="gfx950", lead_s=0.0)
    p.apply_overrides({"min_seq_len": 3000}, actor="op")
    p.apply_overrides({"min_seq_len": 3100}, actor="op")
    assert p.snapshot().version == 2
    return p


def plant_profile(plane: ControlPlane, profile: Path, *, version: int = 3) -> None:
    """current.json (and its history entry) at the next version, laid over ``profile``: every layer
    check passes, the sha256 is right, only the profile's trust is in question."""
    base = load_profile(profile)
    snap = ConfigSnapshot.build(
        version=version, thresholds=base.merged({"min_seq_len": 3100}, source="overrides"), source="api",
        actor="forger", time=1.0, effective_step=0, profile=str(profile), overrides={"min_seq_len": 3100},
    )  # fmt: skip
    atomic_write(plane.state_dir.history_file(version), snap.to_json())
    atomic_write(plane.state_dir.current_json, snap.to_json())


def copy_profile(dest: Path, *, mode: int = 0o644) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(SHIPPED, dest)
    dest.chmod(mode)
    return dest


def test_a_profile_path_inside_the_state_directory_is_refused_and_repair_undoes_it(
    plane: ControlPlane,
) -> None:
    evil = copy_profile(plane.state_dir.path / "evil.yaml")
    plant_profile(plane, evil)
    with pytest.raises(ControlIOError, match="inside the state directory"):
        plane.store.read_current()
    assert plane.snapshot().version == 2  # the plane stands on the newest entry it believes
    report = repair(plane)
    assert report.version == 2 and any("damaged or forged" in a for a in report.actions), report
    assert json.loads(plane.state_dir.current_json.read_text())["profile"] == "gfx950"
    assert plane.apply_overrides({"min_seq_len": 3300}, actor="op").snapshot.profile == "gfx950"


@pytest.mark.parametrize("mode, folder_mode", [(0o666, 0o755), (0o644, 0o777)], ids=["file", "folder"])
def test_a_profile_path_others_can_change_is_refused(
    plane: ControlPlane, tmp_path: Path, mode: int, folder_mode: int
) -> None:
    profile = copy_profile(tmp_path / "elsewhere" / "site.yaml", mode=mode)
    profile.parent.chmod(folder_mode)  # 0777 without the sticky bit: anyone may swap the file
    plant_profile(plane, profile)
    with pytest.raises(ControlIOError, match="profile: the (profile file is group|folder holding)"):
        plane.store.read_current()
    assert plane.snapshot().version == 2


@pytest.mark.parametrize("target", ["/dev/zero", "gone.yaml"], ids=["device", "missing"])
def test_a_profile_path_to_a_device_or_nothing_is_refused_before_it_is_read(
    tmp_path: Path, target: str
) -> None:
    link = tmp_path / "profile.yaml"
    link.symlink_to(target)
    reason = stored_profile_refusal(str(link), own_profile="gfx950", state_dir=tmp_path / "state")
    assert reason in (
        "the profile path is not a regular file",
        "the profile path cannot be checked (No such file or directory)",
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
def test_a_profile_file_owned_by_another_user_is_refused(plane: ControlPlane, tmp_path: Path) -> None:
    profile = copy_profile(tmp_path / "elsewhere" / "site.yaml")
    os.chown(profile, 65534, 65534)
    plant_profile(plane, profile)
    with pytest.raises(ControlIOError, match="owned by another user"):
        plane.store.read_current()


def test_an_operator_profile_path_is_read_by_every_plane_and_rank(tmp_path: Path) -> None:
    """FLYSERVE_PROFILE=/etc/flyserve/site.yaml on the server: the CLI's plane (default profile) and
    a rank read the versions it publishes, and the next change is built from it."""
    site = copy_profile(tmp_path / "etc" / "site.yaml")
    server = ControlPlane(tmp_path / "state", profile=str(site), lead_s=0.0)
    server.reload(actor="startup", startup=True)
    cli = ControlPlane(tmp_path / "state", lead_s=0.0)
    assert cli.store.read_current().profile == str(site)
    changed = cli.apply_overrides({"min_seq_len": 3300}, actor="op").snapshot
    assert changed.profile == str(site) and changed.thresholds.min_seq_len == 3300
    rc = RankControl(server.state_dir, rank=0, profile="gfx950")
    assert rc.snapshot.version == changed.version


def test_a_configmap_style_symlinked_profile_passes(tmp_path: Path) -> None:
    """A Kubernetes ConfigMap mount: the file is reached through symlinks to a root-owned 0644 file."""
    data = copy_profile(tmp_path / "mount" / "..2026_12_03" / "site.yaml")
    (tmp_path / "mount" / "..data").symlink_to("..2026_12_03")
    (tmp_path / "mount" / "site.yaml").symlink_to("..data/site.yaml")
    link = tmp_path / "mount" / "site.yaml"
    assert link.resolve() == data.resolve()
    assert stored_profile_refusal(str(link), own_profile=None, state_dir=tmp_path / "state") is None


def test_the_planes_own_profile_path_is_believed_wherever_it_lives(tmp_path: Path) -> None:
    """The operator gave this process the path: its mode is the operator's business (the doctor's)."""
    site = copy_profile(tmp_path / "open" / "site.yaml", mode=0o666)
    assert stored_profile_refusal(str(site), own_profile=str(site), state_dir=tmp_path / "state") is None
    assert stored_profile_refusal(str(site), own_profile=None, state_dir=tmp_path / "state") is not None


def test_a_profile_name_is_not_checked_as_a_path(tmp_path: Path) -> None:
    assert stored_profile_refusal("gfx950", own_profile=None, state_dir=tmp_path) is None
    assert stored_profile_refusal(None, own_profile=None, state_dir=tmp_path) is None
