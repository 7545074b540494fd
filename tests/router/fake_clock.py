"""A settable clock for the router tests: ``clock.now`` is what ``clock()`` returns.

Imported as ``tests.router.fake_clock`` (pyproject's ``pythonpath = ["."]``;
not named ``test_*`` so pytest does not collect it)."""


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now
