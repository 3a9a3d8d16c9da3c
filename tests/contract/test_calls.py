"""The one argument helper pair and the one `original`, on plain functions and on real wrapt wrappers."""

import functools

import pytest
import wrapt

from mtp_overlay.calls import REQUIRED, argument, original, positions, with_argument


def stock(tensor, shifts=-1, *, group=None):
    return tensor, shifts, group


def test_argument_reads_where_the_call_put_it_and_says_what_is_missing():
    assert argument((1, 2), {}, 1, "shifts") == 2
    assert argument((1,), {"shifts": 3}, 1, "shifts") == 3
    assert argument((1,), {}, 1, "shifts", -1) == -1
    assert argument((), {"group": "g"}, None, "group") == "g"  # keyword-only: position None
    assert argument((1, 2), {}, None, "group", None) is None
    with pytest.raises(TypeError, match=r"the call carries no argument 'shifts' \(position 1\)"):
        argument((1,), {}, 1, "shifts")
    with pytest.raises(TypeError, match=r"no argument 'group' \(keyword-only\)"):
        argument((1,), {}, None, "group", REQUIRED)


def test_with_argument_keeps_the_call_shape_and_leaves_the_caller_alone():
    args, kwargs = (1, 2), {"group": "g"}
    assert with_argument(args, kwargs, 1, "shifts", 5) == ((1, 5), {"group": "g"})
    assert with_argument((1,), {"shifts": 2}, 1, "shifts", 5) == ((1,), {"shifts": 5})
    assert with_argument((1,), {}, 1, "shifts", 5) == ((1,), {"shifts": 5})  # absent: a keyword
    assert with_argument(args, kwargs, None, "group", "h") == ((1, 2), {"group": "h"})
    assert args == (1, 2) and kwargs == {"group": "g"}
    new_args, new_kwargs = with_argument(args, kwargs, 0, "tensor", 9)
    assert stock(*new_args, **new_kwargs) == (9, 2, "g")


def test_positions_read_the_stock_signature_and_drop_self_for_a_method():
    class Model:
        def forward(self, input_ids, labels=None, *, loss_mask=None):
            return input_ids

    assert positions(stock) == {"tensor": 0, "shifts": 1}
    assert positions(Model.forward, method=True) == {"input_ids": 0, "labels": 1}


def test_original_looks_through_every_wrapper_ours_and_others():
    @functools.wraps(stock)
    def decorated(*args, **kwargs):
        return stock(*args, **kwargs)

    wrapped = wrapt.FunctionWrapper(decorated, lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs))
    assert original(wrapped) is stock and original(decorated) is stock and original(stock) is stock
    assert positions(wrapped) == {"tensor": 0, "shifts": 1}
