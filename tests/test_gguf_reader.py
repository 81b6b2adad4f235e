"""The GGUF reader: agrees with the gguf package (test-only oracle) on every fixture, refuses bad files with
specific messages, assembles split sets, and survives a property-based fuzz of its header/metadata parser."""

from __future__ import annotations

import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata.errors import StrataError
from strata.weights.gguf import GGUFError, GGUFFile, GGUFSet, ValueType, open_gguf
from strata.weights.gguf_map import weights_from_gguf
from strata.weights.gguf_writer import GGUFWriter, copy_gguf
from strata.weights.loader import load_weights
from tests.test_gguf_util import logits, patch_bytes, patch_tensor_type, prompt_ids


def _fixture_ggufs(fixtures_dir: Path) -> list[Path]:
    files = sorted(fixtures_dir.glob("*.gguf"))
    assert len(files) >= 12, files
    return files


def test_reader_matches_gguf_package(fixtures_dir):
    """Metadata values, tensor dims/types/offsets/sizes and the bytes themselves, for every fixture file (gguf
    0.19 predates ggml type 42, Q2_0, so that file is checked by the logits tests only)."""
    from gguf import GGMLQuantizationType, GGUFReader

    known = {int(t) for t in GGMLQuantizationType}
    for path in _fixture_ggufs(fixtures_dir):
        ours = GGUFFile(path)
        if any(i.type_id not in known for i in ours.tensors.values()):
            assert path.name == "tiny-Q2_0.gguf"
            continue
        ref = GGUFReader(path)
        assert ours.version == 3
        keys = [k for k in ref.fields if not k.startswith("GGUF.")]
        assert keys == list(ours.metadata), path.name
        for k in keys:
            assert ref.fields[k].contents() == ours.metadata[k], (path.name, k)
        assert [t.name for t in ref.tensors] == list(ours.tensors)
        for t in ref.tensors:
            info = ours.tensors[t.name]
            assert info.dims == tuple(int(d) for d in t.shape), t.name
            assert info.type_id == int(t.tensor_type) and info.offset == t.data_offset and info.nbytes == t.n_bytes
            assert info.shape == tuple(reversed(info.dims))
            assert np.array_equal(np.asarray(t.data).view(np.uint8).reshape(-1), ours.data(info).numpy()), t.name


def _copy(src: Path, dst: Path) -> Path:
    shutil.copyfile(src, dst)
    return dst


def test_truncated_files(fixtures_dir, tmp_path):
    src = fixtures_dir / "tiny-f32.gguf"
    raw = src.read_bytes()
    g = GGUFFile(src)
    for cut, needle in ((10, "truncated file (10 bytes"), (100, "truncated or corrupt file"),
                        (g.data_offset - 50, "truncated file"), (len(raw) - 1000, "truncated file: tensor")):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(raw[:cut])
        with pytest.raises(GGUFError, match=r".*") as e:
            GGUFFile(p)
        assert needle in str(e.value) and str(p) in str(e.value), (cut, str(e.value))
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match="truncated file"):
        load_weights(tmp_path / "empty.gguf")


def test_wrong_magic_and_version(fixtures_dir, tmp_path):
    src = fixtures_dir / "tiny-f32.gguf"
    p = _copy(src, tmp_path / "magic.gguf")
    patch_bytes(p, 0, b"GGML")
    with pytest.raises(GGUFError, match=r"not a GGUF file \(starts with b'GGML'"):
        GGUFFile(p)
    for version, msg in ((1, "GGUF version 1 is not supported"), (4, "unsupported GGUF version 4"),
                         (0x03000000, "big-endian GGUF files are not supported")):
        p = _copy(src, tmp_path / f"v{version}.gguf")
        patch_bytes(p, 4, struct.pack("<I", version))
        with pytest.raises(GGUFError, match=msg):
            GGUFFile(p)


