"""`nimble serve FOLDER`: a folder is a model repository, its `.nimble` files the models; what
does not fit is one line before Ray starts."""

import subprocess
import sys
from pathlib import Path

import pytest

from nimble.errors import ArtifactError
from nimble.model_files import MAX_REPOSITORY, repository

from ..conftest import SAMPLES

NIMBLE = str(Path(sys.executable).parent / "nimble")


def test_a_folder_gives_its_artifacts_in_name_order_and_nothing_else(tmp_path):
    models = tmp_path / "models"
    (models / "deeper").mkdir(parents=True)
    for name in ("resnet.nimble", "bert.nimble", "notes.txt", "bert.nimble.kernels", "deeper/vit.nimble"):
        (models / name).write_bytes(b"x")
    (models / "folder.nimble").mkdir()  # a folder named like an artifact is not one
    single = tmp_path / "gpt2.nimble"
    single.write_bytes(b"x")
    assert repository([models, single]) == [models / "bert.nimble", models / "resnet.nimble", single]
    assert repository([single]) == [single]  # a file stays as given, checked later as before


def test_a_folder_with_no_artifacts_or_too_many_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ArtifactError, match="no .nimble artifacts in it"):
        repository([tmp_path / "empty"])
    crowded = tmp_path / "crowded"
    crowded.mkdir()
    for i in range(MAX_REPOSITORY + 1):
        (crowded / f"m{i}.nimble").write_bytes(b"")
    with pytest.raises(ArtifactError, match=f"over the {MAX_REPOSITORY} one server takes"):
        repository([crowded])


@pytest.mark.parametrize("case", ["empty folder", "folder with --kernels", "same name twice"])
def test_serve_refuses_a_repository_it_cannot_serve_in_one_line_before_ray(tmp_path, case):
    models = tmp_path / "models"
    models.mkdir()
    args = [str(models)]
    if case != "empty folder":
        (models / "resnet.nimble").write_bytes(b"x")
    if case == "folder with --kernels":
        (tmp_path / "p.kernels").write_bytes(b"x")
        args += ["--kernels", str(tmp_path / "p.kernels")]
    if case == "same name twice":
        (tmp_path / "resnet.nimble").write_bytes(b"x")
        args += [str(tmp_path / "resnet.nimble")]
    done = subprocess.run([NIMBLE, "serve", *args, "--device", "cpu"], capture_output=True, text=True, timeout=120)
    says = {"empty folder": "no .nimble artifacts in it", "folder with --kernels": "cannot be matched to",
            "same name twice": "would both be model 'resnet'"}[case]
    assert done.returncode != 0 and says in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "starting Ray" not in done.stderr
    assert len([ln for ln in done.stderr.splitlines() if ln.strip()]) == 1, done.stderr


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    path = tmp_path_factory.mktemp("one") / "resnet.nimble"
    done = subprocess.run([NIMBLE, "compile", str(SAMPLES / "resnet.pt"), "-s", "1x3x32x32", "-o", str(path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return path


@pytest.mark.parametrize("flags, says", [
    (["--grpc-port", "70000"], "--grpc-port one from 0 (none) to 65535"),
    (["--port", "18123", "--grpc-port", "18123"], "--grpc-port 18123 is also --port or --metrics-port"),
    (["--replicas-per-gpu", "0"], "give 1 to 16 replicas per GPU"),
    (["--replicas-per-gpu", "17"], "give 1 to 16 replicas per GPU"),
    (["--timeline", "/proc/self/nimble-timeline"], "--timeline /proc/self/nimble-timeline: cannot make the folder"),
    (["--timeline", "/tmp", "--address", "auto"], "--timeline needs the replicas on this machine"),
])
def test_serve_refuses_bad_ports_and_replica_counts_in_one_line_before_ray(artifact, flags, says):
    done = subprocess.run([NIMBLE, "serve", str(artifact), *flags, "--device", "cpu"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and says in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "starting Ray" not in done.stderr
    assert len([ln for ln in done.stderr.splitlines() if ln.strip()]) == 1, done.stderr
