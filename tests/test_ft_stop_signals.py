"""A replica asked to stop (SIGTERM, Ctrl-C) stops even when the signal lands inside a torch
future's callback, where torch logs the KeyboardInterrupt and drops it."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from mtdao.train.fault_tolerance.replica import raise_if_asked_to_stop, stop_on_signals


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_dropped_inside_a_future_callback_is_raised_before_the_next_step(number):
    before = signal.getsignal(number)
    with stop_on_signals():
        raise_if_asked_to_stop()  # nothing asked yet
        future = torch.futures.Future()

        def callback(done):
            os.kill(os.getpid(), number)  # the handler runs here, inside torch's callback

        future.add_done_callback(callback)
        future.set_result(None)  # torch logs the KeyboardInterrupt raised in it and goes on
        with pytest.raises(KeyboardInterrupt, match=signal.Signals(number).name):
            raise_if_asked_to_stop()
    with stop_on_signals():  # a new replica in this process starts unasked
        raise_if_asked_to_stop()
    assert signal.getsignal(number) is before  # the handler from before is back
