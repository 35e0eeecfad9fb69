"""The host serves only its model's files, in bounded ranges; capability frames are checked."""

from __future__ import annotations

import hashlib

import pytest

from kafilad.modelinfo import read_model_info
from kafilad.errors import RemoteProtocolError
from kafilad.proto.control import decode_control
from kafilad.node.shards.modelfiles import FETCH_MAX_BYTES, ModelFiles


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from kafilad.executor.synth import synthesize_model
    d = synthesize_model(tmp_path_factory.mktemp("m") / "synth", num_hidden_layers=3, hidden_size=32)
    return ModelFiles(str(d), read_model_info(d))


def test_ranges_outside_the_model_are_refused(model):
    assert model.check_range("model.safetensors", 0, 8) is None
    assert model.read("model.safetensors", 0, 8) == (model.model_dir / "model.safetensors").read_bytes()[:8]
    assert "not a file of this model" in model.check_range("../../etc/passwd", 0, 8)
    assert "not a file of this model" in model.check_range("sub/model.safetensors", 0, 8)
    assert "not a file of this model" in model.check_range(5, 0, 8)
    assert "not a valid range" in model.check_range("model.safetensors", -1, 8)
    assert "not a valid range" in model.check_range("model.safetensors", 0, FETCH_MAX_BYTES + 1)
    assert "not a valid range" in model.check_range("model.safetensors", "0", 8)
    assert "missing on the host" in model.check_range("vocab.json", 0, 8)


def test_tables_hash_exactly_the_stage_tensors(model):
    table = model.tensor_table(1, 2, False)
    names = {t.name for t in model.info.stage_tensors(1, 2, False)}
    assert {e["name"] for e in table} == names and all(".layers.1." in n for n in names)
    for e in table:
        data = model.read(e["file"], e["offset"], e["nbytes"])
        assert hashlib.sha256(data).hexdigest() == e["sha256"]
    files = {e["name"] for e in model.file_table()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= files


def test_capability_frames_are_type_checked():
    ok = decode_control({"t": "capability", "memory_bytes": 10**9, "bandwidth_Bps": 5e9, "step_overhead_s": 1e-4,
                         "nat_class": "C", "rendezvous_rtt_ms": 12.5}).as_record()
    assert ok == {"memory_bytes": 10**9, "bandwidth_Bps": 5e9, "step_overhead_s": 1e-4,
                  "rendezvous_rtt_ms": 12.5, "nat_class": "C", "dtype": None, "bandwidth_source": None,
                  "fallback_dtype": None, "backend": None, "batch_row_cost": None}
    for bad in ({"memory_bytes": "lots"}, {"memory_bytes": 0}, {"memory_bytes": True},
                {"memory_bytes": 1, "bandwidth_Bps": float("nan")}, {"memory_bytes": 1, "nat_class": "X"},
                {"memory_bytes": 1, "step_overhead_s": -1}):
        with pytest.raises(RemoteProtocolError, match="malformed capability frame"):
            decode_control({"t": "capability", **bad})


def test_a_range_past_the_end_of_a_file_is_refused(model):
    size = (model.model_dir / "model.safetensors").stat().st_size
    assert model.check_range("model.safetensors", size - 8, 8) is None
    assert "past the end of 'model.safetensors'" in model.check_range("model.safetensors", size - 7, 8)
    assert "past the end" in model.check_range("model.safetensors", 2 ** 63, 0)  # seek() would raise


from hypothesis import given, settings, strategies as st  # noqa: E402

_HOSTILE_INTS = st.one_of(st.integers(-2 ** 64, 2 ** 64), st.sampled_from([0, 1, 2 ** 62, 2 ** 63, FETCH_MAX_BYTES]),
                          st.booleans(), st.floats(allow_nan=True), st.text(max_size=3), st.none())


@settings(max_examples=300, deadline=None)
@given(fname=st.one_of(st.sampled_from(["model.safetensors", "config.json", "../model.safetensors", "", ".",
                                        "vocab.json"]), st.text(max_size=12), st.integers(), st.none()),
       offset=_HOSTILE_INTS, length=_HOSTILE_INTS)
def test_any_fetch_is_either_refused_with_a_reason_or_served_whole(model, fname, offset, length):
    problem = model.check_range(fname, offset, length)
    if problem is None:
        assert model.read(fname, offset, length) == (model.model_dir / fname).read_bytes()[offset:offset + length]
        assert len(model.read(fname, offset, length)) == length
    else:
        assert isinstance(problem, str) and problem


def test_a_draft_model_is_served_whole_and_nothing_else_of_its_directory(model, tmp_path):
    """`host --draft-model` (issue 24 item 1): a member head fetches the draft model's weights, index,
    config and tokenizer files as `draft/NAME` (proto_spec 05 §2.1); no other file of its directory."""
    import shutil
    from kafilad.node.shards.modelfiles import DraftFiles
    d = tmp_path / "draft"
    shutil.copytree(model.model_dir, d)
    (d / "notes.txt").write_text("private")
    (d / "sub").mkdir()
    (d / "sub" / "model.safetensors").write_bytes(b"x" * 16)
    files = DraftFiles(str(d), state_dir=tmp_path)
    table = files.file_table()
    names = [e["name"] for e in table]
    assert names == sorted(names) and "model.safetensors" in names and "config.json" in names
    assert "notes.txt" not in names and not any("/" in n for n in names)
    for e in table:
        data = (d / e["name"]).read_bytes()
        assert e["nbytes"] == len(data) and e["sha256"] == hashlib.sha256(data).hexdigest()
        assert files.check_range(e["name"], 0, min(len(data), FETCH_MAX_BYTES)) is None
    assert files.read("model.safetensors", 0, 8) == (d / "model.safetensors").read_bytes()[:8]
    for bad in ("notes.txt", "sub/model.safetensors", "../draft/model.safetensors", None):
        assert "not a file of the draft model" in files.check_range(bad, 0, 1)
    assert "past the end" in files.check_range("config.json", 0, (d / "config.json").stat().st_size + 1)
    assert "not a valid range" in files.check_range("config.json", -1, 1)
