"""dlinfer/ops/_checks.py's shape check: the error names the first dimension that differs (the loop
counts dimensions itself since it zips instead of enumerating, for Dynamo's sake)."""

import pytest
import torch

from dlinfer.errors import InvalidArgumentError
from dlinfer.ops import _checks as C


@pytest.mark.parametrize("shape, dims, dim", [((2, 3), (2, 2), 1), ((3, 2), (2, "K"), 0), ((4, 5, 6), ("T", 5, 7), 2)])
def test_the_error_names_the_first_dimension_that_differs(shape, dims, dim):
    with pytest.raises(InvalidArgumentError, match=rf"argument 'w': expected size \d+ in dim {dim} of "):
        C.tensor("op", "w", torch.zeros(shape), dims)


def test_matching_shapes_pass_and_return_the_tensor():
    t = torch.zeros(3, 2)
    assert C.tensor("op", "w", t, ("N", 2), C.FLOAT_DTYPES, t.device) is t
