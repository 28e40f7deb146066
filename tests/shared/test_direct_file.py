"""shared.disk.DirectFile: the optimizer state's writer past the page cache (real files, real O_DIRECT)."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from shared import checkpoint, disk
from shared.checkpoint import CheckpointStore
from shared.disk import DirectFile

O_DIRECT = getattr(os, "O_DIRECT", 0)


@pytest.mark.parametrize("n", [0, 1, 4095, 4096, 4097, 3 * 8192 + 17])
def test_bytes_come_back_exactly_whatever_the_length_and_the_write_sizes(tmp_path, n):
    data = os.urandom(n)
    with DirectFile(tmp_path / "f", stage_bytes=8192) as f:  # a small stage: several drains, a partial last block
        for i in range(0, n, 1000):
            assert f.write(data[i:i + 1000]) == len(data[i:i + 1000])
    assert (tmp_path / "f").read_bytes() == data  # no padding left at the end
    assert os.stat(tmp_path / "f").st_mode & 0o777 == 0o600


@pytest.mark.skipif(not O_DIRECT, reason="no O_DIRECT on this platform")
def test_the_file_is_open_with_o_direct_while_written(tmp_path):
    f = DirectFile(tmp_path / "f")
    try:
        flags = int(next(line for line in open(f"/proc/self/fdinfo/{f._fd}") if line.startswith("flags")).split()[1], 8)
        assert f.direct and flags & O_DIRECT
    finally:
        f.close()


def test_a_file_system_that_refuses_o_direct_gets_a_buffered_file(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, mode=0o777):
        if flags & O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode)

    monkeypatch.setattr(disk.os, "open", no_direct)
    with DirectFile(tmp_path / "f") as f:
        f.write(b"x" * 5000)
    assert not f.direct and (tmp_path / "f").read_bytes() == b"x" * 5000


def test_other_open_errors_are_raised(tmp_path):
    with pytest.raises(FileNotFoundError):
        DirectFile(tmp_path / "missing-dir" / "f")
    with pytest.raises(ValueError, match="multiple of 4096"):
        DirectFile(tmp_path / "f", stage_bytes=1000)


def test_the_store_writes_the_optimizer_state_through_it_and_resume_reads_it(tmp_path, monkeypatch):
    opened = []
    real_init = DirectFile.__init__

    def spy(self, path, *a, **k):
        opened.append(os.path.basename(path))
        real_init(self, path, *a, **k)

    monkeypatch.setattr(DirectFile, "__init__", spy)
    store = CheckpointStore(tmp_path / "ck")
    moments = {"state": {0: {"step": torch.tensor(2.0), "exp_avg": torch.randn(70_001)}}, "param_groups": [{"lr": 0.1}]}
    store.save({"w": torch.ones(3)}, "m", 1, 1, {"step": 1, "optimizer": moments})
    assert opened == ["optimizer.pt.tmp"]  # the bulk only; the small trainer state stays buffered
    state = store.load_trainer_state(1)
    assert state["step"] == 1 and torch.equal(state["optimizer"]["state"][0]["exp_avg"], moments["state"][0]["exp_avg"])


def test_the_checksum_is_the_files_and_a_corrupt_optimizer_state_is_refused_at_resume(tmp_path):
    with DirectFile(tmp_path / "f", stage_bytes=8192) as f:
        f.write(os.urandom(20_000))
    assert f.checksum == checkpoint.file_checksum(tmp_path / "f")

    store = CheckpointStore(tmp_path / "ck")
    moments = {"state": {0: {"exp_avg": torch.arange(50_000, dtype=torch.float32)}}}
    store.save({"w": torch.ones(3)}, "m", 1, 1, {"step": 1, "optimizer": moments})
    assert torch.equal(store.load_trainer_state(1)["optimizer"]["state"][0]["exp_avg"], moments["state"][0]["exp_avg"])
    path = store.version_dir(1) / "optimizer.pt"
    raw = bytearray(path.read_bytes())
    at = raw.find(torch.tensor([12_345.0]).numpy().tobytes())
    raw[at] ^= 0xFF  # one flipped byte inside a moment: torch.load alone would load it without a word
    path.write_bytes(raw)
    with pytest.raises(ValueError, match="optimizer state is corrupt"):
        store.load_trainer_state(1)


def test_live_weights_are_the_parameters_themselves_with_tied_ones_once():
    from shared.model_weights import live_weights, snapshot_weights

    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight  # tied, as SmolLM2's output layer is to its embedding
    live, copied = live_weights(model), snapshot_weights(model)
    assert list(live) == list(copied) == ["0.weight"]
    assert live["0.weight"].data_ptr() == model[0].weight.data_ptr()  # no copy
    assert copied["0.weight"].data_ptr() != model[0].weight.data_ptr()
    model[0].weight.data = model[0].weight.data.t().contiguous().t()  # a transposed (non-contiguous) view
    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        live_weights(model)


def test_torch_saves_without_its_crc_inside_the_scope_and_with_it_after(tmp_path):
    import zipfile

    with checkpoint._torch_crc32(False):
        torch.save({"a": torch.arange(1000.0)}, tmp_path / "off.pt")
    torch.save({"a": torch.arange(1000.0)}, tmp_path / "on.pt")
    crc = lambda p: [i.CRC for i in zipfile.ZipFile(p).infolist() if "/data/" in i.filename]  # noqa: E731
    assert crc(tmp_path / "off.pt") == [0] and crc(tmp_path / "on.pt") != [0]


def test_a_file_system_that_refuses_o_direct_on_write_gets_buffered_writes(tmp_path, monkeypatch):
    real_write = os.write
    refused = []

    def write(fd, data):
        import fcntl
        if fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(disk.os, "write", write)
    with DirectFile(tmp_path / "f", stage_bytes=8192) as f:
        f.write(b"y" * 20_000)
    assert refused and not f.direct and (tmp_path / "f").read_bytes() == b"y" * 20_000


def test_a_write_that_stores_nothing_is_a_full_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(disk.os, "write", lambda fd, data: 0)
    f = DirectFile(tmp_path / "f", stage_bytes=8192)
    with pytest.raises(OSError) as e:
        f.write(b"z" * 10_000)
    assert disk.is_disk_full(e.value)
    with pytest.raises(OSError):
        f.close()  # the last drain fails the same way; the descriptor is closed anyway
    assert f.closed
