"""Datasets and the sampler: held-out prompts never trained on, files with clear errors, exact order."""

import json

import pytest

from orbit_runtime.config.prompt_data import FileData, SyntheticArithmeticData
from orbit_runtime.data.datasets import arithmetic_splits, file_splits
from orbit_runtime.data.sampler import PromptSampler
from orbit_runtime.errors import OrbitError


def test_arithmetic_validation_is_disjoint_from_training():
    splits = arithmetic_splits(SyntheticArithmeticData(max_value=9, train_size=500, validation_size=20, seed=3))
    assert len(splits.train) == 500 and len(splits.validation) == 20
    assert not {e.prompt for e in splits.validation} & {e.prompt for e in splits.train}
    example = splits.validation[0]
    a, b = example.prompt.removeprefix("What is ").removesuffix("?").split("+")
    assert example.answer == str(int(a) + int(b))
    again = arithmetic_splits(SyntheticArithmeticData(max_value=9, train_size=500, validation_size=20, seed=3))
    assert again == splits


def test_arithmetic_too_small_space_is_an_error():
    with pytest.raises(OrbitError, match="leaves none to train on"):
        arithmetic_splits(SyntheticArithmeticData(max_value=2, validation_size=9))


def test_jsonl_with_template_and_errors(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps({"q": f"{i}+1", "answer": i + 1}) for i in range(10)))
    splits = file_splits(FileData(type="jsonl", path=str(path), template="Compute {q}.", validation_size=3))
    assert [e.prompt for e in splits.validation] == ["Compute 7+1.", "Compute 8+1.", "Compute 9+1."]
    assert splits.train[0].answer == "1"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(OrbitError, match="bad.jsonl:2: invalid JSON"):
        file_splits(FileData(type="jsonl", path=str(bad), validation_size=1))
    with pytest.raises(OrbitError, match="no field 'prompt'"):
        file_splits(FileData(type="jsonl", path=str(path), validation_size=1))


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "answer": ["1", "2", "3"]}), tmp_path / "d.parquet")
    splits = file_splits(FileData(type="parquet", path=str(tmp_path / "d.parquet"), validation_size=1))
    assert [e.prompt for e in splits.train] == ["a", "b"] and splits.validation[0].answer == "3"


def test_sampler_is_deterministic_and_resumable():
    straight = PromptSampler(size=5, seed=1)
    first = [straight.next_batch(3) for _ in range(4)]
    assert sorted(first[0] + first[1][:2]) == [0, 1, 2, 3, 4]  # epoch 0 is a permutation
    resumed = PromptSampler(size=5, seed=1)
    resumed.next_batch(3)
    resumed.next_batch(3)
    restored = PromptSampler.from_state(resumed.state_dict())
    assert [restored.next_batch(3) for _ in range(2)] == first[2:]
