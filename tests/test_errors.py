"""ddpkit.errors: an exception raised in another thread carries its message (carrying), and travels whole."""

from __future__ import annotations

import pickle

from ddpkit._utils.raising import carrying
from ddpkit.errors import PeerFailedError


def test_an_error_made_without_arguments_carries_its_message_and_pickles_as_its_kind():
    kind = carrying(PeerFailedError, "rank 1 failed with ValueError: boom, so rank 0 stops.")
    assert issubclass(kind, PeerFailedError) and kind.__name__ == "PeerFailedError"
    try:
        raise kind  # as PyThreadState_SetAsyncExc raises it: the class, made without arguments
    except PeerFailedError as exc:
        exc.add_note("seen in the main thread")
        back = pickle.loads(pickle.dumps(exc))
    assert type(back) is PeerFailedError and str(back) == "rank 1 failed with ValueError: boom, so rank 0 stops."
    assert back.__notes__ == ["seen in the main thread"]
    assert str(kind("another message")) == "another message"
