"""Step inputs built through numpy are the tensors torch.tensor would build."""

import torch

from actors.host_tensors import int64_tensor, padded_int64_rows


def test_int64_tensor_and_padded_rows():
    assert torch.equal(int64_tensor([3, 1, 2**40]), torch.tensor([3, 1, 2**40]))
    assert int64_tensor([]).shape == (0,) and int64_tensor([]).dtype == torch.long
    rows = padded_int64_rows([[1, 2, 3], [], [4]], pad=-7)
    assert torch.equal(rows, torch.tensor([[1, 2, 3], [-7, -7, -7], [4, -7, -7]]))
    assert padded_int64_rows([[5]], pad=0, width=3).tolist() == [[5, 0, 0]]
