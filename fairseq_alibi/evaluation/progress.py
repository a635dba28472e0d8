"""What a run tells the user as it goes: the logging it keeps, the progress bar
(on a terminal only) and each finished cell's line with the time left."""

from __future__ import annotations

import logging
import sys
import time


def progress(total: int, initial: int, desc: str, disable: bool):
    """The progress bar, on a terminal only: redirected to a log, a bar is lines of
    carriage returns and padding (each finished cell's line says the time left)."""
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, disable=disable or not sys.stderr.isatty(), desc=desc,
                unit="cell", dynamic_ncols=True, file=sys.stderr)


def duration(seconds: float) -> str:
    """``42s``, ``7m05s``, ``2h03m``."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Countdown:
    """Cells finished in this run and the time left, from their mean time so far."""

    def __init__(self, total: int, done: int):
        self.total, self.done, self.ran = total, done, 0
        self.start = time.monotonic()

    def finished(self) -> str:
        """Count one finished cell; ``[cell 12/48, 3m10s so far, about 9m20s left]``."""
        self.done, self.ran = self.done + 1, self.ran + 1
        spent = time.monotonic() - self.start
        left = spent / self.ran * (self.total - self.done)
        return (f"[cell {self.done}/{self.total}, {duration(spent)} so far"
                + (f", about {duration(left)} left]" if self.done < self.total else ", done]"))


def quiet_logging(verbose: bool) -> None:
    """INFO from this package; fairseq's own INFO only with ``--verbose``."""
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
                        level=logging.INFO, stream=sys.stderr, force=True)
    for name in ("matplotlib", "PIL", "hydra"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if not verbose:
        for name in ("fairseq", "fairseq_cli"):
            logging.getLogger(name).setLevel(logging.WARNING)
