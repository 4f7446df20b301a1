import pytest

from orbit_runtime.atomic_dir import atomic_directory


def test_replaces_on_success_and_leaves_old_version_on_failure(tmp_path):
    final = tmp_path / "v1"
    with atomic_directory(final) as staging:
        (staging / "a.txt").write_text("one")
        assert not final.exists()  # readers never see a half-written directory
    assert (final / "a.txt").read_text() == "one"

    with pytest.raises(RuntimeError), atomic_directory(final) as staging:
        (staging / "a.txt").write_text("two")
        raise RuntimeError("disk full")
    assert (final / "a.txt").read_text() == "one"
    assert [p.name for p in tmp_path.iterdir()] == ["v1"]  # no staging left behind