def test_absurd_counts_and_lengths(fixtures_dir, tmp_path):
    src = fixtures_dir / "tiny-f32.gguf"
    p = _copy(src, tmp_path / "kv.gguf")
    patch_bytes(p, 16, struct.pack("<Q", 1 << 60))
    with pytest.raises(GGUFError, match=r"metadata count 1152921504606846976 is impossible"):
        GGUFFile(p)
    p = _copy(src, tmp_path / "nt.gguf")
    patch_bytes(p, 8, struct.pack("<Q", (1 << 64) - 1))
    with pytest.raises(GGUFError, match=r"tensor count \d+ is impossible"):
        GGUFFile(p)
    p = _copy(src, tmp_path / "strlen.gguf")
    patch_bytes(p, 24, struct.pack("<Q", 1 << 62))  # the first key's length
    with pytest.raises(GGUFError, match=r"metadata key 0 claims 4611686018427387904 bytes"):
        GGUFFile(p)
    # the length of the 512-entry token array
    raw = p.read_bytes()
    at = raw.find(b"tokenizer.ggml.tokens") + len(b"tokenizer.ggml.tokens") + 4 + 4
    p = _copy(src, tmp_path / "arr.gguf")
    patch_bytes(p, at, struct.pack("<Q", 1 << 40))
    with pytest.raises(GGUFError, match=r"array 'tokenizer.ggml.tokens' claims 1099511627776 strings"):
        GGUFFile(p)


def test_unknown_and_unsupported_quant_types(fixtures_dir, tmp_path):
    src = fixtures_dir / "tiny-f32.gguf"
    for type_id, msg in ((99, "unknown ggml type 99"), (15, r"ggml type 15 \(Q8_K\) is not supported"),
                         (1008, "unknown ggml type 1008")):  # strata's in-memory Q8_0_R8 is no file type
        p = _copy(src, tmp_path / f"t{type_id}.gguf")
        patch_tensor_type(p, "blk.0.ssm_out.weight", type_id)
        with pytest.raises(GGUFError, match=f"tensor 'blk.0.ssm_out.weight': {msg}"):
            load_weights(p)
    p = _copy(src, tmp_path / "width.gguf")
    patch_tensor_type(p, "blk.0.ssm_a", 8)  # a 4-wide Q8_0 row
    with pytest.raises(GGUFError, match="'blk.0.ssm_a' has row width 4, not a multiple of the Q8_0 block size 32"):
        GGUFFile(p)


def test_bad_alignment_and_duplicates(tmp_path):
    w = GGUFWriter()
    w.add("general.alignment", ValueType.UINT32, 24)
    w.add_tensor("a", (2, 4), 0, lambda: [torch.zeros(2, 4)])
    w.write(tmp_path / "align.gguf")
    with pytest.raises(GGUFError, match="general.alignment = 24 is not a power of two"):
        GGUFFile(tmp_path / "align.gguf")
    w = GGUFWriter()
    w.add_tensor("a", (2, 4), 0, lambda: [torch.zeros(2, 4)])
    w.add_tensor("a", (2, 4), 0, lambda: [torch.zeros(2, 4)])
    w.write(tmp_path / "dup.gguf")
    with pytest.raises(GGUFError, match="duplicate tensor name 'a'"):
        GGUFFile(tmp_path / "dup.gguf")


# ------------------------------------------------------------------------------------------- split sets

def test_split_set_loads_from_any_part(fixtures_dir, tmp_path):
    src = open_gguf(fixtures_dir / "tiny-f32.gguf")
    parts = copy_gguf(src, tmp_path / "tiny.gguf", split_max_tensors=40, first_part_metadata_only=True)
    assert [p.name for p in parts] == [f"tiny-0000{i}-of-00004.gguf" for i in range(1, 5)]
    assert not GGUFFile(parts[0]).tensors  # metadata-only first part
    ids = prompt_ids(fixtures_dir)[:16]
    ref = logits(load_weights(fixtures_dir / "tiny-f32.gguf"), ids)
    for part in (parts[0], parts[2]):
        gset = open_gguf(part)
        assert len(gset.parts) == 4 and len(gset.tensors) == 113
        assert torch.equal(logits(load_weights(part), ids), ref)


def test_split_set_missing_part(fixtures_dir, tmp_path):
    parts = copy_gguf(open_gguf(fixtures_dir / "tiny-f32.gguf"), tmp_path / "m.gguf", split_max_tensors=40)
    parts[2].unlink()
    for p in (parts[0], parts[1]):
        with pytest.raises(GGUFError, match=r"incomplete split set .*m-00001-of-00003.gguf: part 3 of 3 "
                                            r"\(m-00003-of-00003.gguf\) is missing"):
            load_weights(p)


