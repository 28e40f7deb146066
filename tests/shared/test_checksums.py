"""Weight checksums: written as xxh3-128, sha256 records still verified, a changed byte refused."""

from __future__ import annotations

import hashlib

import pytest
import torch

from shared.checkpoint import CheckpointStore, file_checksum
from shared.model import build_tiny_model, load_model
from shared.model_weights import load_weights


def test_a_version_is_written_with_xxh3_and_loads_only_while_its_bytes_match(tmp_path):
    model = load_model(build_tiny_model(tmp_path / "tiny"))
    weights = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    update = CheckpointStore(tmp_path / "ckpt").save(weights, "m", 1, 1, None)
    assert update.checksum.startswith("xxh3_128:") and update.checksum == file_checksum(update.path)
    other = load_model(build_tiny_model(tmp_path / "tiny2", seed=1))
    load_weights(other, update)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))

    raw = bytearray(open(update.path, "rb").read())
    sha = update.model_copy(update={"checksum": "sha256:" + hashlib.sha256(raw).hexdigest()})
    load_weights(other, sha)  # a record of the older format still verifies
    raw[-1] ^= 1  # one bit of the last tensor
    open(update.path, "wb").write(bytes(raw))
    for rec in (update, sha):
        with pytest.raises(ValueError, match="checksum"):
            load_weights(other, rec)
    with pytest.raises(ValueError, match="unknown checksum algorithm"):
        load_weights(other, update.model_copy(update={"checksum": "md5:00"}))
