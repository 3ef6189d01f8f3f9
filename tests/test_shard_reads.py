"""``sweep``: one read of a shard, hashed and handed out in row blocks, with O_DIRECT and without."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

from clef_flash.engine.shard_reads import ALIGN, ShardReader, spans, tensor_rows
from clef_flash.engine.streamed_weights import TensorInfo
from clef_flash.errors import IntegrityError


def _file(tmp_path, head: int = 1237):
    """A file of random bytes holding three bf16 tensors at offsets no block divides, with bytes
    before, between and after them."""
    rng = np.random.default_rng(7)
    shapes = {"a": (37, 96), "b": (5, 4100), "c": (200, 32)}
    infos, at = [], head
    for name, shape in shapes.items():
        infos.append(TensorInfo(name, "f.bin", "BF16", shape, at))
        at += infos[-1].nbytes + 333
    data = rng.integers(0, 256, at + 77, dtype=np.uint8).tobytes()
    (tmp_path / "f.bin").write_bytes(data)
    return tmp_path / "f.bin", data, infos


def _takes_o_direct(path) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        return True
    except (OSError, AttributeError):  # a tmpfs, or no O_DIRECT on this system
        return False


def test_spans_cover_the_file_once_in_whole_rows(tmp_path):
    path, data, infos = _file(tmp_path)
    got = spans(len(data), infos, piece_bytes=1000)
    assert got[0].start == 0 and got[-1].end == len(data)
    assert all(x.end == y.start for x, y in zip(got, got[1:]))
    for i, t in enumerate(infos):
        mine = [s for s in got if s.tensor == i]
        row = t.nbytes // t.shape[0]
        assert mine[0].start == t.offset and mine[-1].end == t.offset + t.nbytes
        assert all((s.end - s.start) == (s.r1 - s.r0) * row for s in mine) and [s.r0 for s in mine[1:]] == [s.r1 for s in mine[:-1]]
    with pytest.raises(ValueError, match="overlap"):
        spans(len(data), infos + [TensorInfo("d", "f.bin", "BF16", (2, 8), infos[1].offset + 4)])
    with pytest.raises(IntegrityError, match="ends inside c"):
        spans(infos[2].offset + 10, infos)


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("piece", [ALIGN - 1, 3 * ALIGN + 5, 1 << 20])
def test_a_sweep_gives_every_tensors_bytes_and_the_files_sha256(tmp_path, direct, piece):
    path, data, infos = _file(tmp_path)
    with ShardReader(path, infos, piece_bytes=piece, direct=direct) as sw:
        seen = []
        for i, rows in sw.tensors():
            t = infos[i]
            row = t.nbytes // t.shape[0]
            got = b"".join(bytes(raw) for r0, r1, raw in rows)
            assert got == data[t.offset:t.offset + t.nbytes], (i, piece)
            seen.append(t.name)
        assert seen == ["a", "b", "c"] and sw.digest == hashlib.sha256(data).hexdigest()
        assert sw.direct == (direct and _takes_o_direct(path))
    # rows left unread by the caller are released, and the digest still covers every byte
    with ShardReader(path, infos, piece_bytes=piece, direct=direct) as sw:
        assert [i for i, _rows in sw.tensors()] == [0, 1, 2] and sw.digest == hashlib.sha256(data).hexdigest()
    one = b"".join(bytes(raw) for _, _, raw in tensor_rows(tmp_path, infos[1], piece_bytes=piece, direct=direct))
    assert one == data[infos[1].offset:infos[1].offset + infos[1].nbytes]


def test_a_sweep_without_o_direct_and_a_short_file(tmp_path, monkeypatch):
    """A file system that refuses O_DIRECT gets plain reads (the same bytes); a file shorter than
    its tensors say is an error naming the tensor; a sweep closed half-way ends its threads."""
    path, data, infos = _file(tmp_path)
    real = os.open
    monkeypatch.setattr(os, "open", lambda p, flags, *a: (_ for _ in ()).throw(OSError(22, "no O_DIRECT"))
                        if flags & getattr(os, "O_DIRECT", 0) else real(p, flags, *a))
    with ShardReader(path, infos, piece_bytes=5000) as sw:
        assert not sw.direct
        assert [b"".join(bytes(r) for *_, r in rows) for _, rows in sw.tensors()] == [
            data[t.offset:t.offset + t.nbytes] for t in infos] and sw.digest == hashlib.sha256(data).hexdigest()
    monkeypatch.setattr(os, "open", real)
    short = tmp_path / "short"
    short.mkdir()
    (short / "f.bin").write_bytes(data[: infos[1].offset + 100])
    with pytest.raises(IntegrityError, match="ends inside b"):
        b"".join(bytes(r) for *_, r in tensor_rows(short, infos[1]))
    with pytest.raises(IntegrityError, match=r"short/f.bin: ends inside b"):  # the first tensor past the end
        ShardReader(short / "f.bin", infos)
    sw = ShardReader(path, infos, piece_bytes=ALIGN)
    next(iter(sw.tensors()))
    sw.close()
    assert not any(th.is_alive() for th in sw._threads)


def test_an_o_direct_read_refused_goes_on_buffered(tmp_path):
    """``direct_io.refused``: EINVAL on a descriptor opened with O_DIRECT (here: a read at an offset
    no block divides) clears the flag and the same read then works; any other error, or EINVAL on a
    buffered descriptor, is not a refusal."""
    import errno

    from clef_flash.direct_io import open_direct, refused

    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(256)) * 64)
    fd, direct = open_direct(path, os.O_RDONLY)
    try:
        if not direct:
            pytest.skip("this file system does not take O_DIRECT")
        buf = bytearray(100)
        with pytest.raises(OSError) as exc:
            os.preadv(fd, [buf], 1)
        assert exc.value.errno == errno.EINVAL and refused(fd, exc.value)
        assert os.preadv(fd, [buf], 1) == 100 and bytes(buf) == bytes(range(1, 101))
        assert not refused(fd, exc.value)  # buffered now: an EINVAL is an EINVAL
        assert not refused(fd, OSError(errno.EIO, "i/o"))
    finally:
        os.close(fd)
