"""Which of the slow fault-injection cases (several trainer processes each) a test run takes: one a
day by default, chosen by the date, so CI covers all of them over a week while each run stays short.
JTOPOEP_FAULT_CASES=all runs every case; a comma-separated list of case names runs those."""

import datetime
import os

import pytest

CASES = ("sigkill-0", "sigkill-1", "sigkill-2", "sigkill-3", "killed-peer")


def skip_unless_sampled(case: str) -> None:
    chosen = os.environ.get("JTOPOEP_FAULT_CASES", "")
    if chosen == "all" or case in chosen.split(","):
        return
    if not chosen and case == CASES[datetime.date.today().toordinal() % len(CASES)]:
        return
    pytest.skip(f"{case} is not in this run's sample of fault-injection cases; JTOPOEP_FAULT_CASES=all runs them all")