def test_split_set_parts_of_two_models(fixtures_dir, tmp_path):
    f32 = open_gguf(fixtures_dir / "tiny-f32.gguf")
    for d in "abc":
        (tmp_path / d).mkdir()
    a = copy_gguf(f32, tmp_path / "a" / "x.gguf", split_max_tensors=58)
    b = copy_gguf(f32, tmp_path / "b" / "x.gguf", split_max_tensors=57)
    c = copy_gguf(f32, tmp_path / "c" / "x.gguf", split_max_tensors=56, drop_tensors=["output.weight"])
    # the same tensors split at another point: one tensor in both parts
    shutil.copyfile(b[1], a[1])
    with pytest.raises(GGUFError, match=r"inconsistent split set .*tensor '[^']+' is in both x-00001-of-00002.gguf "
                                        r"and x-00002-of-00002.gguf: these parts come from different models"):
        load_weights(a[0])
    # a part of a model with another tensor count
    shutil.copyfile(c[1], a[1])
    with pytest.raises(GGUFError, match=r"x-00002-of-00002.gguf has split.tensors.count = 112 but an earlier part has "
                                        r"113: parts of different models"):
        load_weights(a[1])
    # a part that leaves a tensor out
    b = copy_gguf(f32, tmp_path / "b" / "x.gguf", split_max_tensors=59)
    shutil.copyfile(b[1], a[1])
    with pytest.raises(GGUFError, match=r"split.tensors.count = 113 but the 2 parts hold 112 tensors: parts of "
                                        "different models or a damaged part"):
        load_weights(a[1])


def test_split_part_with_unfindable_siblings(fixtures_dir, tmp_path):
    parts = copy_gguf(open_gguf(fixtures_dir / "tiny-f32.gguf"), tmp_path / "s.gguf", split_max_tensors=60)
    renamed = parts[0].rename(tmp_path / "renamed.gguf")
    with pytest.raises(GGUFError, match="one part of a 2-part split set, but its name does not follow"):
        load_weights(renamed)


# ------------------------------------------------------------------------------------------- fuzz

def _small_model_file(fixtures_dir: Path, path: Path) -> bytes:
    """A small valid GGUF: the tiny model's metadata (strings, string/bool/INT32/UINT64 arrays), one key of every
    other scalar type and three small tensors (F32, F16, Q8_0)."""
    src = open_gguf(fixtures_dir / "tiny-f32.gguf")
    w = GGUFWriter()
    for k, v in src.metadata.items():
        vt, et = src.value_types[k]
        w.add(k, vt, v, et)
    for vt, v in ((ValueType.UINT8, 7), (ValueType.INT8, -7), (ValueType.UINT16, 700), (ValueType.INT16, -700),
                  (ValueType.INT64, -(1 << 40)), (ValueType.FLOAT64, 0.5)):
        w.add(f"test.{vt.name.lower()}", vt, v)
    w.add_tensor("blk.0.ssm_a", (4,), 0, lambda: [torch.arange(4.0)])
    w.add_tensor("blk.0.ssm_conv1d.weight", (2, 4), 1, lambda: [torch.ones(2, 4, dtype=torch.float16)])
    w.add_tensor("token_embd.weight", (512, 32), 8, None)
    w.write(path)
    return path.read_bytes()


@pytest.fixture(scope="module")
def small_gguf(fixtures_dir, tmp_path_factory) -> bytes:
    raw = _small_model_file(fixtures_dir, tmp_path_factory.mktemp("fuzz") / "small.gguf")
    assert len(raw) < 64 << 10
    return raw


_U64 = st.sampled_from([0, 1, 255, 1 << 31, 1 << 32, 1 << 62, (1 << 63) - 1, (1 << 64) - 1])


@settings(max_examples=100, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_header_parser(small_gguf, data):
    """Random byte flips, u64 overwrites and truncations of a valid file: only GGUFError from the reader, only
    strata's own errors from the mapping layer, never a crash or hang."""
    raw = bytearray(small_gguf)
    n = len(raw)
    header_end = min(n, 6000)
    for _ in range(data.draw(st.integers(0, 6), label="flips")):
        pos = data.draw(st.one_of(st.integers(0, 64), st.integers(0, header_end - 1)), label="pos")
        raw[pos] = data.draw(st.integers(0, 255), label="byte")
    if data.draw(st.booleans(), label="u64"):
        pos = data.draw(st.integers(0, header_end - 8), label="u64pos")
        raw[pos:pos + 8] = struct.pack("<Q", data.draw(_U64, label="u64val"))
    cut = data.draw(st.one_of(st.none(), st.integers(0, n)), label="cut")
    if cut is not None:
        del raw[cut:]
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "fuzz.gguf"
        p.write_bytes(bytes(raw))
        try:
            g = GGUFFile(p)
        except GGUFError:
            return
        for info in g.tensors.values():
            assert g.data(info).numel() == info.nbytes
        try:
            weights_from_gguf(GGUFSet([g]))
        except StrataError:
            pass
